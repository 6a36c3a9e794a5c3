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
import io
import json
import logging
import math
import pickle
import re
import secrets
import shutil
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from toolkit.atomic import build_dir, swap_dir, write_text_atomic
from toolkit.checkpoint.lease import delete_unless_leased
from toolkit.checkpoint.model_card import MODEL_CARD
from toolkit.config.identity import changed_keys as _changed_keys
from toolkit.errors import OutOfSpace, ToolkitError
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import _STEP_DIR, COMMIT_MARKER, checkpoint_dir, committed_checkpoints
from toolkit.strategies import consolidate, deepspeed, param_state

META_FILE = "meta.json"
BEST_FILE = "best.json"
FINAL_CHECKSUMS = "checksums.json"
"""In final/: the size and sha256 of every file training saved there, as a checkpoint's meta.json records its own."""

log = logging.getLogger(__name__)


def portable_lora_file(ckpt: Path) -> Path:
    """The strategy-free LoRA state of a checkpoint (adapter weights and Adam moments; `checkpoint.portable`)."""
    return ckpt / "portable" / "lora_state.safetensors"


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


def recipe_hash(settings: dict[str, Any]) -> str:
    """Hash of the recipe settings that must not change on resume (they change what the steps compute)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


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
        """Partial saves (`*.tmp`) of a run that died, or replaced folders a reader held until now."""
        for path in self.root.iterdir():
            if path.name.endswith(".tmp") and path.is_dir():
                delete_unless_leased(path)

    def _rotate(self) -> None:
        """Delete committed checkpoints beyond the last `keep_last`, never the best nor one that a reader holds
        (a later rotation deletes it); clear stale temp dirs."""
        keep = {p.name for p in committed_checkpoints(self.root)[-self.keep_last:]}
        if self._best is not None:
            keep.add(self._best["path"])
        self._clear_stale()
        for path in sorted(self.root.iterdir()):
            if _STEP_DIR.match(path.name) and path.name not in keep and not delete_unless_leased(path):
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


def find_resume(resume: str, root: Path) -> Path | None:
    """The checkpoint to resume from: `auto` = newest committed under `root`, `none`, or an explicit path."""
    if resume == "none":
        return None
    if resume == "auto":
        found = committed_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ToolkitError(f"checkpoint.resume: '{resume}' does not exist. Give a committed checkpoint directory "
                           f"(e.g. {root}/step-00000100), 'auto' or 'none'.")
    if not (path / COMMIT_MARKER).is_file():
        raise ToolkitError(f"checkpoint.resume: '{resume}' is not a committed checkpoint (no {COMMIT_MARKER} "
                           "marker): it was interrupted while being written. Resume from an earlier one.")
    return path


# --- Refusing pickled code: validate every pickle-based file before accelerate / DeepSpeed unpickle it. ---

class _MetadataUnpickler(pickle.Unpickler):
    """For torch.distributed.checkpoint `.metadata` files: DCP's own metadata classes and torch basics only."""

    def find_class(self, module: str, name: str) -> Any:
        if "." in name:  # protocol 4 resolves dotted names attribute by attribute: 'os.system' via any module
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        if module.startswith(("torch.distributed.checkpoint.", "torch.distributed._shard.")):
            found = super().find_class(module, name)
            if isinstance(found, type):  # metadata dataclasses and enums, never functions
                return found
        elif (module in ("torch", "collections", "builtins") and name in _DCP_BASICS) or (
                (module, name) in {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


_DCP_BASICS = {"Size", "float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "int8", "bool",
               "strided", "contiguous_format", "device", "OrderedDict", "dtype", "layout", "memory_format",
               "set", "frozenset", "slice", "complex"}


def _load_weights_only(source: Any, *, mmap: bool = False) -> None:
    with torch.serialization.safe_globals(consolidate.checkpoint_safe_globals()):
        torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


def _verify_dcp_dir(metadata_file: Path) -> None:
    """A DCP directory: the pickled metadata, then every non-tensor entry of its .distcp files, which DCP's
    loader would otherwise unpickle with weights_only=False (optimizer param_groups, for example)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with metadata_file.open("rb") as f:
        metadata = _MetadataUnpickler(f).load()
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = metadata.storage_data[MetadataIndex(fqn)]
        if getattr(info, "transform_descriptors", None):
            raise pickle.UnpicklingError(f"entry {fqn} is stored transformed and cannot be checked")
        with (metadata_file.parent / info.relative_path).open("rb") as f:
            f.seek(info.offset)
            try:
                _load_weights_only(io.BytesIO(f.read(info.length)))
            except pickle.UnpicklingError as e:
                raise pickle.UnpicklingError(f"in {info.relative_path}, entry {fqn}: {e}") from None


def verify_checkpoint_files(ckpt: Path) -> None:
    """Raise ToolkitError if any file could execute code when unpickled, or is truncated/corrupt."""
    from safetensors import safe_open

    for path in sorted(ckpt.rglob("*")):
        if not path.is_file():
            continue
        try:
            if path.suffix in (".bin", ".pt", ".pkl", ".pth"):
                is_zip = zipfile.is_zipfile(path)
                with path.open("rb") as f:
                    head = f.read(4)
                    if not head or (not is_zip and head == b"PK\x03\x04"):
                        raise ValueError("empty or truncated (a zip archive without its directory)")
                _load_weights_only(path, mmap=is_zip)  # mmap: tensor data is not read
            elif path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                        f.get_slice(key)
            elif path.name == ".metadata":
                _verify_dcp_dir(path)
        except pickle.UnpicklingError as e:
            lines = str(e).splitlines()
            culprit = " ".join(line.strip() for line in lines if "GLOBAL" in line or "global" in line or
                               ".distcp" in line) or lines[0]
            raise ToolkitError(f"Refusing to load checkpoint {ckpt}: {path.name} contains pickled objects that are "
                               f"not plain tensors or known-safe types ({culprit[:300]}). Only "
                               "load checkpoints you wrote yourself.") from None
        except Exception as e:
            raise ToolkitError(f"Checkpoint {ckpt} is damaged: {path.relative_to(ckpt)} cannot be read "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Resume from an earlier "
                               "checkpoint (checkpoint.resume=<path>).") from None


# --- Strategy-independent LoRA state: adapter weights + Adam moments, gathered to full tensors. ---

def _trainable(accelerator: Accelerator, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad]


def save_portable_lora(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, ckpt: Path,
                       adam_steps: dict[str, int]) -> None:
    """Every rank calls this (gathers are collective); rank 0 writes full fp32 tensors in safetensors.

    Every trainable parameter gets `param/`, `exp_avg/` and `exp_avg_sq/` entries (zero moments for one never
    updated yet, Adam's own start), so the file is the same whatever layout wrote it. `adam_steps`: each trainable
    parameter's Adam step count (it differs from the global step when stages freeze some parameters, or steps were
    skipped); restored with the moments on a portable resume.
    """
    from safetensors.torch import save_file

    param_state.ensure_adam_state(accelerator, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in _trainable(accelerator, model):
        for key, value in param_state.full_param_state(accelerator, optimizer, param).items():
            tensors[f"{key}/{name}"] = value
    if accelerator.is_main_process:
        target = portable_lora_file(ckpt)
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(target), metadata={"adam_steps": json.dumps(adam_steps)})


def load_portable_lora(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, ckpt: Path) -> list[str]:
    """Put a portable LoRA state into a prepared model/optimizer of any strategy (every rank calls this): weights,
    Adam moments and each parameter's Adam step count. A parameter without moments in the file (an earlier version
    wrote none before its first update) starts from Adam's start (zero moments, step 0). Returns what was not
    restored as the checkpoint has it (Adam state reset for such parameters that had been updated, ...)."""
    from safetensors import safe_open

    with safe_open(str(portable_lora_file(ckpt)), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        metadata = f.metadata() or {}
    # Checkpoints of earlier versions hold one global step for every parameter.
    steps = json.loads(metadata["adam_steps"]) if "adam_steps" in metadata else None
    named = _trainable(accelerator, model)
    missing = [n for n, _ in named if f"param/{n}" not in stored]
    if missing:
        raise ToolkitError(f"The portable LoRA state in {portable_lora_file(ckpt)} has no entry for {missing[:3]}: "
                           "the LoRA settings changed since the checkpoint. Resume with the same lora: section.")
    entries, reset = [], []
    for name, param in named:
        value = stored[f"param/{name}"]
        step = steps[name] if steps is not None else int(metadata["adam_step"])
        moments = {k: stored.get(f"{k}/{name}") for k in param_state.MOMENTS}
        if any(m is None for m in moments.values()):  # zeros at step 0 are Adam's start: a loss only if it stepped
            reset += [name] if step > 0 else []
            moments, step = {k: torch.zeros_like(value) for k in moments}, 0
        entries.append((param, {"param": value, **moments}, step))
    lost = param_state.set_full_state(accelerator, optimizer, entries)
    if reset:
        lost.insert(0, f"Adam state of {len(reset)} parameter(s) the checkpoint holds none for (e.g. {reset[0]}) "
                       "reset")
    return lost


def _unsaveable(state_dict: dict[str, Any], out_dir: Path) -> str | None:
    """Why these gathered weights must not be written as the run's result, or None."""
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    empty = [k for k, v in tensors.items() if v.numel() == 0]
    if empty:
        return (f"Refusing to save {out_dir}: gathered tensors are empty ({empty[:3]}...). With ZeRO-3 set "
                "stage3_gather_16bit_weights_on_model_save: true.")
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        return (f"Refusing to save {out_dir}: the final weights are not finite ({len(bad)} tensors, e.g. "
                f"{bad[:3]}). Training diverged; lower the learning rate and resume from a checkpoint before it.")
    return None


def save_final(accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | ProcessorMixin,
               out_dir: Path, *, card: str | None = None) -> Path:
    """Write the PEFT adapter (or full model) and tokenizer (or processor) to `out_dir`, and the model card `card`
    (rank 0's is written) as its README.md. Every rank must call this.

    `get_state_dict` gathers ZeRO-3 partitions (16-bit gather on save) and FSDP shards into full tensors;
    saving the unwrapped model's own state dict instead is what leaves peers with empty `[0]` adapters.
    The directory is written under a temporary name and swapped in (toolkit/atomic.py), so a crash never leaves a
    half-written model.
    """
    state_dict = accelerator.get_state_dict(model)
    # Decided on rank 0, which holds the gathered weights, and shared: every rank fails alike, none waits.
    problem = distributed.broadcast_from_main(accelerator, _unsaveable(state_dict, out_dir)
                                              if accelerator.is_main_process else None)
    if problem is not None:
        raise ToolkitError(problem)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)

        def write(tmp: Path) -> None:
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            # Checked by whatever loads final/ (verify_final): a file cut short or swapped is refused. The card (PEFT
            # writes a placeholder one) is not recorded: it is documentation, which a user may edit before
            # publishing, and an edited card must not make the weights beside it "damaged".
            files = {rel: digest for rel, digest in file_digests(tmp).items() if rel != MODEL_CARD}
            write_text_atomic(tmp / FINAL_CHECKSUMS, json.dumps({"files": files}, indent=1))
            if card is not None:
                write_text_atomic(tmp / MODEL_CARD, card)

        build_dir(out_dir, write, tmp=out_dir.with_name(out_dir.name + ".tmp"))
    accelerator.wait_for_everyone()
    return out_dir


