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

import contextlib
import json
import logging
import os
import warnings
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from toolkit.errors import ToolkitError

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


# Keys a DeepSpeed JSON reads itself: accelerate refuses them in the accelerate config next to the JSON's name.
_DS_FILE_OWNS = {"gradient_accumulation_steps": "gradient_accumulation_steps",
                 "gradient_clipping": "gradient_clipping", "zero_stage": "zero_optimization.stage",
                 "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
                 "offload_param_device": "zero_optimization.offload_param.device",
                 "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
                 "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
                 "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save"}


def check_launch_config() -> None:
    """Refuse, in one line and before anything loads, the launch shapes this toolkit cannot train as asked.

    Reads what `accelerate launch` put in the environment: the DeepSpeed JSON must exist and agree with the
    launch's precision; FSDP must be FSDP2; fp8 is not supported; fp16 needs a GPU.
    """
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "fp8":
        raise ToolkitError("mixed_precision: fp8 is not supported (the training paths here are not fp8-aware): "
                           "set mixed_precision: bf16 in the accelerate config or pass --mixed_precision bf16.")
    if precision == "fp16" and not has_accelerator():
        raise ToolkitError("mixed_precision: fp16 needs a GPU (CPU autocast and DeepSpeed's CPU accelerator have no "
                           "fp16 loss scaling): on CPU use mixed_precision: bf16 or no.")
    if _env_flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ToolkitError(
            "The accelerate config selects FSDP1 (fsdp_config.fsdp_version is 1 or missing); this toolkit shards with "
            "FSDP2: set fsdp_config.fsdp_version: 2 (`accelerate to-fsdp2 --config_file <file> --output_file <new>` "
            "converts the other keys; see accelerate_configs/fsdp.yaml).")
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        _check_deepspeed_file(precision)


def _check_deepspeed_file(precision: str) -> None:
    """The DeepSpeed JSON named by the accelerate config exists and decides what accelerate lets it decide.

    accelerate refuses `mixed_precision` in an accelerate config that names a JSON, even when the JSON leaves
    precision "auto" for accelerate to fill from it (as ours do). Precision then is the launch's, and the refusal
    is lifted; a JSON with an explicit `bf16` / `fp16` `enabled` must agree with it.
    """
    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if ds_file == "none":
        return  # inline deepspeed_config: accelerate builds the JSON from the accelerate config
    if not os.path.isfile(ds_file):
        raise ToolkitError(
            f"The accelerate config names the DeepSpeed config '{ds_file}', which does not exist (relative paths "
            f"are taken from the working directory, here {os.getcwd()}). Launch from the repository root or "
            "fix deepspeed_config_file in the accelerate config.")
    try:
        with open(ds_file) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{ds_file}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}).") from None
    fields = [f for f in os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if f]
    for field in fields:
        if field in _DS_FILE_OWNS:
            raise ToolkitError(
                f"The accelerate config sets deepspeed_config.{field} next to deepspeed_config_file: DeepSpeed reads "
                f"it from {ds_file} ('{_DS_FILE_OWNS[field]}'). Remove it from the accelerate config and set it "
                "in the JSON.")
    if "mixed_precision" not in fields:
        return
    for dtype in ("bf16", "fp16"):
        enabled = cfg.get(dtype, {}).get("enabled", "auto")
        if enabled != "auto" and bool(enabled) != (precision == dtype):
            raise ToolkitError(
                f"{ds_file} sets {dtype}.enabled: {str(enabled).lower()} but the accelerate config sets "
                f"mixed_precision: {precision}. Make them agree, or set \"enabled\": \"auto\" in the JSON so the "
                "accelerate config decides.")
    os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(f for f in fields if f != "mixed_precision")


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
    accelerator = Accelerator(
        gradient_accumulation_steps=grad_accum,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))],
        log_with=log_with,
        project_dir=project_dir,
        # We step the LR scheduler ourselves once per optimizer step (accelerate would step it once per process).
        step_scheduler_with_optimizer=False,
    )
    accelerator.gradient_accumulation_steps = grad_accum
    return accelerator


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


