"""Full (unsharded) views of parameters and their Adam state, for strategy-independent checkpoints.

A portable checkpoint holds, per trainable parameter, its fp32 value, Adam's `exp_avg` / `exp_avg_sq` as full
tensors and its Adam step count. Writing gathers them from any layout (`full_param_state`); reading scatters them
into any other (`set_full_state`). Where the state lives:

* single / DDP / FSDP2: the innermost torch optimizer keeps state per parameter (FSDP2: per DTensor shard);
* DeepSpeed ZeRO-1/2: per flat fp32 partition of each param group, ZeRO-3: per flat fp32 partition of each
  sub-group, each rank holding its own slice. The model's parameters are a separate working copy (16-bit, or a
  second fp32 copy) that DeepSpeed refreshes from the partitions after each step.

Adam creates its state at a parameter's first update. The StageFreezer creates it at the start for every tensor
the torch optimizer's param groups hold (`freezer.create_optimizer_state`); ZeRO-3 keeps its flat partitions out
of those groups between steps, and DeepSpeed links ZeRO-1/2 parameters to the state only at its first step (a
checkpoint load replaces the tensors behind the links). `ensure_adam_state` closes both gaps before any gather or
scatter: the missing state as DeepSpeed's own universal-checkpoint loader creates it (zero moments, step 0:
numerically the same as no state), and links to the current state tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.strategies import optimizer_chain, uses_deepspeed
from toolkit.strategies.fsdp import copy_full_into, full_cpu_fp32

MOMENTS = ("exp_avg", "exp_avg_sq")


# How DeepSpeed's optimizers name their flat fp32 partitions and the parameter lists they hold, by the attributes
# that tell them apart: ZeRO-3 (per sub-group), ZeRO-1/2 (per group), ZeRO-0 in bf16 (BF16_Optimizer).
_PARTITIONS = (("fp32_partitioned_groups_flat", "fp16_groups"), ("single_partition_of_fp32_groups", "bit16_groups"),
               ("fp32_groups_flat_partition", "bf16_groups"))
_ZERO3 = _PARTITIONS[0][0]


def _zero_optimizer(accelerator: Accelerator, optimizer: Any) -> tuple[Any, str, str] | None:
    """DeepSpeed's partitioning optimizer (the one that wraps the torch optimizer) with the names of its partitions
    and parameter lists; None without DeepSpeed, or where DeepSpeed steps the torch optimizer on the parameters
    themselves (ZeRO-0 in fp32)."""
    if not uses_deepspeed(accelerator):
        return None
    inner = optimizer_chain(optimizer)[-2]
    return next(((inner, flat, params) for flat, params in _PARTITIONS if hasattr(inner, flat)), None)


def _holders(accelerator: Accelerator, optimizer: Any) -> list[tuple[torch.Tensor, list[torch.nn.Parameter]]]:
    """The tensors the torch optimizer keeps Adam state for, each with the model parameters it holds values of:
    the parameters themselves, or DeepSpeed's flat fp32 partitions."""
    found = _zero_optimizer(accelerator, optimizer)
    if found is None:
        return [(p, [p]) for group in optimizer_chain(optimizer)[-1].param_groups for p in group["params"]]
    zero, flat, params = found
    return list(zip(getattr(zero, flat), getattr(zero, params), strict=True))


def _fresh_adam_state(base: torch.optim.Optimizer, holder: torch.Tensor) -> dict[str, Any]:
    """The state `base.step()` creates at a tensor's first update: torch's Adam/AdamW or DeepSpeed's CPU Adam."""
    if isinstance(base, torch.optim.Adam):  # AdamW subclasses it; torch.optim.adam._init_group
        d = base.defaults
        on_device = d.get("capturable") or d.get("fused")
        state: dict[str, Any] = {
            "step": torch.zeros((), dtype=torch.float32, device=holder.device) if on_device else torch.tensor(0.0)}
        for key in (*MOMENTS, *(("max_exp_avg_sq",) if d.get("amsgrad") else ())):
            state[key] = torch.zeros_like(holder, memory_format=torch.preserve_format)
        return state
    if type(base).__name__ == "DeepSpeedCPUAdam":  # deepspeed/ops/adam/cpu_adam.py, step()
        dtype = torch.float32 if getattr(base, "fp32_optimizer_states", True) else holder.dtype
        return {"step": 0, **{key: torch.zeros_like(holder, dtype=dtype) for key in MOMENTS}}
    raise TypeError(f"Adam state cannot be created for {type(base).__name__}: the toolkit builds AdamW or CPU Adam")


def ensure_adam_state(accelerator: Accelerator, optimizer: Any) -> None:
    """Give every trainable tensor that has none the Adam state the optimizer's first step would create, and link
    ZeRO-0/1/2 parameters to the current state tensors (DeepSpeed links them at its first step only). The same on
    every rank, no collective; later steps use the state as their own: zero moments at step 0 are Adam's start."""
    base = optimizer_chain(optimizer)[-1]
    for holder, _ in _holders(accelerator, optimizer):
        if not base.state[holder]:
            base.state[holder].update(_fresh_adam_state(base, holder))
    found = _zero_optimizer(accelerator, optimizer)
    if found is not None and found[1] != _ZERO3:
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        zero, flat, params = found
        for partition, lp_params in zip(getattr(zero, flat), getattr(zero, params), strict=True):
            lazy_init_hp_params_optimizer_state(lp_params, partition, base.state)


def full_param_state(accelerator: Accelerator, optimizer: Any, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """`param`, `exp_avg`, `exp_avg_sq` of one parameter as full fp32 CPU tensors. Collective: all ranks call it,
    after `ensure_adam_state` (a parameter never updated then has zero moments, the same in every layout).

    ZeRO: DeepSpeed's safe_get_full_* gather the partitions (fp32 master weights, not the 16-bit copy);
    FSDP2: DTensor.full_tensor(); DDP / single: the tensors themselves.
    """
    if _zero_optimizer(accelerator, optimizer) is not None:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        raw = {"param": safe_get_full_fp32_param(param),
               **{k: safe_get_full_optimizer_state(param, k) for k in MOMENTS}}
    else:
        state = optimizer_chain(optimizer)[-1].state[param]
        raw = {"param": param, **{k: state[k] for k in MOMENTS}}
    return {k: full_cpu_fp32(v) for k, v in raw.items()}


def _with_step(state: dict[str, Any], step: int) -> Any:
    old = state["step"]
    return torch.tensor(float(step), dtype=old.dtype, device=old.device) if isinstance(old, torch.Tensor) else step


def set_full_state(accelerator: Accelerator, optimizer: Any,
                   entries: Sequence[tuple[torch.nn.Parameter, dict[str, torch.Tensor], int]]) -> list[str]:
    """Inverse of `full_param_state` for every trainable parameter at once: (parameter, full fp32 `param` /
    `exp_avg` / `exp_avg_sq`, Adam step count). Each rank keeps its own part. Collective under ZeRO (the working
    copies are gathered from the partitions at the end), so every rank calls it with the same entries. Returns
    what could not be set as the checkpoint has it (for the resume's log line).

    Under DeepSpeed this follows its own checkpoint load: parameters partitioned first, fp32 partitions and Adam
    state set, the parameters' working copies refreshed from the partitions (ZeRO-3: persistent parameters
    gathered again; ZeRO-1/2: `update_lp_params`), so the first forward already sees the loaded weights.
    """
    ensure_adam_state(accelerator, optimizer)
    base, found = optimizer_chain(optimizer)[-1], _zero_optimizer(accelerator, optimizer)
    if found is None:
        with torch.no_grad():
            for param, values, step in entries:
                copy_full_into(param, values["param"])
                state = base.state[param]
                for key in MOMENTS:
                    copy_full_into(state[key], values[key])
                state["step"] = _with_step(state, step)
        return []
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero, zero3 = found[0], found[1] == _ZERO3
    if zero3:
        zero.checkpoint_event_prologue()  # ZeRO-3: every parameter partitioned, as before a checkpoint load
    for param, values, _ in entries:
        safe_set_full_fp32_param(param, values["param"])
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, values[key], key)
    steps, merged = {id(param): step for param, _, step in entries}, 0
    for holder, params in _holders(accelerator, optimizer):
        counts = [steps[id(p)] for p in params if id(p) in steps]
        if counts:  # one step count per flat partition: its parameters train together (one signature group) ...
            merged += len(set(counts)) > 1  # ... unless resume_force changed which stages train what
            base.state[holder]["step"] = _with_step(base.state[holder], max(counts))
    if zero3:
        for sub_group in range(len(zero.fp16_groups)):
            zero._reassign_or_swap_out_partitioned_parameters(sub_group)  # what its step does after an update
        zero.checkpoint_event_epilogue()
    else:
        zero.update_lp_params()
    return [f"Adam step counts of {merged} DeepSpeed partition(s) whose parameters had different ones set to the "
            "largest"] if merged else []
