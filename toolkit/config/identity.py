"""What binds a checkpoint (and a run folder) to its recipe: the settings whose change alters what the
remaining steps compute."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from toolkit.config.schema import Recipe

RESUME_INVARIANT_SECTIONS = ("model", "lora", "data", "stages", "optimizer", "schedule")
"""Sections whose change alters what the remaining steps compute; resume refuses a change (unless forced)."""


def resume_invariants(recipe: Recipe) -> dict[str, Any]:
    """The settings a checkpoint is bound to. Batch split (micro x accum x processes, also per stage) is checked
    separately through the global batches, so a run may resume on another number of GPUs with the same ones."""
    tree = recipe.model_dump(mode="json", include=set(RESUME_INVARIANT_SECTIONS))
    for stage in tree["stages"]:
        if stage["micro_batch_size"] is not None:  # kept when unset, so hashes of earlier checkpoints still match
            del stage["micro_batch_size"]
        if stage["objective"] == "sft" and stage["preference"] is None:  # the default: earlier hashes as they were
            del stage["objective"], stage["preference"]
        for key in ("difficulty", "drop", "rl", "rewards", "video"):  # bound when set; unset, hashes as they were
            if stage.get(key) is None:
                stage.pop(key, None)
        if stage.get("difficulty") is not None:
            # A scorer's consent to run its own code changes which code may run, not what trains (its weights and
            # config are hashed into the scores' key): never bound, so earlier hashes stay as they were.
            stage["difficulty"].pop("trust_remote_code", None)
            for key in ("model", "samples"):  # by length / field: as before these keys existed
                if stage["difficulty"].get(key) is None:
                    stage["difficulty"].pop(key, None)
        for entry in stage["data"]:  # unset new entry keys leave earlier checkpoints' hashes as they were
            for key in ("split", "columns", "tags", "dataset", "dataset_dir", "ignore", "threads", "video"):
                if isinstance(entry, dict) and entry.get(key) is None:
                    entry.pop(key, None)
    for key in ("num_proc", "num_workers", "renderer", "image_cache", "image_cache_gb"):  # how data is prepared
        # and fed, not what trains (the direct renderer writes the Jinja template's text byte for byte:
        # tests/data/test_render.py; cached images are the processor's pixels bit for bit:
        # tests/data/test_image_cache.py)
        del tree["data"][key]
    for key, default in (("empty_answers", "error"), ("identical_pairs", "error"), ("completion_newline", False)):
        if tree["data"].get(key) == default:  # the default leaves earlier checkpoints' hashes as they were
            del tree["data"][key]
    if tree["data"].get("video") is None:  # bound when set (the frames trained on); unset, hashes as they were
        tree["data"].pop("video", None)
    for key in ("loss_head", "loss_chunk_size"):  # exact either way: a resume may switch; older hashes match
        del tree["model"][key]
    if tree["lora"]["fused"] != "on":  # auto and off run PEFT's layers: earlier checkpoints' hashes as they were;
        del tree["lora"]["fused"]  # on's grouped q/k/v and gate/up round their sums otherwise (1e-6 in fp32)
    if tree["model"]["fused_layers"] == "auto":  # the default leaves earlier checkpoints' hashes as they were
        del tree["model"]["fused_layers"]
    tree["seed"] = recipe.train.seed
    if recipe.train.trainable is not None:  # only when set, so checkpoints of earlier versions still resume
        tree["trainable"] = recipe.train.trainable
    if any(stage.advance_when for stage in recipe.stages):  # gates decide stage lengths from these evals
        tree["gate_evals"] = recipe.eval.model_dump(mode="json", exclude={"micro_batch_size"})
    return tree


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two recipe trees (e.g. two `resume_invariants`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [k for key in sorted(set(old) | set(new), key=str)
                for k in changed_keys(old.get(key), new.get(key), f"{prefix}{key}.")]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [k for i, (a, b) in enumerate(zip(old, new, strict=True)) for k in changed_keys(a, b, f"{prefix}{i}.")]
    return [] if old == new else [prefix.rstrip(".") or "(all)"]


def recipe_hash(settings: dict[str, Any]) -> str:
    """Hash of the recipe settings that must not change on resume (they change what the steps compute)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