def verify_final(folder: Path, *, weights: bool = True) -> None:
    """Refuse a final/ whose files are not the ones training saved (cut short, corrupted, swapped), in one line
    naming the file; `weights` False checks all but the weights (a reader of its tokenizer only). The model card
    (README.md) is never checked, also where an earlier version recorded it: a user may edit it. A final/ of an
    earlier version, without checksums, is loaded with a warning that it is unverified."""
    path = folder / FINAL_CHECKSUMS
    if not path.is_file():
        log.warning("%s has no %s (written by an earlier version): loading it unverified", folder, FINAL_CHECKSUMS)
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["files"]
        if not isinstance(recorded, dict):
            raise TypeError("files is not an object")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ToolkitError(f"{path} cannot be read ({type(e).__name__}: {e}): {folder} cannot be verified. Export "
                           "a checkpoint of the run instead, or restore the original files.") from None
    recorded = {rel: want for rel, want in recorded.items()
                if rel != MODEL_CARD and (weights or not rel.endswith((".safetensors", ".bin")))}
    try:
        problem = changed_files(folder, {"files": recorded})
    except (KeyError, TypeError) as e:
        problem = f"{FINAL_CHECKSUMS} is not a record of its files ({type(e).__name__}: {e})"
    if problem is not None:
        raise ToolkitError(f"{folder} does not hold what training saved: {problem}. Export a checkpoint of the run "
                           "instead (toolkit export <output_dir>/checkpoints/step-N), or restore the original files.")


