"""Checkpoints that never lose work, over accelerate's `save_state` / `load_state`.

Layout: `<output_dir>/checkpoints/step-00000042/` holds accelerate's state (model, optimizer, registered LR
scheduler, RNG per rank; DeepSpeed ZeRO and FSDP shards in their own formats), `meta.json`, for LoRA runs a
strategy-independent `portable/` copy of the adapter and its Adam state, and last the `COMMITTED` marker.

Commit protocol: every rank writes into `step-N.tmp`; after a barrier rank 0 writes `meta.json` and the marker
(fsynced), renames the directory to `step-N` (toolkit/atomic.py), and only then rotates old checkpoints. A
directory without the marker is never loaded, so a crash at any moment leaves the previous committed checkpoint as
the resume point.
Rotation keeps the last `keep_last` plus the best by a metric (never deleted); `best.json` points at it. The
checkpoints' own meta.json files are the record of truth: a damaged, stale or missing `best.json` is rebuilt from
them when the run starts (one warning), so it can never make rotation delete the best checkpoint, nor crash a run.
A checkpoint that a reader holds a lease on (`toolkit export`, toolkit/checkpoint/lease.py) is left for a later
rotation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.atomic import apply_umask, swap_dir, write_text_atomic
from toolkit.checkpoint.lease import delete_unless_leased
from toolkit.checkpoint.portable import save_portable_lora
from toolkit.errors import OutOfSpace, ToolkitError
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import COMMIT_MARKER, checkpoint_dir, committed_checkpoints

_OUR_TEMP = re.compile(r"^step-\d{8}(\.[0-9a-f]{8})?\.tmp$")
"""The temporary folders this manager makes: `step-N.tmp` (a save being written), `step-N.<hex>.tmp` (`_discard`)."""

META_FILE = "meta.json"
BEST_FILE = "best.json"

log = logging.getLogger(__name__)


def read_meta(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's meta.json; a missing or damaged one is an error naming the checkpoint."""
    try:
        meta = json.loads((ckpt / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolkitError(f"Checkpoint {ckpt} has no {META_FILE}: it is not a complete checkpoint. Resume from "
                           "another one (checkpoint.resume=<path>).") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolkitError(f"Checkpoint {ckpt}: {META_FILE} is damaged ({e}). Resume from another checkpoint "
                           "(checkpoint.resume=<path>).") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise ToolkitError(f"Checkpoint {ckpt}: {META_FILE} is not this toolkit's checkpoint record. Resume from "
                           "another checkpoint (checkpoint.resume=<path>).")
    return meta


def file_digests(ckpt: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file of a checkpoint (but its meta and marker), by path relative to it."""
    digests = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        rel = path.relative_to(ckpt).as_posix()
        if rel in (META_FILE, COMMIT_MARKER):
            continue
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        digests[rel] = {"bytes": path.stat().st_size, "sha256": h.hexdigest()}
    return digests


def changed_files(ckpt: Path, meta: dict[str, Any]) -> str | None:
    """Why the files of `ckpt` are not the ones committed with it (missing, resized or other content), or None.
    Checkpoints of earlier versions recorded no digests and pass."""
    recorded = meta.get("files")
    if recorded is None:
        return None
    for rel, want in recorded.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{rel} has {path.stat().st_size} bytes, {want['bytes']} when it was committed"
    actual = file_digests(ckpt)
    for rel, want in recorded.items():
        if actual[rel]["sha256"] != want["sha256"]:
            return f"{rel} is not the file committed with it (its sha256 differs)"
    return None


def check_integrity(accelerator: Accelerator, ckpt: Path, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint whose files changed since its commit (a file swapped in from another run, a copy cut
    short). Rank 0 reads the files once and every rank gets its verdict."""
    problem = distributed.broadcast_from_main(accelerator, changed_files(ckpt, meta)
                                              if accelerator.is_main_process else None)
    if problem is not None:
        raise ToolkitError(f"Checkpoint {ckpt} does not hold what was committed: {problem}. Resume from another "
                           "checkpoint (checkpoint.resume=<path>) or restore the original files.")


# torch.save's writer reports a failed write (ENOSPC included) as a RuntimeError with one of these messages.
_TORCH_WRITE_FAILURES = ("PytorchStreamWriter", "inline_container", "iostream error", "file write failed")


def _write_failure(e: Exception) -> str | None:
    """What a failed file write says, or None when `e` is not one. A full disk reaches the checkpoint writers as an
    OSError, but also wrapped by safetensors (SafetensorError) and torch.save (RuntimeError) in their own types."""
    from safetensors import SafetensorError

    if isinstance(e, OutOfSpace):  # from toolkit/atomic.py's writers (meta.json, the commit marker)
        return f"{e.reason} ({e.path})"
    if isinstance(e, OSError):
        return f"{e.strerror or e} ({e.filename})" if e.filename else str(e.strerror or e)
    if isinstance(e, SafetensorError) or (isinstance(e, RuntimeError) and any(
            marker in str(e) for marker in _TORCH_WRITE_FAILURES)):
        return f"{type(e).__name__}: {e}"
    return None


class CheckpointManager:
    """Atomic saves, rotation and best tracking. Rank 0 does the file operations; all ranks write state."""

    def __init__(self, root: Path, *, keep_last: int, best_metric: str | None, best_mode: str,
                 is_main: bool, barrier: Callable[[], None]) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        self.root, self.keep_last = root, keep_last
        self.best_metric, self.best_mode = best_metric, best_mode
        self.is_main, self.barrier = is_main, barrier
        self._best: dict[str, Any] | None = None
        if is_main and root.is_dir():  # partial saves of a run that died (the run lock rules out a live writer)
            self._clear_stale()
            self._best = self._load_best()

    @property
    def best(self) -> dict[str, Any] | None:
        """The best checkpoint's record, as in best.json: {step, metric, value, path} (rank 0; None elsewhere)."""
        return self._best

    def save(self, step: int, write_state: Callable[[Path], None], meta: dict[str, Any]) -> Path:
        """Write a checkpoint for `step` with `write_state(tmp_dir)` on every rank, then commit and rotate."""
        final, tmp = checkpoint_dir(self.root, step), self.root / f"step-{step:08d}.tmp"
        try:
            if self.is_main:
                _discard(tmp)
                tmp.mkdir(parents=True)
            self.barrier()
            write_state(tmp)
            self.barrier()  # every rank finished writing its shards
            if self.is_main:
                apply_umask(tmp)  # safetensors writes its files 0600 whatever the umask
                # Digests of what was written, checked on resume: a file swapped or cut short is refused.
                meta = {**meta, "files": file_digests(tmp)}
                write_text_atomic(tmp / META_FILE, json.dumps(meta, indent=2))
                write_text_atomic(tmp / COMMIT_MARKER, f"{time.time()}\n")
        except Exception as e:  # disk full, quota, permissions: the partial state goes, the last checkpoint stays
            if (why := _write_failure(e)) is None:
                raise
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            earlier = [c for c in committed_checkpoints(self.root) if c != final]
            after = (f"the last committed one, {earlier[-1]}, is intact. Free space and relaunch the same command to "
                     "resume from it." if earlier else "no checkpoint was committed before it. Free space and "
                     "relaunch the same command: it starts again from the first step.")
            raise ToolkitError(f"Could not write checkpoint {final}: {why}. The partial checkpoint was removed; "
                               f"{after}") from None
        if self.is_main:
            # The same step may be saved again (e.g. end of stage right after a resume): the folder it replaces
            # goes once no reader holds it.
            if (replaced := swap_dir(tmp, final)) is not None:
                _discard(replaced)
            self._update_best(step, meta.get("metrics", {}))
            self._rotate()
        self.barrier()
        return final

    def _better(self, value: Any, than: dict[str, Any] | None) -> bool:
        """Whether a checkpoint's `best_metric` value is a new best (finite, and strictly better than `than`)."""
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        return than is None or (value < than["value"] if self.best_mode == "min" else value > than["value"])

    def _update_best(self, step: int, metrics: dict[str, Any]) -> None:
        value = metrics.get(self.best_metric) if self.best_metric else None
        if self._better(value, self._best):
            self._best = {"step": step, "metric": self.best_metric, "value": value,
                          "path": checkpoint_dir(self.root, step).name}
            write_text_atomic(self.root / BEST_FILE, json.dumps(self._best))

    def _best_by_metadata(self) -> dict[str, Any] | None:
        """The best committed checkpoint by the metric values in their meta.json, chosen as saving chose it: the
        earliest strictly better one. Rotation never deleted the best, so this is the record's true content."""
        best = None
        for ckpt in committed_checkpoints(self.root):
            try:
                meta = read_meta(ckpt)
            except ToolkitError:  # a damaged meta.json: its metric cannot be known (nor can it be resumed)
                continue
            value = (meta.get("metrics") or {}).get(self.best_metric)
            if self._better(value, best):
                best = {"step": meta["step"], "metric": self.best_metric, "value": value, "path": ckpt.name}
        return best

    def _load_best(self) -> dict[str, Any] | None:
        """best.json as checked against the checkpoints themselves. A record that is unreadable, of another shape
        or metric, names a checkpoint that is gone or uncommitted, or disagrees with the checkpoints' metadata
        (a crash between a commit and its best.json update) is rewritten from that metadata, with one warning;
        no checkpoint is deleted because of it."""
        if self.best_metric is None:
            return None
        path, truth = self.root / BEST_FILE, self._best_by_metadata()
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))
            problem = None if recorded == truth else _record_problem(recorded, self.root, self.best_metric)
        except FileNotFoundError:
            recorded, problem = None, "is missing"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            recorded, problem = None, f"cannot be read ({type(e).__name__}: {str(e)[:120]})"
        if recorded == truth:
            return truth
        rebuilt = (f"the best by {self.best_metric} ({self.best_mode}) is {truth['path']} ({truth['value']:.6g})"
                   if truth else f"no committed checkpoint has a {self.best_metric} value yet")
        log.warning("%s %s: rebuilt from the committed checkpoints' meta.json; %s. No checkpoint was deleted.",
                    path, problem or "does not match the checkpoints' meta.json", rebuilt)
        if truth is not None:
            write_text_atomic(path, json.dumps(truth))
        else:
            path.unlink(missing_ok=True)
        return truth

    def _clear_stale(self) -> None:
        """Partial saves (`step-N.tmp`) of a run that died, or replaced folders a reader held until now
        (`step-N.<hex>.tmp`): only the names this manager gives, never another `*.tmp` of the user's."""
        for path in self.root.iterdir():
            if _OUR_TEMP.match(path.name) and path.is_dir() and not path.is_symlink():
                delete_unless_leased(path)

    def _rotate(self) -> None:
        """Delete committed checkpoints beyond the last `keep_last`, never the best nor one that a reader holds
        (a later rotation deletes it); clear stale temp dirs."""
        keep = {p.name for p in committed_checkpoints(self.root)[-self.keep_last:]}
        if self._best is not None:
            keep.add(self._best["path"])
        self._clear_stale()
        for path in committed_checkpoints(self.root):  # only what this toolkit committed: never an unmarked folder
            if path.name not in keep and not path.is_symlink() and not delete_unless_leased(path):
                log.info("kept %s for now: a reader holds it (toolkit export); a later rotation deletes it", path)


def _record_problem(record: Any, root: Path, metric: str) -> str | None:
    """What is wrong with a parsed best.json record in itself (None: well-formed, for this metric, naming a
    committed checkpoint; it may still disagree with that checkpoint's metadata)."""
    keys = {"step": int, "metric": str, "value": int | float, "path": str}
    if not isinstance(record, dict) or any(not isinstance(record.get(k), t) for k, t in keys.items()):
        return "is not a best-checkpoint record ({step, metric, value, path})"
    if record["metric"] != metric:
        return f"was kept for the metric {record['metric']!r}, not checkpoint.best_metric {metric!r}"
    if record["path"] != checkpoint_dir(root, record["step"]).name or not (root / record["path"] / COMMIT_MARKER
                                                                            ).is_file():
        return f"names {record['path']!r}, which is not a committed checkpoint (deleted, or never committed)"
    return None


def _discard(path: Path) -> None:
    """Delete a checkpoint-shaped folder unless a reader holds it; then it is renamed to a `*.tmp` name of its own,
    which a later rotation deletes once the reader is done."""
    if not delete_unless_leased(path):
        path.rename(path.with_name(f"{path.name.removesuffix('.tmp')}.{secrets.token_hex(4)}.tmp"))


# --- Refusing pickled code: validate every pickle-based file before accelerate / DeepSpeed unpickle it. ---


# --- Strategy-independent LoRA state: adapter weights + Adam moments, gathered to full tensors. ---


# --- What the training script calls. ---

def write_state(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, tmp: Path, *,
                adam_steps: dict[str, int] | None) -> None:  # tmp last: partial(...) leaves it open
    """All of a checkpoint but meta and marker: accelerate's state, plus the portable LoRA state when
    `adam_steps` (per trainable parameter) is given. All ranks."""
    accelerator.save_state(str(tmp))
    if adam_steps is not None:
        save_portable_lora(accelerator, model, optimizer, tmp, adam_steps)


