"""Activation memory: what autograd really saves for backward, counted with saved_tensors_hooks
(tests/helpers/saved.py).

* A bf16 base with fp32 LoRA adapters, built as training builds it (under the autocast of a bf16 launch), saves at
  most 0.6x the bytes per token of the fp32 run of the same recipe: PEFT's per-layer fp32 input copies are gone.
* `toolkit.model.memory.activation_memory` (what `toolkit preflight` prints) is within 15% of the counted bytes at 1k,
4k
  and 16k tokens, with and without gradient checkpointing, in fp32, bf16 under autocast and bf16 without it.
  The loss head's working set (recomputed chunk by chunk in backward, never saved) is left out of both sides:
  bench/loss_head_memory.py measures it (tests/model/test_memory.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tests.helpers.saved import SavedBytes, count_saved
from toolkit.builtin.models import materialize_builtin
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.packing import PackedCollator
from toolkit.errors import ToolkitError
from toolkit.model.load import apply_lora, enable_gradient_checkpointing, skip_adapter_input_casts
from toolkit.model.loss_head import install_loss_head
from toolkit.model.memory import activation_memory, loss_bytes
from toolkit.train import setup

SAMPLE = 512  # tokens per packed sample


def packed(tokens: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = [3 + t % (vocab - 3) for t in range(SAMPLE)]
    labels = [-100] * (SAMPLE - 8) + ids[-8:]  # a few label tokens: the loss head's share stays small
    return PackedCollator()([{"input_ids": ids, "labels": labels}] * (tokens // SAMPLE))


def autocast(mixed_precision: str) -> contextlib.AbstractContextManager:
    """The context accelerate runs a single-process / DDP forward in (on the CPU: torch.autocast to bf16)."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if mixed_precision == "bf16" else contextlib.nullcontext()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.get_base_model().model.layers)


def per_token(model: torch.nn.Module, mixed_precision: str, vocab: int) -> float:
    """Bytes saved per token: the slope between two row lengths (constants such as weight casts drop out)."""
    held = []
    for tokens in (2 * SAMPLE, 4 * SAMPLE):
        with autocast(mixed_precision):
            held.append(count_saved(model, packed(tokens, vocab), decoder_layers(model)).held_bytes())
    return (held[1] - held[0]) / (2 * SAMPLE)


def test_bf16_base_lora_saves_at_most_0_6x_of_fp32(tmp_path: Path) -> None:
    """The smoke recipe's model as toolkit.train.setup.build_model makes it: fp32 base in an fp32 launch against a bf16
    base in a bf16 launch (the shipped configs' mixed precision, accelerate's autocast)."""
    model_path = materialize_builtin("builtin:tiny-qwen3", tmp_path / ".toolkit-cache")
    vocab = AutoModelForCausalLM.from_pretrained(model_path).config.vocab_size
    counted = {}
    for dtype, mixed in (("float32", "no"), ("bfloat16", "bf16"), ("bfloat16-cast", "bf16")):
        recipe = load_recipe("recipes/smoke.yaml", [f"model.dtype={dtype.removesuffix('-cast')}",
                                                    f"output_dir={tmp_path / 'run'}"])
        torch.manual_seed(0)
        model, _ = setup.build_model(recipe, resolve_stages(recipe), model_path, vision=False, mixed_precision=mixed)
        if dtype.endswith("-cast"):  # what PEFT does by default: every adapted layer casts its input to fp32
            for m in model.modules():
                if hasattr(m, "cast_input_dtype_enabled"):
                    m.cast_input_dtype_enabled = True
        counted[dtype] = per_token(model.train(), mixed, vocab)
    print(counted)
    assert counted["bfloat16"] <= 0.6 * counted["float32"], counted
    assert counted["bfloat16-cast"] > 0.6 * counted["float32"], counted  # the fix is what brings it under


