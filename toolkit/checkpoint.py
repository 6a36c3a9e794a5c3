"""Saving models: the final adapter (or full model) gathered correctly under every strategy, written atomically."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from toolkit.errors import ToolkitError


def save_final(accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
               out_dir: Path) -> Path:
    """Write the PEFT adapter (or full model) and tokenizer to `out_dir`. Every rank must call this.

    `get_state_dict` gathers ZeRO-3 partitions (16-bit gather on save) and FSDP shards into full tensors;
    saving the unwrapped model's own state dict instead is what leaves peers with empty `[0]` adapters.
    The directory is written under a temporary name and renamed, so a crash never leaves a half-written model.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        empty = [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.numel() == 0]
        if empty:
            raise ToolkitError(f"Refusing to save {out_dir}: gathered tensors are empty ({empty[:3]}...). "
                               "With ZeRO-3 set stage3_gather_16bit_weights_on_model_save: true.")
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            old = out_dir.with_name(out_dir.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir
