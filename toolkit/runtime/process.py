"""Process-level distributed glue: building the Accelerator, CPU/gloo compatibility, the launch checks, sharing a
value from rank 0, withholding an update on every rank, the launch's failure record and a clean exit.

Strategy specifics (DeepSpeed's and FSDP's APIs and configs, how they shard, name and checkpoint) live in
toolkit/strategies/, and this module calls that package; the one exception is the CPU compatibility below, which
runs before any strategy is set up and reads accelerate's DeepSpeed/FSDP launch variables. The strategy (DDP,
FSDP2, ZeRO-2/3, ZeRO-3 offload) is chosen by the accelerate config file alone.

CPU compatibility: without an accelerator, accelerate's backend selection drops DeepSpeed and FSDP (each process
then thinks it is alone). `apply_cpu_compat` routes such runs to gloo on the CPU device while keeping the
DEEPSPEED / FSDP distributed type, so every strategy can be tested on a laptop or CI box. It does nothing when an
accelerator is present.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs

from toolkit.atomic import writing
from toolkit.errors import ToolkitError
from toolkit.strategies import build_locks, deepspeed, fsdp, sequence_parallel

log = logging.getLogger(__name__)
_ORIGINAL_PREPARE_BACKEND = PartialState._prepare_backend


def has_accelerator() -> bool:
    """True when torch sees a GPU (or another accelerator) on this machine."""
    return torch.accelerator.is_available()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def _prepare_backend_on_cpu(
    self: PartialState, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None
) -> tuple[str | None, DistributedType]:
    """`PartialState._prepare_backend`, but a launched multi-process run on CPU gets gloo instead of nothing."""
    chosen, dist_type = _ORIGINAL_PREPARE_BACKEND(self, cpu, sagemaker_dp, backend)
    launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
    if dist_type != DistributedType.NO or cpu or not launched:
        return chosen, dist_type
    if _env_flag("ACCELERATE_USE_DEEPSPEED") or _env_flag("ACCELERATE_USE_FSDP"):
        # MULTI_GPU is the only type from which accelerate upgrades to DEEPSPEED / FSDP; the device stays the CPU
        # because ACCELERATE_TORCH_DEVICE pins it (set in apply_cpu_compat).
        return "gloo", DistributedType.MULTI_GPU
    return "gloo", DistributedType.MULTI_CPU


def apply_cpu_compat() -> bool:
    """Make every accelerate config run multi-process on CPU over gloo. Returns True when it did anything.

    Must run before the first `Accelerator()`; a no-op on machines with an accelerator.
    """
    if has_accelerator():
        return False
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: gloo collectives, CPU ops
    PartialState._prepare_backend = _prepare_backend_on_cpu  # type: ignore[method-assign]
    return True


def check_launch_config() -> None:
    """Refuse, in one line and before anything loads, the launch shapes this toolkit cannot train as asked.

    Reads what `accelerate launch` put in the environment: fp8 is not supported; fp16 needs a GPU; then the
    strategy's own checks (FSDP must be FSDP2, a DeepSpeed JSON must exist and agree with the launch's
    precision), and the accelerate config's `parallelism_config` (toolkit/strategies/sequence_parallel.py).
    """
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "fp8":
        raise ToolkitError("mixed_precision: fp8 is not supported (the training paths here are not fp8-aware): "
                           "set mixed_precision: bf16 in the accelerate config or pass --mixed_precision bf16.")
    if precision == "fp16" and not has_accelerator():
        raise ToolkitError("mixed_precision: fp16 needs a GPU (CPU autocast and DeepSpeed's CPU accelerator have no "
                           "fp16 loss scaling): on CPU use mixed_precision: bf16 or no.")
    fsdp.check_fsdp_version()
    deepspeed.check_deepspeed_file(precision)
    sequence_parallel.check_launch()  # parallelism_config: Ulysses under DeepSpeed only, sizes that add up


def quiet_library_logs() -> None:
    """What a user reads during a launch: no library warning repeated every step, one line per checkpoint.

    torch warns on every ZeRO-3 collective that DeepSpeed's `all_gather_into_tensor` / `reduce_scatter_tensor`
    are deprecated, transformers on every rank about PEFT's `is_gradient_checkpointing` and the
    `gradient_checkpointing_enable` name: nothing a user can act on. accelerate logs five '[RANK 0] Saving ...'
    lines per checkpoint; the training log has its own one.
    """
    for message in (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                    r"`(is_gradient_checkpointing|gradient_checkpointing_enable)` is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    for name in ("accelerate.accelerator", "accelerate.checkpointing", "accelerate.utils.fsdp_utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


def build_accelerator(grad_accum: int, timeout_minutes: float, log_with: list[str] | None = None,
                      project_dir: str | None = None) -> Accelerator:
    """The run's Accelerator: the strategy, mixed precision and process layout come from `accelerate launch`;
    accumulation is the recipe's (accelerate would take an accelerate config's DeepSpeed value over it)."""
    check_launch_config()
    quiet_library_logs()
    apply_cpu_compat()
    if deepspeed.launched_with_deepspeed():
        build_locks.clear_stale_build_locks(wait=True)  # DeepSpeed loads its JIT ops while the Accelerator is created
    accelerator = Accelerator(
        # The loop fetches a step's micro-batches before its first forward (the loss is normalised over all of
        # them): the end of a stage's DataLoader must not force a gradient sync on the step's earlier micro-steps.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=grad_accum, sync_with_dataloader=False),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))],
        log_with=log_with,
        project_dir=project_dir,
        # We step the LR scheduler ourselves once per optimizer step (accelerate would step it once per process).
        step_scheduler_with_optimizer=False,
    )
    accelerator.gradient_accumulation_steps = grad_accum
    return accelerator


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def gpu_defaults() -> list[str]:
    """The GPU settings peers tune, applied before CUDA is initialised; returns what was applied (for the log).

    * `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` unless the user set an allocator config: segments that grow
      in place instead of new blocks per size, so varying sequence lengths (packing, curricula) do not fragment
      memory into OOMs. Read when CUDA first allocates, so this runs first thing in a training process.
    * TF32 for fp32 matmuls and convolutions on CUDA (10-bit mantissa inputs, fp32 accumulation): full fine-tuning
      keeps fp32 weights whose matmuls would otherwise run at a fraction of the tensor-core rate. Nothing changes on
      the CPU (the golden fp32 losses of the tests stay bit for bit).
    """
    applied = []
    if not any(var in os.environ for var in ALLOC_CONF_VARS):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        applied.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        applied.append("TF32 for fp32 matmuls")
    return applied


def device_name(accelerator: Accelerator) -> str | None:
    """Accelerator model name (for the peak-FLOP/s lookup), None on CPU."""
    if accelerator.device.type == "cuda":
        return torch.cuda.get_device_name(accelerator.device)
    return None


def broadcast_from_main(accelerator: Accelerator, value: Any) -> Any:
    """A value decided on rank 0 (run name, timestamp), shared with every rank."""
    from accelerate.utils import broadcast_object_list

    box = [value if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return box[0]


def record_launch_error(message: str) -> None:
    """Hand a one-line `error: ...` (already printed) to torchrun as this rank's failure record.

    The launcher then ends its 'Root Cause' summary (printed after its own traceback) with this line instead of
    'To enable traceback see ...', so the reason stays in view under the launcher's output. No-op unlaunched.
    """

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError), open(error_file, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


def finish_trackers(accelerator: Accelerator) -> None:
    """What `accelerator.end_training()` does at a run's end, except its `destroy_process_group()`: the trackers are
    finished, and the process group is left to the process's end (`exit_without_teardown`).

    A DDP model holds the process group in C++ (its Reducer). Destroyed while the model lives (end_training inside
    `train`), the group's last reference goes when the model is freed, and ProcessGroupGloo's destructor waits for
    its worker threads with the GIL held, while a worker that is finishing the last collective needs the GIL to free
    a tensor made in Python: the rank hangs after its run is done (a CI launch did; PyTorch guards the Python-held
    group against exactly this, not the Reducer's reference). Checked by tests/e2e/test_strategies.py's spy."""
    with writing(Path(accelerator.logging_dir or ".")):  # their last events are flushed here
        for tracker in accelerator.trackers:
            tracker.finish()


def exit_without_teardown(code: int) -> None:
    """End the process after a run (finished, stopped or failed), skipping interpreter teardown.

    Everything is flushed first, so nothing is lost. Nothing is torn down: with DeepSpeed ZeRO-3 on gloo, a process
    that finished and destroyed its process group still aborted now and then in C++ static destruction ('terminate
    called without an active exception', SIGABRT), which turned a good run into a failed launch; destroying the
    group can deadlock (`finish_trackers`), or wait on a peer that is gone. The process's end closes its
    connections.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def process_gone(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie not yet reaped by the launcher counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):  # no /proc (not Linux): it answered the signal, so it runs
        return False