# --- What the training script calls. ---

def write_state(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, tmp: Path, *,
                adam_steps: dict[str, int] | None) -> None:  # tmp last: partial(...) leaves it open
    """All of a checkpoint but meta and marker: accelerate's state, plus the portable LoRA state when
    `adam_steps` (per trainable parameter) is given. All ranks."""
    accelerator.save_state(str(tmp))
    if adam_steps is not None:
        save_portable_lora(accelerator, model, optimizer, tmp, adam_steps)


# Same-layout resumes proven bit-exact by tests/test_resume.py::test_resume_from_every_checkpoint_is_exact: from
# every checkpoint of the 3-stage curriculum (stages training different parameters), every later step's loss, lr,
# gradient norm and counts and the final adapter equal the uninterrupted run's. (strategy name, mixed precision).
EXACT_RESUME_TESTED = frozenset([*((s, "no") for s in ("single", "ddp", "fsdp2", "zero2", "zero3", "zero3_offload")),
                                  ("single", "bf16"), ("zero3", "bf16")])
EXACT_RESUME_SCOPE = ("fp32 (mixed_precision: no) single, ddp, fsdp2, zero2, zero3 and zero3_offload; bf16 single "
                      "and zero3")


def same_layout(meta: dict[str, Any], strategy: str, world_size: int) -> bool:
    """Whether the checkpoint's shards fit this run as they are (same strategy, same process count)."""
    return meta["world_size"] == world_size and meta["strategy"] == strategy