def configure_deepspeed(accelerator: Accelerator, model: torch.nn.Module, micro_batch_size: int,
                        max_grad_norm: float) -> None:
    """Make the DeepSpeed config train the recipe's batch, accumulation, clipping, optimizer and schedule.

    The recipe owns `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`, `train_batch_size` and
    `gradient_clipping` (DeepSpeed clips inside its step): whatever a JSON or an inline `deepspeed_config` says,
    the recipe's values are written, and one log line names each value the file set differently. `optimizer` /
    `scheduler` blocks whose values are all "auto" (they ask the trainer for its own) are dropped for the recipe's
    AdamW and per-stage schedule; any other is refused. Also fills the bucket sizes accelerate derives from
    `model.config.hidden_size` (which vision-language configs only have under `text_config`), and gives the
    parameters ZeRO-3 did not create one 16-bit dtype (`_one_trainable_dtype`).
    """
    cfg = ds_config(accelerator)
    if cfg is None:
        return
    hidden_size = model.config.get_text_config().hidden_size
    _one_trainable_dtype(cfg, model)
    overridden = own_deepspeed_config(cfg, micro_batch_size=micro_batch_size,
                                      grad_accum=accelerator.gradient_accumulation_steps,
                                      num_processes=accelerator.num_processes, max_grad_norm=max_grad_norm)
    if overridden:
        log.info("DeepSpeed config: the recipe's values win: %s", "; ".join(overridden))
    zero = cfg.get("zero_optimization", {})
    sizes = {"reduce_bucket_size": hidden_size * hidden_size,  # accelerate's own formulas
             "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
             "stage3_param_persistence_threshold": 10 * hidden_size}
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value


def _one_trainable_dtype(cfg: dict[str, Any], model: torch.nn.Module) -> None:
    """ZeRO-3 in bf16 / fp16: cast the parameters created after `zero.Init` to the 16-bit dtype.

    With zero3_init_flag the base model is built partitioned in the 16-bit dtype, but LoRA adapters (fp32) and
    PEFT's modules_to_save copies are made afterwards, and ZeRO-3, unlike ZeRO-1/2, does not cast the module
    itself: trainable parameters of two dtypes then fail in its partitioning. DeepSpeed keeps fp32 master copies
    of them, so the updates stay fp32, as with ZeRO-2 (whose engine casts the whole model the same way).
    """
    if int(cfg.get("zero_optimization", {}).get("stage", 0)) != 3:
        return
    enabled = {dtype: cfg.get(key, {}).get("enabled") is True
               for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))}
    low = next((dtype for dtype, on in enabled.items() if on), None)
    if low is None:
        return
    for param in model.parameters():
        if not hasattr(param, "ds_id") and param.is_floating_point() and param.dtype != low:
            param.data = param.data.to(low)


