"""`train_curriculum.py` with a spy on the collectives each rank issues while generation evals run, and on when its
process group is destroyed.

Launched in place of train_curriculum.py (`accelerate launch tests/helpers/spy_generation.py --config ...`, with
SPY_GENERATION_DIR set): it counts the parameter all-gathers issued inside `toolkit.evals.generation.generate` (the
token-by-token forwards) and around it (the gather of the full weights, once per eval), and writes one JSON per
rank. Weights gathered once per eval means no all-gather at all inside `generate`: under ZeRO-3 and FSDP2 a
forward through sharded weights would all-gather every layer's parameters at every new token.

It also counts `destroy_process_group` calls made while a DistributedDataParallel model is alive: its Reducer holds
the group, so the group's destructor would run when the model is freed, with the GIL held, and can deadlock
(toolkit.runtime.process.finish_trackers).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

import train_curriculum
from toolkit.evals import evaluator as evals
from toolkit.runtime import process as distributed

GATHERS = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather", "all_gather_coalesced",
           "broadcast")
counts = {"generate_calls": 0, "gathers_inside_generate": 0, "all_reduces_inside_generate": 0, "gathers_in_evals": 0,
          "evals": 0, "destroyed_with_ddp_alive": 0}
state = {"generating": False, "evaluating": False}


def _counting(name: str, fn: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if state["generating"]:
            counts["all_reduces_inside_generate" if name == "all_reduce" else "gathers_inside_generate"] += 1
        if state["evaluating"] and name != "all_reduce":
            counts["gathers_in_evals"] += 1
        return fn(*args, **kwargs)
    return wrapped


for _name in (*GATHERS, "all_reduce"):
    if hasattr(dist, _name):
        setattr(dist, _name, _counting(_name, getattr(dist, _name)))

_generate = evals.generate


def _spied_generate(*args: Any, **kwargs: Any) -> Any:
    counts["generate_calls"] += 1
    state["generating"] = True
    try:
        return _generate(*args, **kwargs)
    finally:
        state["generating"] = False


evals.generate = _spied_generate
_evaluate_generation = evals.Evaluator._generate


def _spied_generation(self: Any, *args: Any, **kwargs: Any) -> Any:
    counts["evals"] += 1
    state["evaluating"] = True
    try:
        return _evaluate_generation(self, *args, **kwargs)
    finally:
        state["evaluating"] = False


evals.Evaluator._generate = _spied_generation
_destroy = dist.destroy_process_group


def _spied_destroy(*args: Any, **kwargs: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(o, DistributedDataParallel) for o in gc.get_objects()):
        counts["destroyed_with_ddp_alive"] += 1
    return _destroy(*args, **kwargs)


dist.destroy_process_group = _spied_destroy

if __name__ == "__main__":
    code = train_curriculum.main(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ["SPY_GENERATION_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(counts))
    distributed.exit_without_teardown(code)
