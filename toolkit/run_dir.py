"""The output directory: its layout (`RunLayout`, the one place that names a run's paths), one live writer at a
time, and an earlier run's outputs never replaced silently.

The lock is an advisory `flock` held by rank 0 for the life of the process: the kernel releases it when the
process ends, however it ends (SIGKILL included), so a crashed or killed run never blocks the next one, while a
live one (a trainer orphaned by its launcher, a second job on the same folder) makes a new run refuse to start.
It lives beside the output dir, in the `.toolkit-cache` that also holds the built-in models, so a run that stops
on bad input has written nothing inside the output dir.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from toolkit.errors import ToolkitError


@dataclass(frozen=True)
class RunLayout:
    """Every path of a run, from its output dir (`root`). The shared cache lives beside it, not in it: built-in
    models, tokenised data and run locks are shared by the runs of one parent folder, and a run that stops on bad
    input has then written nothing inside its output dir."""

    root: Path

    def __init__(self, output_dir: str | Path) -> None:
        object.__setattr__(self, "root", Path(output_dir))

    @classmethod
    def of_checkpoint(cls, ckpt: Path) -> RunLayout:
        """The run that holds the checkpoint folder `ckpt` (`<root>/checkpoints/step-N`)."""
        return cls(ckpt.parent.parent)

    @property
    def checkpoints(self) -> Path:
        """Committed checkpoints, `step-N/` (see toolkit/checkpoint.py)."""
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        """The trained adapter or model with its tokenizer / processor, written at the end."""
        return self.root / "final"

    @property
    def metrics(self) -> Path:
        """One JSON record per logged step, stage end and eval (toolkit/metrics.py)."""
        return self.root / "metrics.jsonl"

    @property
    def run_json(self) -> Path:
        """The run's identity: strategy, processes, batch, stages, versions."""
        return self.root / "run.json"

    @property
    def recipe(self) -> Path:
        """The resolved recipe the run trained with (export rebuilds the model from it)."""
        return self.root / "recipe.yaml"

    @property
    def trackers(self) -> Path:
        """accelerate's tracker logs (TensorBoard and the like)."""
        return self.root / "trackers"

    @property
    def dummy_data(self) -> Path:
        """Where the `dummy:` data files are generated."""
        return self.root / "dummy_data"

    @property
    def plot(self) -> Path:
        """`toolkit plot`'s picture of metrics.jsonl."""
        return self.root / "training.png"

    @property
    def evals(self) -> Path:
        """Generation-eval completions and the forgetting matrix (toolkit/evals.py, toolkit/forgetting.py)."""
        return self.root / "evals"

    def completions(self, stage: str, step: int) -> Path:
        """One eval's completions, `evals/<stage>/step-N.jsonl` (N as in checkpoint names)."""
        return self.evals / re.sub(r"[^\w.-]|^\.", "_", stage) / f"step-{step:08d}.jsonl"

    @property
    def eval_matrix(self) -> Path:
        """The forgetting matrix (eval.all_stages): one record per step, eval set and metric."""
        return self.evals / "matrix.jsonl"

    @property
    def matrix_plot(self) -> Path:
        """`toolkit plot`'s heatmap of the forgetting matrix."""
        return self.root / "forgetting.png"

    @property
    def cache(self) -> Path:
        """The cache shared by the runs beside this one; it holds the built-in models' folders."""
        return self.root.parent / ".toolkit-cache"

    @property
    def tokenized(self) -> Path:
        """The default tokenised-data cache (data.cache_dir)."""
        return self.cache / "tokenized"

    @property
    def locks(self) -> Path:
        """The run locks, one file per output dir."""
        return self.cache / "locks"

    @property
    def earlier_run_files(self) -> tuple[Path, ...]:
        """What a run writes into its output dir once training starts; their presence marks an earlier run."""
        return self.metrics, self.run_json, self.final, self.evals


def check_output_dir(out: Path) -> None:
    """Fail before any data or model is loaded when `out` cannot hold a run: a file, inside a file, or not
    writable."""
    if out.exists() and not out.is_dir():
        raise ToolkitError(f"output_dir {out} is a file; name a folder (it is created if missing).")
    existing = next(p for p in (out, *out.parents) if p.exists())  # '.' or '/' at the latest
    if not existing.is_dir():
        raise ToolkitError(f"output_dir {out} cannot be created: {existing} is a file.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ToolkitError(f"output_dir {out} is not writable ({existing} does not allow this user to write). "
                           "Choose a folder you can write to.")


def check_not_an_earlier_run(out: Path) -> None:
    """Refuse to start afresh in a folder holding an earlier run's outputs that no checkpoint continues: its
    metrics and final model would be replaced, and its tracker logs mixed with the new run's."""
    found = [path.name for path in RunLayout(out).earlier_run_files if path.exists()]
    if found:
        raise ToolkitError(f"output_dir {out} holds the outputs of an earlier run ({', '.join(found)}) and no "
                           "checkpoint to resume from: starting here would replace them. Use a new output_dir, "
                           "or delete this one if you no longer need it.")


class RunLock:
    """Exclusive, process-lifetime lock on an output dir (see the module docstring). Hold the object."""

    def __init__(self, layout: RunLayout) -> None:
        out = layout.root
        self.path = layout.locks / f"{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:20]}.lock"
        self.out = out
        self._file: IO[str] | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns None, or why it cannot be taken (who holds it)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = self.path.open("a+", encoding="utf-8")
        except OSError as e:
            return f"its lock file {self.path} cannot be opened ({e.strerror})"
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            try:
                who = json.loads(holder)
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["since"]))
                desc = f"pid {who['pid']} on {who['host']}, started {since}"
            except (ValueError, KeyError, TypeError):
                desc = "another process"
            return (f"a live run is writing it ({desc}; lock {self.path}). Wait for it to end or stop it; a run "
                    "stopped by a signal saves and exits within a step")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                            "output_dir": str(self.out.resolve())}))
        f.flush()
        self._file = f  # open for the life of the process; closing it would release the lock
        return None
