"""Full (unsharded) views of a parameter and its Adam state, for strategy-independent checkpoints."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.strategies import optimizer_chain, uses_deepspeed
from toolkit.strategies.fsdp import copy_full_into, full_cpu_fp32


def full_param_state(accelerator: Accelerator, optimizer: Any, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """`param`, `exp_avg`, `exp_avg_sq` of one parameter as full fp32 CPU tensors. Collective: all ranks call it.

    ZeRO: DeepSpeed's safe_get_full_* gather the partitions (fp32 master weights, not the 16-bit copy);
    FSDP2: DTensor.full_tensor(); DDP / single: the tensors themselves.
    """
    if uses_deepspeed(accelerator):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        raw = {"param": safe_get_full_fp32_param(param)}
        # ZeRO-3 creates Adam state lazily: none yet for a group frozen since the start. The lookup fails on every
        # rank alike, before the gather, so skipping it is safe (and matches torch's lazy state).
        with contextlib.suppress(KeyError):
            raw.update({k: safe_get_full_optimizer_state(param, k) for k in ("exp_avg", "exp_avg_sq")})
    else:
        state = optimizer_chain(optimizer)[-1].state.get(param, {})
        raw = {"param": param, **{k: state[k] for k in ("exp_avg", "exp_avg_sq") if k in state}}
    return {k: full_cpu_fp32(v) for k, v in raw.items() if v is not None}


def set_full_param_state(accelerator: Accelerator, optimizer: Any, param: torch.nn.Parameter,
                         values: dict[str, torch.Tensor], adam_step: int) -> None:
    """Inverse of `full_param_state`: scatter full tensors into this rank's parameter and Adam state."""
    if uses_deepspeed(accelerator):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        safe_set_full_fp32_param(param, values["param"])
        for key in ("exp_avg", "exp_avg_sq"):
            if key in values:
                safe_set_full_optimizer_state(param, values[key], key)
        return
    with torch.no_grad():
        copy_full_into(param, values["param"])
        if "exp_avg" in values:
            state = optimizer_chain(optimizer)[-1].state[param]
            state["step"] = torch.tensor(float(adam_step))
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(param)
                copy_full_into(state[key], values[key])
