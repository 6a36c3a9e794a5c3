"""Run metrics: one JSON object per logged step in `<output_dir>/metrics.jsonl`, written by rank 0 only."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch

from toolkit.atomic import write_text_atomic, writing
from toolkit.errors import ToolkitError


class MetricsLog:
    """Append-only JSONL writer; a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with writing(self.path), self.path.open("a", encoding="utf-8") as f:  # a cut last line is left out on read
            f.write(to_json_line(record))


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value


def to_json_line(record: dict[str, Any]) -> str:
    """One record as standard JSON: a non-finite number (a skipped step's NaN loss) is written as null, since
    bare NaN / Infinity are not JSON and break other readers (jq, pandas with strict parsers, JavaScript)."""
    return json.dumps(_finite_or_none(record), allow_nan=False) + "\n"


RECORD_KINDS = {"train": "loss", "eval": "eval_loss", "event": "event"}


def read_metrics(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file: all of them, or one kind (train steps, evaluations, stage events).

    An unreadable last line is a record cut short by a crash and is left out; any other unreadable line is an
    error naming it.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if lineno == len(lines):
                break
            raise ToolkitError(f"{path}:{lineno} is not a JSON record; the file was edited or damaged.") from None
    return records if kind is None else [r for r in records if RECORD_KINDS[kind] in r]


def truncate_after(path: Path, step: int) -> None:
    """Drop records after `step` (they are recomputed after a resume), so steps are neither missing nor doubled;
    a record cut short by a crash goes too."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    write_text_atomic(path, "".join(to_json_line(r) for r in kept))


TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
"""logging.trackers' names -> the package each needs. TensorBoard (the default) comes with the toolkit; the others are
its extras of the same name (pyproject.toml)."""


def check_trackers(names: list[str]) -> None:
    """Fail before training when a requested tracker's package is missing (accelerate would only warn), naming the
    `pip install` that brings it."""
    missing = [n for n in names if importlib.util.find_spec(TRACKER_PACKAGES[n]) is None]
    if missing:
        extras = [n for n in missing if n != "tensorboard"]
        fix = " ".join([*(["tensorboard"] if "tensorboard" in missing else []),
                        *([f"'curriculum-toolkit[{','.join(extras)}]'"] if extras else [])])
        raise ToolkitError(f"logging.trackers asks for {', '.join(missing)}, which is not installed: "
                           f"pip install {fix} (or remove it from logging.trackers).")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated by this process, or its peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def sample_lengths(sample: dict[str, list[int]]) -> list[int]:
    """Token lengths of the samples in a row: one for a plain sample, one per packed sample (position restarts)."""
    positions = sample.get("position_ids")
    if positions is None:
        return [len(sample["input_ids"])]
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    return [b - a for a, b in itertools.pairwise(starts)]


class Meter:
    """Counters of one logging interval. Device tensors are only added to in the step (no host sync); `record`
    reduces them over ranks once per interval. Step losses arrive already reduced (the guard's all-reduce)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts = torch.zeros(2, dtype=torch.float64, device=device)  # real tokens, token slots
        self.flops = 0.0  # this rank's useful training FLOPs (host arithmetic on known lengths)
        self.samples = 0  # this rank's samples
        self.losses: list[float] = []
        self.skipped = 0
        self.tokens_total = 0  # global, all intervals
        self.started = time.perf_counter()

    def add_batch(self, batch: dict[str, torch.Tensor], flops: float, samples: int, real: int | None = None) -> None:
        """Count a micro-batch; `real`: its non-padding tokens when the batch has no attention_mask to tell them
        (a Ulysses slice), else read from the mask (or every token of a packed row)."""
        if real is None:
            real = batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()
        self.counts[0] += real
        self.counts[1] += batch["input_ids"].numel()
        self.flops += flops
        self.samples += samples

    def add_step(self, loss: float, skipped: bool) -> None:
        self.losses.append(loss)
        self.skipped += skipped

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of non-training work (an evaluation) out of the interval's time, so tokens/s, samples/s,
        step time and MFU are training's."""
        self.started += seconds

    def reduced(self, accelerator: Any) -> tuple[int, int, float, int]:
        """(real tokens, slots, flops, samples) of the interval, summed over ranks."""
        host = torch.tensor([self.flops, float(self.samples)], dtype=torch.float64, device=self.device)
        total = accelerator.reduce(torch.cat([self.counts, host]), reduction="sum").tolist()
        return int(total[0]), int(total[1]), total[2], int(total[3])

    def record(self, accelerator: Any, *, peak_flops: float | None) -> dict[str, Any]:
        """Interval metrics, then reset. Call on every rank (it reduces)."""
        tokens, slots, flops, samples = self.reduced(accelerator)
        seconds = time.perf_counter() - self.started
        peak = torch.tensor([float(peak_memory_bytes(self.device))], device=self.device)
        if accelerator.num_processes > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        self.tokens_total += tokens
        finite = [x for x in self.losses if math.isfinite(x)]
        out = {
            "loss": sum(finite) / len(finite) if finite else float("nan"),
            "tokens": self.tokens_total, "tokens_per_sec": tokens / seconds, "samples_per_sec": samples / seconds,
            "step_time": seconds / max(len(self.losses), 1),
            "mfu": flops / (seconds * accelerator.num_processes * peak_flops) if peak_flops else None,
            "padding_fraction": 1.0 - tokens / slots if slots else 0.0,
            "peak_memory_gb": peak.item() / 1024**3, "skipped": self.skipped,
        }
        self.counts.zero_()
        self.flops, self.samples, self.losses, self.skipped = 0.0, 0, [], 0
        self.started = time.perf_counter()
        return out
