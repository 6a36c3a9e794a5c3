"""Distributed glue: the only module that knows about DeepSpeed and FSDP specifics.

The strategy (DDP, FSDP2, ZeRO-2/3, ZeRO-3 offload) is chosen by the accelerate config file alone; this module
builds the `Accelerator`, names the strategy, fills the DeepSpeed values accelerate cannot infer (we do not hand
it our dataloaders) and picks the optimizer class each strategy needs.

CPU compatibility: without an accelerator, accelerate's backend selection drops DeepSpeed and FSDP (each process
then thinks it is alone). `apply_cpu_compat` routes such runs to gloo on the CPU device while keeping the
DEEPSPEED / FSDP distributed type, so every strategy can be tested on a laptop or CI box. It does nothing when an
accelerator is present.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from toolkit.errors import ToolkitError

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


def check_launch_files() -> None:
    """A DeepSpeed JSON named by the accelerate config must exist (accelerate's own error is a JSON traceback)."""
    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if _env_flag("ACCELERATE_USE_DEEPSPEED") and ds_file and ds_file != "none" and not os.path.isfile(ds_file):
        raise ToolkitError(
            f"The accelerate config names the DeepSpeed config '{ds_file}', which does not exist (relative paths "
            f"are taken from the working directory, here {os.getcwd()}). Launch from the repository root or "
            "fix deepspeed_config_file in the accelerate config.")


def build_accelerator(grad_accum: int, timeout_minutes: float, log_with: list[str] | None = None,
                      project_dir: str | None = None) -> Accelerator:
    """The run's Accelerator: the strategy, mixed precision and process layout come from `accelerate launch`."""
    check_launch_files()
    apply_cpu_compat()
    return Accelerator(
        gradient_accumulation_steps=grad_accum,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))],
        log_with=log_with,
        project_dir=project_dir,
        # We step the LR scheduler ourselves once per optimizer step (accelerate would step it once per process).
        step_scheduler_with_optimizer=False,
    )


def ds_config(accelerator: Accelerator) -> dict[str, Any] | None:
    """The live DeepSpeed config dict, or None when DeepSpeed is not in use."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return accelerator.state.deepspeed_plugin.deepspeed_config


def strategy_name(accelerator: Accelerator) -> str:
    """A short name for the active strategy, for logs, metrics and checkpoint metadata."""
    cfg = ds_config(accelerator)
    if cfg is not None:
        zero = cfg.get("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        offload = any(
            zero.get(k, {}).get("device", "none") not in ("none", None)
            for k in ("offload_optimizer", "offload_param")
        )
        return f"zero{stage}" + ("_offload" if offload else "")
    if accelerator.distributed_type == DistributedType.FSDP:
        return f"fsdp{accelerator.state.fsdp_plugin.fsdp_version}"
    if accelerator.num_processes > 1:
        return "ddp"
    return "single"


def configure_deepspeed(accelerator: Accelerator, micro_batch_size: int, max_grad_norm: float) -> None:
    """Fill the DeepSpeed values that accelerate infers from a prepared dataloader (we prepare none).

    Clipping is done by DeepSpeed inside its step, so the recipe's max_grad_norm must reach its config.
    """
    cfg = ds_config(accelerator)
    if cfg is None:
        return
    if "scheduler" in cfg:
        raise ToolkitError(
            "The DeepSpeed config defines a 'scheduler'. Learning-rate schedules are per stage and belong in "
            "the recipe (schedule: / stages[].lr); remove 'scheduler' from the DeepSpeed JSON."
        )
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["train_batch_size"] = micro_batch_size * accelerator.gradient_accumulation_steps * accelerator.num_processes
    if cfg.get("gradient_clipping", "auto") == "auto":
        cfg["gradient_clipping"] = max_grad_norm


def build_optimizer(accelerator: Accelerator, params: list[torch.nn.Parameter], *, lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """AdamW, in the form the strategy needs.

    ZeRO with optimizer offload to CPU wants DeepSpeed's CPU Adam (same AdamW maths, vectorised on the host);
    a DeepSpeed JSON with its own 'optimizer' gets accelerate's DummyOptim so DeepSpeed builds it.
    """
    cfg = ds_config(accelerator)
    if cfg is not None and "optimizer" in cfg:
        from accelerate.utils import DummyOptim

        return DummyOptim(params, lr=lr, weight_decay=weight_decay)
    offload = (cfg or {}).get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload not in ("none", None):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, adamw_mode=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


def broadcast_from_main(accelerator: Accelerator, value: Any) -> Any:
    """A value decided on rank 0 (run name, timestamp), shared with every rank."""
    from accelerate.utils import broadcast_object_list

    box = [value if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return box[0]