BASE_MODEL_KEY = "model.name_or_path"
"""The recipe key naming the model whose weights a checkpoint's state holds (accelerate's state: every weight)."""


def state_signature(model: torch.nn.Module, groups: list[tuple[tuple[bool, ...], list[str]]]) -> dict[str, str]:
    """What a checkpoint's state is made of, as digests: every parameter of the (unprepared) model by name and
    shape (accelerate's state holds them all), and the optimizer's groups (which parameters train in which stages:
    their Adam state). A run whose model differs in either cannot load the state, forced or not."""
    params = [(name, deepspeed.full_shape(p)) for name, p in model.named_parameters()]

    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]

    return {"parameters": digest(params), "optimizer": digest([[list(stages), names] for stages, names in groups])}


def _value_at(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if isinstance(tree, dict):
            tree = tree.get(part)
        elif isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return None
    return tree


def _both_values(keys: list[str], saved: dict[str, Any], now: dict[str, Any]) -> str:
    """`key (old -> new)` for each key: what a refusal names."""
    return ", ".join(f"{k} ({json.dumps(_value_at(saved, k))} -> {json.dumps(_value_at(now, k))})" for k in keys)


def _unfollowable(ckpt: Path, changes: str, why: str) -> ToolkitError:
    return ToolkitError(
        f"Checkpoint {ckpt} cannot be resumed into this run, even with checkpoint.resume_force: {changes} changed, "
        f"and {why}. Resume with the recipe it was written with, or start a new output_dir from its weights "
        f"(toolkit export {ckpt} --merge).")


def check_state(meta: dict[str, Any], ckpt: Path, state: dict[str, str], invariants: dict[str, Any]) -> None:
    """Refuse a resume whose model cannot hold the checkpoint's state (`state`: this run's `state_signature`, of the
    model built and not yet loaded), forced or not: the recipe keys that build the model (model, lora, trainable)
    and changed are named with both values. Checkpoints of earlier versions recorded no signature: their load says
    it (`restore`)."""
    saved = meta.get("state")
    if saved is None or saved == state:
        return
    parts = [{"parameters": "its weights", "optimizer": "its Adam state"}[p] for p in ("parameters", "optimizer")
             if saved.get(p) != state.get(p)]
    before = meta.get("invariants") or {}
    keys = [k for k in _changed_keys(before, invariants)
            if k.split(".")[0] in ("model", "lora", "trainable") or re.fullmatch(r"stages\.\d+\.trainable(\..*)?", k)]
    changes = _both_values(keys, before, invariants) if keys else "no recipe key (this version builds the model " \
                                                                  "otherwise)"
    raise _unfollowable(ckpt, changes, f"{' and '.join(parts)} do not fit the parameters this recipe trains "
                                       "(another set or other shapes)")


def check_resumable(meta: dict[str, Any], ckpt: Path, *, invariants_hash: str, effective_batch: int,
                    strategy: str, world_size: int, force: bool, stage_batches: list[int] | None = None,
                    invariants: dict[str, Any] | None = None, data_files: dict[str, str] | None = None,
                    stage_steps: list[int] | None = None, data_stores: dict[str, str] | None = None) -> list[str]:
    """Refuse a resume that would silently change training (unless `resume_force`) or cannot load.

    Returns what differs from the checkpoint and was accepted because of `force` (empty when nothing does):
    settings by recipe key, data files whose content changed, token stores whose tokens differ. `invariants` /
    `data_files` / `data_stores` are this run's; they are compared with what the checkpoint recorded (checkpoints
    of earlier versions recorded only the hash, or no store checksums).
    """
    if not same_layout(meta, strategy, world_size) and not portable_lora_file(ckpt).is_file():
        layout = layout_name(meta["strategy"], meta["world_size"])
        raise ToolkitError(
            f"Checkpoint {ckpt} was written by {layout}; this run is {layout_name(strategy, world_size)}. Sharded "
            f"full fine-tuning states cannot be re-partitioned: resume with {layout}, or export the weights "
            f"(toolkit export {ckpt} --out DIR) and start a new run from them.")
    differences = []
    if meta["recipe_hash"] != invariants_hash:
        keys = _changed_keys(meta["invariants"], invariants) if "invariants" in meta and invariants else []
        if force and BASE_MODEL_KEY in keys:  # its state holds every weight of the model it trained
            raise _unfollowable(ckpt, _both_values([BASE_MODEL_KEY], meta["invariants"], invariants),
                                "its state holds the weights of the model it trained, not of this one")
        differences.append("changed settings: " + (", ".join(keys) if keys else "model, lora, data, stages, "
                                                  "optimizer, schedule or seed"))
    saved_data = meta.get("data_files") or {}
    changed = [e for e in sorted(set(saved_data) & set(data_files or {})) if saved_data[e] != data_files[e]]
    if changed:
        differences.append("data files whose content changed since the checkpoint: " + ", ".join(changed))
    saved_stores = meta.get("data_stores") or {}
    retokenised = [e for e in sorted(set(saved_stores) & set(data_stores or {}))
                   if saved_stores[e] != (data_stores or {})[e] and e not in changed]
    if retokenised:
        differences.append("token stores whose tokens differ from the checkpoint's (same data files, other "
                           "tokens: prepared by other library versions, or edited): " + ", ".join(retokenised))
    if differences and not force:
        raise ToolkitError(
            f"Checkpoint {ckpt} was written with different training settings or data ({'; '.join(differences)}). "
            "The rest of the run would differ from the one checkpointed. Resume with the recipe and data it was "
            "written with (its recipe is saved as recipe.yaml in the output dir), start a new output_dir, or set "
            "checkpoint.resume_force=true to continue with the new ones.")
    if meta["effective_batch"] != effective_batch:
        raise ToolkitError(
            f"Checkpoint {ckpt} trained with an effective batch of {meta['effective_batch']}, this run has "
            f"{effective_batch} (micro_batch_size x grad_accum x processes). The data order depends on it: set "
            "train.micro_batch_size / train.grad_accum so the product with the process count matches.")
    saved = meta.get("stage_batches")  # absent in checkpoints of earlier versions
    if stage_batches is not None and saved is not None and saved != stage_batches:
        i = next(i for i, (a, b) in enumerate(zip(saved, stage_batches, strict=True)) if a != b)
        raise ToolkitError(
            f"Checkpoint {ckpt} trained stage {i} with a global batch of {saved[i]}, this run has "
            f"{stage_batches[i]} (stages.{i}.micro_batch_size x grad_accum x processes). The data order depends on "
            f"it: set stages.{i}.micro_batch_size so the product with the process count matches.")
    _check_begun_stage_lengths(meta, ckpt, stage_steps)
    return differences


def _check_begun_stage_lengths(meta: dict[str, Any], ckpt: Path, stage_steps: list[int] | None) -> None:
    """A stage the checkpoint has begun (or finished) keeps its planned length, even under `resume_force`: its data
    order, pacing and lr schedule were drawn for that length, and a resume keeps the steps the checkpoint ran (an
    early end included), so a changed max_steps / epochs / data size would be ignored. Later stages follow this
    run's plan (`Curriculum.restore`)."""
    saved = meta.get("stage_plan_steps")  # planned lengths; absent in checkpoints of earlier versions
    if stage_steps is None or saved is None:
        return
    for i in range(min(meta.get("stage_index", 0) + 1, len(saved))):
        now = stage_steps[i] if i < len(stage_steps) else None
        if now != saved[i]:
            raise ToolkitError(
                f"Checkpoint {ckpt} was taken in stage {meta.get('stage_index', 0)}; stage {i} was planned for "
                f"{saved[i]} steps and this run plans {'no such stage' if now is None else f'{now} steps'} "
                f"(stages.{i}.max_steps / epochs, or its data). A stage that has begun keeps its length (its data "
                "order and lr schedule were drawn for it), even with checkpoint.resume_force. Resume with the stage "
                "lengths it was written with; to train more, add a later stage, or start a new output_dir from the "
                f"exported weights (toolkit export {ckpt} --merge).")


def layout_name(strategy: str, world_size: int) -> str:
    return f"{strategy} x {world_size}"


def reseed_for_layout(seed: int, step: int, rank: int) -> None:
    """After a portable resume: seed this rank's Python, NumPy and torch RNG from (seed, step, rank). The saved
    per-rank streams cannot carry over to another process count; this is deterministic (the same resume replays
    the same run) and never replays the streams the run started with (seed + rank)."""
    import numpy as np
    from accelerate.utils import set_seed

    set_seed(int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0]))


