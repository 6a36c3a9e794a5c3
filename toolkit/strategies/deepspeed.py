"""DeepSpeed specifics: the config the run trains with, CPU Adam for optimizer offload, ZeRO-3 init control and
full parameter sizes under ZeRO-3 partitioning."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.errors import ToolkitError
from toolkit.strategies import ds_config, sequence_parallel

log = logging.getLogger(__name__)


# Keys a DeepSpeed JSON reads itself: accelerate refuses them in the accelerate config next to the JSON's name.
_DS_FILE_OWNS = {"gradient_accumulation_steps": "gradient_accumulation_steps",
                 "gradient_clipping": "gradient_clipping", "zero_stage": "zero_optimization.stage",
                 "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
                 "offload_param_device": "zero_optimization.offload_param.device",
                 "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
                 "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
                 "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save"}


def launched_with_deepspeed() -> bool:
    """`accelerate launch` chose DeepSpeed (read before the Accelerator exists)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def check_deepspeed_file(precision: str) -> None:
    """The DeepSpeed JSON named by the accelerate config exists and decides what accelerate lets it decide.

    accelerate refuses `mixed_precision` in an accelerate config that names a JSON, even when the JSON leaves
    precision "auto" for accelerate to fill from it (as ours do). Precision then is the launch's, and the refusal
    is lifted; a JSON with an explicit `bf16` / `fp16` `enabled` must agree with it. No-op without DeepSpeed.
    """
    if not launched_with_deepspeed():
        return
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

    `train_micro_batch_size_per_gpu` never sizes our batches (we feed them ourselves): it only sizes DeepSpeed's
    own deepspeed_io loader (unused), its samples/throughput counters and its check that train_batch_size = micro x
    accum x processes. No one value fits every stage; the caller passes the first stage's, the batch the engine
    sees first, and the recipe's own value (train.micro_batch_size alone may be overridden by every stage).
    """
    cfg = ds_config(accelerator)
    if cfg is None:
        return
    hidden_size = model.config.get_text_config().hidden_size
    _one_trainable_dtype(cfg, model)
    # Under Ulysses the processes of a sequence-parallel group train the same rows: DeepSpeed counts replicas.
    replicas = sequence_parallel.layout(accelerator).dp_size
    overridden = own_deepspeed_config(cfg, micro_batch_size=micro_batch_size,
                                      grad_accum=accelerator.gradient_accumulation_steps,
                                      num_processes=replicas, max_grad_norm=max_grad_norm)
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


def offload_adam(accelerator: Accelerator, params: list[torch.nn.Parameter] | list[dict[str, Any]], *, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer | None:
    """DeepSpeed's CPU Adam (same AdamW maths, vectorised on the host) when ZeRO offloads the optimizer to the
    CPU, which wants it; None otherwise."""
    cfg = ds_config(accelerator)
    offload = (cfg or {}).get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload in ("none", None):
        return None
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    # With "zero_force_ds_cpu_optimizer" on (its default) accelerate's prepare rebuilds any optimizer it is given
    # as a new DeepSpeedCPUAdam from its param groups, with adamw_mode=True only for a torch.optim.AdamW: ours
    # would become Adam with L2 decay (a weight_decay > 0 then trained other weights than every other strategy's
    # AdamW) and lose its step hook. Off, DeepSpeed takes this one as it is (it is the CPU optimizer it wants).
    cfg["zero_force_ds_cpu_optimizer"] = False
    adam = DeepSpeedCPUAdam(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, adamw_mode=True)
    adam.register_step_pre_hook(_history_free_bias_correction)
    return adam


def _history_free_bias_correction(adam: Any, *_: Any) -> None:
    """Before each CPU Adam step: a fresh C++ optimizer, so Adam's bias correction is `beta ** step` every time.

    CPU Adam's C++ side keeps `beta ** t` between steps as a running product (multiplied once per step, recomputed
    with pow after any other jump in the step count). That product is not in the optimizer's state_dict: a resumed
    run recomputes it with pow, and its updates then differ from the uninterrupted run's in the last bits (found by
    tests/e2e/test_resume.py's every-checkpoint test). A fresh C++ optimizer (at its step 0) computes the correction
    from the step count each parameter's state carries, whatever ran before. `create_adam` replaces the one under
    the same id; DeepSpeedCPUAdam.step passes each group's lr, betas, eps and decay with every update."""
    group = adam.param_groups[0]
    adam.ds_opt_adam.create_adam(adam.opt_id, group["lr"], group["betas"][0], group["betas"][1], group["eps"],
                                 group["weight_decay"], adam.adam_w_mode, False)


def full_numel(param: torch.Tensor) -> int:
    """A parameter's full number of elements, also under ZeRO-3, where the local tensor is an empty shard."""
    return int(getattr(param, "ds_numel", param.numel()))


def full_shape(param: torch.Tensor) -> list[int]:
    """A parameter's full shape, also under ZeRO-3, where the local tensor is an empty shard."""
    return list(getattr(param, "ds_shape", param.shape))


@contextmanager
def without_zero3_init() -> Iterator[None]:
    """Build a plain local model even inside a ZeRO-3 run: Qwen2.5-VL creates its sub-models with `_from_config`,
    which would otherwise partition them with `deepspeed.zero.Init`, a collective that only the building rank joins
    (a hang when rank 0 alone writes the model)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def zero3_partitions(model: torch.nn.Module) -> bool:
    """Whether the model trains under ZeRO-3: a run that built it under zero.Init (its weights are partitioned) or
    set up with a ZeRO-3 config (DeepSpeed then gathers each module's parameters in that module's forward hook)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() or any(hasattr(p, "ds_id") for p in model.parameters())
