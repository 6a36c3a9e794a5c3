"""Full weights for generation under every strategy, gathered once per eval and released after it.

Generating token by token through a sharded model would gather every layer's weights for every new token: under
ZeRO-3 that is one all-gather per module per token, about 10x slower than gathering once (what TRL measured and
why it gathers in `unwrap_model_for_generation`). So for the whole of an eval's generation:

* ZeRO-3 (offload included): DeepSpeed's own `unwrap_model_for_generation` gathers every parameter once
  (`GatheredParameters`) and removes the engine's module hooks, so the forwards run on plain local weights; on
  leaving, the hooks are registered again and the parameters re-partitioned.
* FSDP2: every FSDP module is unsharded once (`FSDPModule.unshard`, in module order, the same on every rank) and
  kept unsharded across forwards (no reshard after forward); on leaving, each is resharded and its
  reshard-after-forward setting restored.
* DDP, ZeRO-1/2, one process: the weights are already whole on every rank.

Memory: the full model (in its training dtype) is held on every rank for the duration of the eval.

Inside the block the weights are plain whole tensors on every strategy, so `trainable_values` copies the trainable
ones whole and `swapped_in` puts other values in their place for a few forwards (an RL stage's KL reference:
toolkit/train/rl_reference.py). FSDP2 on one process keeps DTensors: their local shard is the whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from toolkit.errors import ToolkitError
from toolkit.strategies import ds_config


def shards_parameters(accelerator: Accelerator) -> bool:
    """Whether a forward pass gathers parameters from other ranks (ZeRO-3 or FSDP with more than one process)."""
    if accelerator.num_processes < 2:
        return False
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    return int(((ds_config(accelerator) or {}).get("zero_optimization") or {}).get("stage", 0)) == 3


@contextmanager
def full_weights_for_generation(accelerator: Accelerator, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model to call `generate` on (the unwrapped one: a PEFT model with its adapter active), with its full
    weights on this rank for the whole block. Collective under ZeRO-3 and FSDP: every rank enters and leaves."""
    if not shards_parameters(accelerator):
        yield accelerator.unwrap_model(model)
    elif accelerator.distributed_type == DistributedType.FSDP:
        with _fsdp_unsharded(model):
            yield accelerator.unwrap_model(model)
    else:
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(model):
            yield accelerator.unwrap_model(model)


@contextmanager
def _fsdp_unsharded(model: torch.nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # Each param group's `post_forward_mesh_info` is its reshard-after-forward setting (None: keep unsharded);
    # `set_reshard_after_forward` can switch it off but not give back the root's special value, so it is saved.
    groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
    saved: list[Any] = [g.post_forward_mesh_info for g in groups]
    for group in groups:
        group.post_forward_mesh_info = None
    try:
        for module in modules:
            module.unshard()
        yield
    finally:
        for module in modules:
            module.reshard()
        for group, info in zip(groups, saved, strict=True):
            group.post_forward_mesh_info = info


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor a parameter's values live in on this rank: a DTensor's local shard (FSDP2 on one process, where
    it is the whole tensor), else the parameter's data."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param.data


def trainable_values(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Host copies of the trainable parameters of `policy` (whole: call inside `full_weights_for_generation`)."""
    return {name: _local(p).detach().to("cpu", copy=True).contiguous()
            for name, p in policy.named_parameters() if p.requires_grad}


@contextmanager
def swapped_in(policy: torch.nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """`policy` with `values` (by parameter name) in place of its own, restored on leaving (whole weights)."""
    params = dict(policy.named_parameters())
    saved: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, value in values.items():
                local = _local(params[name]) if name in params else None
                if local is None or local.shape != value.shape:
                    raise ToolkitError(f"the KL reference's parameter '{name}' does not match the policy's (shape "
                                       f"{None if local is None else tuple(local.shape)} for {tuple(value.shape)}); "
                                       "the reference copy was taken of another model or adapter.")
                saved[name] = local.clone()
                local.copy_(value.to(local.device, local.dtype))
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                _local(params[name]).copy_(value)