@dataclass(frozen=True)
class Restored:
    """How a checkpoint was loaded, for the resume's log line: `exact`, or `portable (A -> B; ...)` naming what
    could not be carried over. `lost` is training state that starts afresh (the line is then a warning)."""

    how: str
    lost: tuple[str, ...] = ()


_LOAD_MISFITS = ("Error(s) in loading state_dict", "size mismatch", "doesn't match the size of optimizer's group",
                 "parameter group that doesn't match")
"""What torch's load_state_dict says of a model or optimizer state written for other parameters."""


def restore(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, scheduler: Any, ckpt: Path, *,
            strategy: str, seed: int) -> Restored:
    """Load `ckpt` into the prepared objects. All ranks call this.

    Same strategy and process count: accelerate's load_state restores everything (model, optimizer, scheduler, RNG
    per rank, accumulation counter); 'exact' is said only where EXACT_RESUME_TESTED proves it. Otherwise (checked
    by `check_resumable`: a LoRA run with a portable state) the adapter, its Adam moments and step counts are
    scattered into this layout, the scheduler position is loaded (and the lr it set for the next step put back
    into the optimizer), and each rank's RNG is reseeded from the step (`reseed_for_layout`). The data position is
    a function of the step either way.
    """
    verify_checkpoint_files(ckpt)
    meta = read_meta(ckpt)
    if same_layout(meta, strategy, accelerator.num_processes):
        try:
            accelerator.load_state(str(ckpt))
        except (RuntimeError, ValueError) as e:  # a checkpoint of an earlier version, without a state signature
            if not any(sign in str(e) for sign in _LOAD_MISFITS):
                raise
            raise ToolkitError(
                f"Checkpoint {ckpt} does not fit this run's model ({str(e).strip().splitlines()[0][:160]}): it was "
                "written for other parameters (model, lora or trainable settings). Resume with the recipe it was "
                f"written with, or start a new output_dir from its weights (toolkit export {ckpt} --merge).") from None
        if (strategy, accelerator.mixed_precision) in EXACT_RESUME_TESTED:
            return Restored("exact")
        return Restored(f"same layout: every state restored, but bit-exact resume is tested for "
                        f"{EXACT_RESUME_SCOPE} only, not {strategy} in {accelerator.mixed_precision}")
    lost = load_portable_lora(accelerator, model, optimizer, ckpt)
    scheduler_files = sorted(ckpt.glob("custom_checkpoint_*.pkl"))
    scheduler.load_state_dict(torch.load(scheduler_files[0], map_location="cpu", weights_only=True))
    # load_state_dict restores the position, not the optimizer's lr: that was set by the step before the save.
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    reseed_for_layout(seed, meta["step"], accelerator.process_index)
    if accelerator.mixed_precision == "fp16":
        lost.append("fp16 loss scale reset")
    before, after = layout_name(meta["strategy"], meta["world_size"]), layout_name(strategy, accelerator.num_processes)
    notes = [f"{before} -> {after}", "RNG reseeded per rank from the step", *lost]
    return Restored(f"portable ({'; '.join(notes)})", tuple(lost))