def own_deepspeed_config(cfg: dict[str, Any], *, micro_batch_size: int, grad_accum: int, num_processes: int,
                         max_grad_norm: float) -> list[str]:
    """Write the recipe's batch, accumulation and clipping into a DeepSpeed config dict; drop or refuse its
    `optimizer` / `scheduler` blocks. Returns one note per value the config set differently (for the log)."""
    for block, allowed in (("optimizer", {"adam", "adamw"}), ("scheduler", None)):
        if block in cfg:
            spec = cfg[block]
            params = spec.get("params", {})
            kind = str(spec.get("type", "")).lower()
            if any(v != "auto" for v in params.values()) or (allowed is not None and kind not in allowed):
                raise ToolkitError(
                    f"The DeepSpeed config's '{block}' block ({spec.get('type')}, params "
                    f"{json.dumps(params)}) would replace the recipe's: "
                    + ("the optimizer is AdamW set by optimizer.* in the recipe" if block == "optimizer" else
                       "learning-rate schedules are per stage (schedule: / stages[].lr in the recipe)")
                    + f". Remove '{block}' from the DeepSpeed config (or leave only \"auto\" values in it).")
            del cfg[block]
    clip = max_grad_norm if max_grad_norm > 0 else 1e12  # positive: ZeRO-2 then computes the norm veto_update uses
    owned = {"train_micro_batch_size_per_gpu": (micro_batch_size, "train.micro_batch_size"),
             "gradient_accumulation_steps": (grad_accum, "train.grad_accum"),
             "train_batch_size": (micro_batch_size * grad_accum * num_processes, "micro x accum x processes"),
             "gradient_clipping": (clip, "optimizer.max_grad_norm")}
    overridden = []
    for key, (value, source) in owned.items():
        if cfg.get(key, "auto") not in ("auto", None) and float(cfg[key]) != float(value):
            overridden.append(f"{key} {cfg[key]} -> {value} ({source})")
        cfg[key] = value
    return overridden


