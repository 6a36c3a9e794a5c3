"""final/: the gathered adapter (or full model) with tokenizer, processor and model card, written aside and renamed in,
with the checksums that let a reader verify it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from toolkit.atomic import build_dir, write_text_atomic
from toolkit.checkpoint.manager import changed_files, file_digests, log
from toolkit.checkpoint.model_card import MODEL_CARD
from toolkit.errors import ToolkitError
from toolkit.runtime import process as distributed

FINAL_CHECKSUMS = "checksums.json"
"""In final/: the size and sha256 of every file training saved there, as a checkpoint's meta.json records its own."""


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
