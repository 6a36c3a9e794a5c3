"""FSDP specifics: the launch must select FSDP2, whose parameters are DTensors sharded along dim 0."""

from __future__ import annotations

import os

import torch

from toolkit.errors import ToolkitError


def check_fsdp_version() -> None:
    """Refuse an FSDP1 launch (read from what `accelerate launch` put in the environment)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ToolkitError(
            "The accelerate config selects FSDP1 (fsdp_config.fsdp_version is 1 or missing); this toolkit shards with "
            "FSDP2: set fsdp_config.fsdp_version: 2 (`accelerate to-fsdp2 --config_file <file> --output_file <new>` "
            "converts the other keys; see accelerate_configs/fsdp.yaml).")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def full_cpu_fp32(t: torch.Tensor) -> torch.Tensor:
    """A detached full fp32 CPU copy of a tensor (a DTensor is gathered first: collective)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to("cpu", torch.float32).clone()


def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a plain tensor, or into this rank's shard of a DTensor (FSDP2)."""
    if hasattr(target, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        shard = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full.to(target.dtype))
