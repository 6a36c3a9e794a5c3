"""Strategy specifics: everything in the toolkit that knows DeepSpeed or FSDP lives in this package.

The strategy (DDP, FSDP2, ZeRO-2/3, ZeRO-3 offload) is chosen by the accelerate config file alone. This module
names it, from a live `Accelerator` or from the accelerate config file (one table, `name_strategy`), and unwraps
optimizers (`optimizer_chain`). The rest is split by strategy and job:

* `deepspeed`: the DeepSpeed JSON check, the DeepSpeed config the run trains with, CPU Adam for optimizer
  offload, ZeRO-3 init control, full parameter sizes under ZeRO-3 partitioning;
* `build_locks`: build locks a killed process left on DeepSpeed's JIT-compiled ops (each would hang every later
  DeepSpeed launch on the machine), removed before DeepSpeed starts;
* `fsdp`: the FSDP2 launch check and DTensor shards;
* `param_state`: full (unsharded) views of a parameter and its Adam state, for strategy-independent checkpoints;
* `measure`: the bytes of weights, gradients and optimizer state a rank really holds;
* `consolidate`: full weights of a checkpoint written by any strategy, and the types its pickles may hold.

toolkit/runtime/process.py keeps the process-level glue (accelerator construction, CPU/gloo compatibility, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType

from toolkit.errors import ToolkitError


def uses_deepspeed(accelerator: Accelerator) -> bool:
    """True when the launch trains under DeepSpeed (any ZeRO stage)."""
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def ds_config(accelerator: Accelerator) -> dict[str, Any] | None:
    """The live DeepSpeed config dict, or None when DeepSpeed is not in use."""
    if not uses_deepspeed(accelerator):
        return None
    return accelerator.state.deepspeed_plugin.deepspeed_config


def name_strategy(distributed_type: str, num_processes: int, zero_optimization: Mapping[str, Any] | None = None,
                  fsdp_version: int | str | None = None) -> str:
    """The strategy's short name (logs, metrics, checkpoint metadata, preflight), from accelerate's distributed
    type and, for DeepSpeed, its `zero_optimization` block: single, ddp, zero<stage>[_offload], fsdp<version>."""
    if distributed_type == DistributedType.DEEPSPEED:
        zero = zero_optimization or {}
        offload = any((zero.get(k) or {}).get("device", "none") not in ("none", None)
                      for k in ("offload_optimizer", "offload_param"))
        return f"zero{int(zero.get('stage', 0))}" + ("_offload" if offload else "")
    if distributed_type == DistributedType.FSDP:
        return f"fsdp{fsdp_version or 1}"
    return "ddp" if num_processes > 1 else "single"


def strategy_name(accelerator: Accelerator) -> str:
    """The live run's strategy name (see `name_strategy`), with `_sp<N>` under Ulysses sequence parallelism."""
    cfg = ds_config(accelerator)
    fsdp = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    name = name_strategy(accelerator.distributed_type.value, accelerator.num_processes,
                         (cfg or {}).get("zero_optimization"), fsdp.fsdp_version if fsdp else None)
    config = getattr(accelerator, "parallelism_config", None)
    sp = int(getattr(config, "sp_size", 1) or 1) if config is not None else 1
    return f"{name}_sp{sp}" if sp > 1 else name


def _read_config(accelerate_config: Path) -> dict[str, Any]:
    """The accelerate config file's keys, or one line saying why there are none."""
    if not accelerate_config.is_file():
        raise ToolkitError(f"Accelerate config {accelerate_config} does not exist.")
    try:
        cfg = yaml.safe_load(accelerate_config.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ToolkitError(f"Accelerate config {accelerate_config} is not valid YAML: {' '.join(str(e).split())}"
                           ) from None
    if not isinstance(cfg, dict):
        raise ToolkitError(f"Accelerate config {accelerate_config} must hold a mapping of keys (as written by "
                           "`accelerate config`).")
    return cfg


def deepspeed_of_config(accelerate_config: Path) -> tuple[bool, str | None]:
    """(whether the accelerate config file launches DeepSpeed, the DeepSpeed JSON it names as written or None).
    accelerate reads that JSON's path from the launch's working directory, not from the config's folder."""
    cfg = _read_config(accelerate_config)
    if str(cfg.get("distributed_type", "NO")) != DistributedType.DEEPSPEED:
        return False, None
    named = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
    return True, str(named) if named else None


def strategy_of_config(accelerate_config: Path) -> tuple[str, int]:
    """(strategy name, num_processes) an accelerate config file selects, named as a run launched with it is
    (`_sp<N>` with Ulysses sequence parallelism). Its DeepSpeed JSON is read from the working directory, as
    accelerate reads it, or else beside the config's folder (a shipped config, as `toolkit train` launches it)."""
    cfg = _read_config(accelerate_config)
    kind, procs = str(cfg.get("distributed_type", "NO")), int(cfg.get("num_processes", 1))
    ds = cfg.get("deepspeed_config") or {}
    zero: dict[str, Any] = {"stage": ds.get("zero_stage", 0),  # the inline keys, as the JSON spells them
                            "offload_optimizer": {"device": ds.get("offload_optimizer_device", "none")},
                            "offload_param": {"device": ds.get("offload_param_device", "none")}}
    if kind == DistributedType.DEEPSPEED and ds.get("deepspeed_config_file"):
        path = Path(ds["deepspeed_config_file"])
        beside = accelerate_config.resolve().parent.parent / path  # a shipped config's, read from another folder
        if not path.is_file() and not path.is_absolute() and beside.is_file():
            path = beside
        if not path.is_file():
            raise ToolkitError(f"{accelerate_config} names DeepSpeed config {path}, which does not exist.")
        zero = json.loads(path.read_text()).get("zero_optimization", {})
    fsdp_version = (cfg.get("fsdp_config") or {}).get("fsdp_version")
    name = name_strategy(kind, procs, zero, fsdp_version)
    sp = int((cfg.get("parallelism_config") or {}).get("parallelism_config_sp_size", 1) or 1)
    return (f"{name}_sp{sp}" if sp > 1 else name), procs


def optimizer_chain(optimizer: Any) -> list[Any]:
    """The optimizer and every optimizer it wraps, outermost first: accelerate's AcceleratedOptimizer, then
    DeepSpeed's ZeRO optimizer if any, then the torch optimizer that finally updates tensors (the last)."""
    chain = [optimizer]
    while (inner := getattr(chain[-1], "optimizer", None)) is not None and all(inner is not o for o in chain):
        chain.append(inner)
    return chain
