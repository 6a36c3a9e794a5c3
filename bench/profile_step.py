"""train_curriculum.py with a window of optimizer steps under torch.profiler: where one step's time goes.

    accelerate launch ... bench/profile_step.py --config recipe.yaml     # PROFILE_STEP, PROFILE_OUT, PROFILE_VOCAB
    PROFILE_OVERLAP=0 accelerate launch ... bench/profile_step.py ...      # the micro-batch copies in turn

The run is the product's own (same recipe, same launch); only `run_step` is wrapped. Steps PROFILE_STEP and
PROFILE_STEP + 1 (1-based, optimizer steps) are recorded, so the window holds the code between two steps too
(metrics, the next batch). PROFILE_OUT receives a JSON summary: the window's wall time, the device's busy time
(the union of its kernels), its idle share (1 - busy / wall: the time the GPU waited for the host) and longest idle
gap, the top operators by the device time of the kernels they launched, the attention kernels, and the share of the
loss head (every operator with an input of the vocabulary's width, PROFILE_VOCAB: its matmuls forward and backward,
softmax, cross-entropy), each share over the busy time.

PROFILE_OVERLAP (default 1) switches the loop's micro-batch copies (toolkit/train/loop.py `OVERLAP_COPIES`): 1, the
next micro-batch copied on a side stream while the current one computes, non-blocking; 0, each copied just before its
forward, blocking (what the loop did before). The idle share of the two, on one machine, is what the overlap saves.
It holds for the whole process, the steps outside the window too. Without PROFILE_STEP nothing is profiled: the
run alone, its copies as PROFILE_OVERLAP says (bench/gpu_qwen3_8b.py's `no_overlap` row).
bench/gpu_qwen3_8b.py --profile runs it and excludes the two steps from its timings (--no-overlap: PROFILE_OVERLAP=0).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import train_curriculum  # noqa: E402
from toolkit.train import loop  # noqa: E402

ATTENTION_WORDS = ("flash", "fmha", "attention", "varlen", "sdpa", "cudnn_attn")


def _device_kernels(events: Any) -> list[Any]:
    return [e for e in events if e.device_type in (DeviceType.CUDA, getattr(DeviceType, "PrivateUse1", None))]


def _self_device_us(entry: Any) -> float:
    value = getattr(entry, "self_device_time_total", None)
    return float(value if value is not None else getattr(entry, "self_cuda_time_total", 0.0))


def _self_cpu_us(entry: Any) -> float:
    return float(entry.self_cpu_time_total)


def summarise(prof: torch.profiler.profile, wall_s: float, vocab: int, top: int = 15) -> dict[str, Any]:
    """The JSON summary of a profiled window (see the module docstring). Without a GPU the operators' own CPU
    time stands in for device time (the pipeline check of --tiny), and there are no kernels to find gaps in."""
    kernels = _device_kernels(prof.events())
    self_us = _self_device_us if kernels else _self_cpu_us
    spans = sorted((k.time_range.start, k.time_range.end) for k in kernels)
    busy_us, gaps, end = 0.0, [], None
    for start, stop in spans:  # union of kernel intervals, and the gaps between them
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy_us += stop - start
            end = stop
        elif stop > end:
            busy_us += stop - end
            end = stop
    # On a GPU, key_averages() lists both the operators (aten::mm) and the kernels they launched, each with that
    # device time: shares are taken over the busy time (the kernels' union) and the top list holds operators only.
    # On the CPU the operators' own time is all there is.
    averages = prof.key_averages()
    ops = [e for e in averages if self_us(e) > 0 and (not kernels or e.device_type == DeviceType.CPU)]
    total_us = busy_us if kernels else sum(self_us(e) for e in ops) or 1.0
    by_shape = prof.key_averages(group_by_input_shape=True)
    head_us = sum(self_us(e) for e in by_shape
                  if any(vocab in shape for shape in (e.input_shapes or []) if isinstance(shape, list | tuple)))
    attention = sorted(((e.key, self_us(e)) for e in averages if self_us(e) > 0
                        and (not kernels or e.device_type != DeviceType.CPU)
                        and any(word in e.key.lower() for word in ATTENTION_WORDS)), key=lambda x: -x[1])
    return {
        "window_steps": 2, "wall_s": wall_s,
        "time_basis": "device" if kernels else "cpu (no GPU kernels)",
        "device_busy_s": busy_us / 1e6, "device_busy_share": busy_us / 1e6 / wall_s if kernels else None,
        "device_idle_share": 1 - busy_us / 1e6 / wall_s if kernels else None,
        "copy_overlap": loop.OVERLAP_COPIES,
        "longest_idle_gap_ms": max(gaps, default=0.0) / 1e3, "idle_gaps_over_1ms": sum(g > 1e3 for g in gaps),
        "top_ops": [{"name": e.key, "device_ms": self_us(e) / 1e3, "share": self_us(e) / total_us,
                     "calls": e.count} for e in sorted(ops, key=lambda e: -self_us(e))[:top]],
        "attention_kernels": [{"name": name, "device_ms": us / 1e3, "share": us / total_us} for name, us in attention],
        "loss_head_share": head_us / total_us, "vocab": vocab,
    }


def main(argv: list[str] | None = None) -> int:
    loop.OVERLAP_COPIES = os.environ.get("PROFILE_OVERLAP", "1") != "0"
    if "PROFILE_STEP" not in os.environ:  # no window: the run alone, its copies as PROFILE_OVERLAP says
        return train_curriculum.main(argv)
    first = int(os.environ["PROFILE_STEP"])
    out = Path(os.environ["PROFILE_OUT"])
    vocab = int(os.environ["PROFILE_VOCAB"])
    run_step = train_curriculum.run_step
    state: dict[str, Any] = {"calls": 0}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def profiled_step(*args: Any, **kwargs: Any) -> Any:
        state["calls"] += 1
        if state["calls"] == first:
            sync()
            state["prof"] = torch.profiler.profile(activities=activities, record_shapes=True)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        result = run_step(*args, **kwargs)
        if state["calls"] == first + 1:
            sync()
            wall = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
            if int(os.environ.get("RANK", "0")) == 0:
                out.write_text(json.dumps(summarise(state["prof"], wall, vocab), indent=2))
        return result

    train_curriculum.run_step = profiled_step
    return train_curriculum.main(argv)


if __name__ == "__main__":
    sys.exit(main())
