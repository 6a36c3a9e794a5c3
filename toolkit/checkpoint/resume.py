"""Resuming: which checkpoint, whether it fits this run (settings, data, batch, layout, model state), and loading it
into the prepared objects, exactly or across layouts."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.checkpoint.manager import read_meta
from toolkit.checkpoint.portable import load_portable_lora, portable_lora_file
from toolkit.checkpoint.safe_load import load_checked, verify_checkpoint_files, weights_only_loads
from toolkit.config.identity import changed_keys as _changed_keys
from toolkit.errors import ToolkitError
from toolkit.runtime.run_dir import COMMIT_MARKER, committed_checkpoints
from toolkit.strategies import deepspeed


@dataclass
class RunIdentity:
    """What every checkpoint's meta.json says about the run itself, not its progress; a resume checks it against
    the checkpoint's (`check_resumable`, `check_state`). The fields are meta.json's keys, so checkpoints written
    before it was typed are read alike."""

    world_size: int
    strategy: str
    effective_batch: int
    stage_batches: list[int]  # each stage's global batch
    stage_plan_steps: list[int]  # each stage's planned length
    lora: bool
    recipe_hash: str  # of `invariants` (toolkit/config/identity.py)
    invariants: dict[str, Any]
    data_files: dict[str, str]  # each data file's content hash
    data_stores: dict[str, str]  # each token store's checksum
    run_name: str
    base_model: str
    toolkit_version: str
    state: dict[str, str] | None = None  # the model's trainable state (`state_signature`), once the model is built

    def to_meta(self) -> dict[str, Any]:
        """The meta.json entries."""
        meta = asdict(self)
        if self.state is None:
            del meta["state"]
        return meta


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


# Same-layout resumes proven bit-exact by tests/e2e/test_resume.py::test_resume_from_every_checkpoint_is_exact: from
# every checkpoint of the 3-stage curriculum (stages training different parameters), every later step's loss, lr,
# gradient norm and counts and the final adapter equal the uninterrupted run's; zero3_sp2 (Ulysses) from every
# checkpoint of its packed 2-stage smoke run (tests/e2e/test_strategies.py). (strategy name, mixed precision).
EXACT_RESUME_TESTED = frozenset([*((s, "no") for s in ("single", "ddp", "fsdp2", "zero2", "zero3", "zero3_offload",
                                                        "zero3_sp2")),
                                  ("single", "bf16"), ("zero3", "bf16")])


EXACT_RESUME_SCOPE = ("fp32 (mixed_precision: no) single, ddp, fsdp2, zero2, zero3, zero3_offload and zero3_sp2 "
                      "(Ulysses over 2 processes); bf16 single and zero3")


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


SCHEDULER_STATE = "custom_checkpoint_0.pkl"
"""The LR scheduler's state: accelerate's name for the first object registered for checkpointing, and the run
registers only the scheduler (toolkit/train/setup.py)."""


def _scheduler_state(ckpt: Path, meta: dict[str, Any]) -> Any:
    """The scheduler's state, read once, checked against the digest committed with it and unpickled weights-only
    from those bytes (`load_checked`)."""
    recorded = (meta.get("files") or {}).get(SCHEDULER_STATE)
    return load_checked(ckpt / SCHEDULER_STATE, recorded["sha256"] if recorded else None)


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
    scheduler_state = _scheduler_state(ckpt, meta)
    if same_layout(meta, strategy, accelerator.num_processes):
        try:
            with weights_only_loads(ckpt):  # a file swapped after the check cannot run code (safe_load.py)
                accelerator.load_state(str(ckpt))
        except (RuntimeError, ValueError) as e:  # a checkpoint of an earlier version, without a state signature
            if not any(sign in str(e) for sign in _LOAD_MISFITS):
                raise
            raise ToolkitError(
                f"Checkpoint {ckpt} does not fit this run's model ({str(e).strip().splitlines()[0][:160]}): it was "
                "written for other parameters (model, lora or trainable settings). Resume with the recipe it was "
                f"written with, or start a new output_dir from its weights (toolkit export {ckpt} --merge).") from None
        # accelerate read the custom state again by its name (weights-only, above; its load_state cannot be told
        # to skip it): it is put back from the bytes checked against the commit-time digest, read before.
        scheduler.load_state_dict(scheduler_state)
        if (strategy, accelerator.mixed_precision) in EXACT_RESUME_TESTED:
            return Restored("exact")
        return Restored(f"same layout: every state restored, but bit-exact resume is tested for "
                        f"{EXACT_RESUME_SCOPE} only, not {strategy} in {accelerator.mixed_precision}")
    lost = load_portable_lora(accelerator, model, optimizer, ckpt)
    scheduler.load_state_dict(scheduler_state)
    # load_state_dict restores the position, not the optimizer's lr: that was set by the step before the save.
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    reseed_for_layout(seed, meta["step"], accelerator.process_index)
    if accelerator.mixed_precision == "fp16":
        lost.append("fp16 loss scale reset")
    before, after = layout_name(meta["strategy"], meta["world_size"]), layout_name(strategy, accelerator.num_processes)
    notes = [f"{before} -> {after}", "RNG reseeded per rank from the step", *lost]
    return Restored(f"portable ({'; '.join(notes)})", tuple(lost))