# A small Qwen3 with the flagship's proportions (GQA 2:1, MLP 3x hidden), all-linear LoRA.
CONFIG = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                     use_cache=False)
# (name, base dtype, launch mixed precision, activation bytes, residual bytes, PEFT's fp32 input copies)
PRECISIONS = [("fp32", torch.float32, "no", 4, 4, False), ("bf16 autocast", torch.bfloat16, "bf16", 2, 2, False),
              ("bf16 without autocast", torch.bfloat16, "no", 2, 2, True)]


def lora_model(dtype: torch.dtype, mixed: str, *, checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG, dtype=dtype, attn_implementation="sdpa_packed")
    if checkpointing:
        enable_gradient_checkpointing(model)
    model = apply_lora(model, r=8, alpha=16, dropout=0.0, target_modules="all-linear", modules_to_save=[])
    if mixed != "no":
        skip_adapter_input_casts(model)
    install_loss_head(model, "chunked")
    return model.train()


@pytest.mark.parametrize("precision", PRECISIONS, ids=[p[0] for p in PRECISIONS])
def test_preflight_activations_match_saved_bytes(precision: tuple) -> None:
    _, dtype, mixed, act_bytes, res_bytes, copies = precision
    plain, ckpt = (lora_model(dtype, mixed, checkpointing=c) for c in (False, True))
    for tokens in (1024, 4096, 16384):
        batch = packed(tokens, CONFIG.vocab_size)
        with autocast(mixed):
            full: SavedBytes = count_saved(plain, batch, decoder_layers(plain))
            kept = count_saved(ckpt, batch, decoder_layers(ckpt), checkpointed=True)
        for checkpointing, counted in ((False, full.held_bytes()), (True, kept.held_bytes(max(full.layers)))):
            estimate = activation_memory(CONFIG, tokens=tokens, grad_ckpt=checkpointing, activation_bytes=act_bytes,
                                         residual_bytes=res_bytes, adapter_input_copies=copies)
            estimate -= loss_bytes(CONFIG, tokens=tokens, activation_bytes=act_bytes)
            assert estimate == pytest.approx(counted, rel=0.15), (tokens, checkpointing, estimate, counted)


def test_partial_checkpointing_keeps_what_preflight_counts() -> None:
    """`model.gradient_checkpointing: 1` of 2 layers: the first layer keeps only its input, the second everything:
    fewer bytes than without checkpointing, within 15% of preflight's estimate."""
    plain = lora_model(torch.float32, "no", checkpointing=False)
    torch.manual_seed(0)
    partial = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32, attn_implementation="sdpa_packed")
    assert enable_gradient_checkpointing(partial, 1) == 1
    partial = apply_lora(partial, r=8, alpha=16, dropout=0.0, target_modules="all-linear", modules_to_save=[])
    install_loss_head(partial, "chunked")
    full_ckpt = lora_model(torch.float32, "no", checkpointing=True)
    batch = packed(4096, CONFIG.vocab_size)
    none = count_saved(plain, batch, decoder_layers(plain))
    one = count_saved(partial.train(), batch, decoder_layers(partial), checkpointed=True)
    both = count_saved(full_ckpt, batch, decoder_layers(full_ckpt), checkpointed=True)
    # the first layer is recomputed only once the second's activations are freed: no extra layer at the peak
    held = [none.held_bytes(), one.held_bytes(), both.held_bytes(max(none.layers))]
    assert held[0] > held[1] and held[2] < held[0], held
    estimate = activation_memory(CONFIG, tokens=4096, grad_ckpt=1, activation_bytes=4) - loss_bytes(
        CONFIG, tokens=4096, activation_bytes=4)
    assert estimate == pytest.approx(held[1], rel=0.15), (estimate, held)


def test_more_checkpointed_layers_than_the_model_has_is_refused() -> None:
    model = AutoModelForCausalLM.from_config(CONFIG)
    with pytest.raises(ToolkitError, match=r"model\.gradient_checkpointing is 3 but the model has 2 decoder layers"):
        enable_gradient_checkpointing(model, 3)
