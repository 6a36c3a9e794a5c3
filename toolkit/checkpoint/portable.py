"""The portable LoRA state: adapter weights and Adam moments in one strategy-free safetensors file per checkpoint, so a
run resumes under another strategy or number of processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.errors import ToolkitError
from toolkit.strategies import param_state


def portable_lora_file(ckpt: Path) -> Path:
    """The strategy-free LoRA state of a checkpoint (adapter weights and Adam moments; `checkpoint.portable`)."""
    return ckpt / "portable" / "lora_state.safetensors"


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
