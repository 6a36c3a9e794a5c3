"""Reading and comparing the portable LoRA state of checkpoints (`portable/lora_state.safetensors`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import CURRICULUM_STEPS
from toolkit.checkpoint.portable import portable_lora_file
from toolkit.runtime.run_dir import checkpoint_dir

PORTABLE_STEPS = tuple(range(1, CURRICULUM_STEPS + 1))  # every checkpoint of conftest.curriculum_runs


def portable_state(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(portable_lora_file(checkpoint_dir(out / "checkpoints", step)))


def adam_steps(out: Path, step: int) -> dict[str, int]:
    with safe_open(portable_lora_file(checkpoint_dir(out / "checkpoints", step)), "pt") as f:
        return json.loads(f.metadata()["adam_steps"])


def check_portable_files(out: Path, reference: Path, layout: str, steps: tuple[int, ...] = PORTABLE_STEPS) -> None:
    """The portable state a layout writes is the reference run's for the same training: the same entries (every
    trainable parameter's weight and Adam moments), the same Adam step counts, and tensors equal within fp32
    reduction-order noise. Measured across ddp, zero3 and one process: at most 4e-6 of a tensor's largest value
    (LoRA B and the moments: small, and fed by gradients summed in another order); 1e-4 allows 25x that, while a
    lost moment, a shard in the wrong place or a wrong Adam step count (it scales the updates) is off by a large
    fraction of it."""
    for step in steps:
        got, ref = portable_state(out, step), portable_state(reference, step)
        assert got.keys() == ref.keys(), f"{layout} step {step}: {sorted(got.keys() ^ ref.keys())[:4]}"
        assert adam_steps(out, step) == adam_steps(reference, step), f"{layout} step {step}"
        off = {k: float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)) for k in ref}
        worst = max(off, key=off.__getitem__)
        assert off[worst] <= 1e-4, f"{layout} step {step}: {worst} off by {off[worst]:.1e} of its largest value"