def build_optimizer(accelerator: Accelerator, params: list[torch.nn.Parameter] | list[dict[str, Any]], *, lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """AdamW, in the form the strategy needs (`params`: tensors, or param-group dicts).

    ZeRO with optimizer offload to CPU wants DeepSpeed's CPU Adam (same AdamW maths, vectorised on the host).
    """
    cfg = ds_config(accelerator)
    offload = (cfg or {}).get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload not in ("none", None):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, adamw_mode=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


def scaler_skipped(optimizer: Any) -> bool:
    """True when fp16 loss scaling skipped this step's update (gradient overflow; the scale is lowered).

    accelerate's GradScaler wrapper and DeepSpeed's fp16 optimizer both report it as `step_was_skipped`; such a
    step is not an update (Adam's step count stays) and not a stability skip (the loss was fine).
    """
    return bool(getattr(optimizer, "step_was_skipped", False))


def _base_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that finally updates tensors (under accelerate's wrapper and DeepSpeed's ZeRO one)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


class StageFreezer:
    """Keeps the parameters a stage freezes bit-identical, with their Adam state untouched, under every strategy.

    The optimizer's param groups are the signature groups of `trainable.TrainablePlan` (one per set of stages a
    parameter trains in), all handed over once before `prepare`; `set_stage` marks the groups frozen in a stage.
    A frozen group's update is withheld in two steps:
      * its gradients must not reach clipping: DDP / FSDP2 / single drop them after backward (`drop_frozen_grads`,
        before `clip_grad_norm_`); DeepSpeed clips inside its step, so tensor hooks zero them during backward;
      * hooks around the innermost torch optimizer's step hide the group's grads (None) for the step and put
        them back after, so AdamW (or DeepSpeed's CPU Adam) skips it: no update, no weight decay, no change to
        its moments or step count, and DeepSpeed's own gradient buffers are left as they were. DeepSpeed steps
        that optimizer once per (flat, partitioned) group, so the same hooks work on its fp32 partitions.
    Parameters frozen in a stage still get (zeroed) weight gradients computed: the cost of keeping the set of
    trainable parameters, and so every strategy's wrapping, the same for the whole run.
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, optimizer: Any,
                 groups: list[tuple[tuple[bool, ...], list[str]]]) -> None:
        """`groups`: (signature, parameter names) in optimizer param-group order; call after `prepare`."""
        self.signatures = [sig for sig, _ in groups]
        self.names = [names for _, names in groups]
        self.updates = [0] * len(groups)  # optimizer updates applied to each group (its Adam step count)
        self.groups = _inner_optimizer(optimizer).param_groups
        if len(self.groups) != len(groups):
            raise ValueError(f"{len(self.groups)} optimizer param groups for {len(groups)} signature groups")
        self.deepspeed = _uses_deepspeed(accelerator)
        if all(all(sig) for sig in self.signatures):
            return  # nothing is ever frozen: no hooks at all
        base = _base_optimizer(optimizer)
        self._hidden: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        base.register_step_pre_hook(self._hide_frozen_grads)
        base.register_step_post_hook(self._restore_grads)
        if not self.deepspeed:
            return
        # ZeRO-2 creates Adam state lazily and links it to the parameters after its first step: a group frozen
        # at that step would stay linked to an empty state. Create the state now, exactly as AdamW would.
        if isinstance(base, torch.optim.AdamW):
            for group in base.param_groups:
                for p in group["params"]:
                    if not base.state[p]:
                        base.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                             exp_avg_sq=torch.zeros_like(p))
        group_of = {name: g for g, (_, names) in enumerate(groups) for name in names}
        for name, param in accelerator.unwrap_model(model).named_parameters():
            if name in group_of:
                g = group_of[name]
                param.register_hook(lambda grad, g=g: torch.zeros_like(grad) if self.groups[g].get("frozen") else grad)

    def set_stage(self, stage: int) -> None:
        for group, sig in zip(self.groups, self.signatures, strict=True):
            group["frozen"] = not sig[stage]

    def _hide_frozen_grads(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._hidden = [(p, p.grad) for group in optimizer.param_groups if group.get("frozen") for p in group["params"]]
        for p, _ in self._hidden:
            p.grad = None

    def _restore_grads(self, *_: Any) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden = []

    def drop_frozen_grads(self) -> None:
        """Before clipping (non-DeepSpeed strategies): frozen groups' gradients leave the norm and the update."""
        if not self.deepspeed:
            for group in self.groups:
                if group.get("frozen"):
                    for p in group["params"]:
                        p.grad = None

    def count_update(self, stage: int) -> None:
        """Record one applied optimizer step in `stage` (Adam's step count of each group trained in it)."""
        for g, sig in enumerate(self.signatures):
            self.updates[g] += sig[stage]

    def adam_steps(self) -> dict[str, int]:
        """Each trainable parameter's Adam step count, by name (for strategy-independent checkpoints)."""
        return {name: self.updates[g] for g, names in enumerate(self.names) for name in names}


def veto_update(loss: torch.Tensor) -> torch.Tensor:
    """The loss to backpropagate when every rank agreed to skip this step's update.

    Under DeepSpeed, accelerate's backward() also runs engine.step(), so the update cannot be withheld by not
    calling optimizer.step(); a NaN loss makes the gradient norm non-finite and DeepSpeed's own overflow check
    then discards the step and zeroes the gradients (ZeRO-1/2/3, fp32 and bf16). Other strategies simply do not
    call optimizer.step() and zero the (NaN) gradients, so the same call works everywhere.
    """
    return loss * float("nan")


def skip_update(scaler: torch.amp.GradScaler | None) -> None:
    """A step the stability guard vetoed, under fp16 with accelerate's GradScaler (DDP, FSDP2): close it.

    Clipping has already unscaled this step's (NaN) gradients; without the scaler's own step and update the
    next step's unscaling fails ("unscale_() has already been called"). `update()` ends the step as a skipped
    overflow would (the scale backs off). DeepSpeed's fp16 scaler handles the vetoed step inside its step.
    """
    if scaler is not None and scaler.is_enabled():
        scaler.update()


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


# --- Full (unsharded) views of a parameter and its Adam state, for strategy-independent checkpoints. ---

def _uses_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def _inner_optimizer(optimizer: Any) -> Any:
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer


def _to_full_cpu(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to("cpu", torch.float32).clone()


def full_param_state(accelerator: Accelerator, optimizer: Any, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """`param`, `exp_avg`, `exp_avg_sq` of one parameter as full fp32 CPU tensors. Collective: all ranks call it.

    ZeRO: DeepSpeed's safe_get_full_* gather the partitions (fp32 master weights, not the 16-bit copy);
    FSDP2: DTensor.full_tensor(); DDP / single: the tensors themselves.
    """
    if _uses_deepspeed(accelerator):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        raw = {"param": safe_get_full_fp32_param(param)}
        # ZeRO-3 creates Adam state lazily: none yet for a group frozen since the start. The lookup fails on every
        # rank alike, before the gather, so skipping it is safe (and matches torch's lazy state).
        with contextlib.suppress(KeyError):
            raw.update({k: safe_get_full_optimizer_state(param, k) for k in ("exp_avg", "exp_avg_sq")})
    else:
        state = _inner_optimizer(optimizer).state.get(param, {})
        raw = {"param": param, **{k: state[k] for k in ("exp_avg", "exp_avg_sq") if k in state}}
    return {k: _to_full_cpu(v) for k, v in raw.items() if v is not None}


def set_full_param_state(accelerator: Accelerator, optimizer: Any, param: torch.nn.Parameter,
                         values: dict[str, torch.Tensor], adam_step: int) -> None:
    """Inverse of `full_param_state`: scatter full tensors into this rank's parameter and Adam state."""
    if _uses_deepspeed(accelerator):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        safe_set_full_fp32_param(param, values["param"])
        for key in ("exp_avg", "exp_avg_sq"):
            if key in values:
                safe_set_full_optimizer_state(param, values[key], key)
        return
    with torch.no_grad():
        _copy_full_into(param, values["param"])
        if "exp_avg" in values:
            state = _inner_optimizer(optimizer).state[param]
            state["step"] = torch.tensor(float(adam_step))
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(param)
                _copy_full_into(state[key], values[key])


def _copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a plain tensor, or into this rank's shard of a DTensor (FSDP2)."""
    if hasattr(target, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        shard = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full.to(target.dtype))


def checkpoint_safe_globals() -> list[Any]:
    """Non-tensor types that checkpoints of our strategies legitimately pickle: numpy RNG states (accelerate)
    and DeepSpeed's ZeRO stage enum. Anything else in a checkpoint is refused."""
    import numpy as np

    allowed: list[Any] = [np.ndarray, np.dtype, np._core.multiarray._reconstruct,
                          type(np.dtype(np.uint32)), type(np.dtype(np.float64)), type(np.dtype(np.int64))]
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:
        pass
    return allowed


def consolidate_full_weights(ckpt: Any, strategy: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a full fine-tuning checkpoint, whatever strategy wrote it (offline, one process).

    Call `checkpoint.verify_checkpoint_files` first: DeepSpeed's and DCP's readers unpickle without restriction.
    """
    from pathlib import Path

    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    if strategy.startswith("zero"):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # accelerate's save_state writes DeepSpeed's 'latest' next to the 'pytorch_model' tag directory
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
    if strategy.startswith("fsdp"):
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(ckpt / "pytorch_model_fsdp_0", Path(tmp) / "model.pt")
            return torch.load(Path(tmp) / "model.pt", map_location="cpu", weights_only=True)
    return load_file(ckpt / "model.safetensors")


def record_launch_error(message: str) -> None:
    """Hand a one-line `error: ...` (already printed) to torchrun as this rank's failure record.

    The launcher then ends its 'Root Cause' summary (printed after its own traceback) with this line instead of
    'To enable traceback see ...', so the reason stays in view under the launcher's output. No-op unlaunched.
    """
    import time

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError), open(error_file, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


def exit_without_teardown(code: int) -> None:
    """End the process after a finished run, skipping interpreter teardown.

    With DeepSpeed ZeRO-3 on gloo, a process that has finished, written everything and destroyed its process
    group still aborts now and then in C++ static destruction ('terminate called without an active exception',
    SIGABRT), which turns a good run into a failed launch. Everything is flushed first, so nothing is lost.
    """
    import logging
    import sys

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
