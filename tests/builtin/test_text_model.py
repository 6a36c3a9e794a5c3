"""Tests for the tiny offline Qwen3 model and its locally trained tokenizer (Qwen3's stock chat template)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from toolkit.builtin.text_model import TEMPLATE_TOKENS, build_tokenizer, write_tiny_qwen3
from toolkit.templates import CHATML_TEMPLATE, stock_template

MESSAGES = [
    {"role": "system", "content": "You are a helpful math tutor."},
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "17 + 25 = 42."},
]
EXPECTED_CHATML = (
    "<|im_start|>system\nYou are a helpful math tutor.<|im_end|>\n"
    "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n"
    "<|im_start|>assistant\n17 + 25 = 42.<|im_end|>\n"
)
# Qwen3's rendering: the last answer gets an empty think block (its non-thinking format).
EXPECTED_QWEN3 = EXPECTED_CHATML.replace("assistant\n", "assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny"))


def test_tokenizer_is_deterministic(tokenizer: PreTrainedTokenizerFast) -> None:
    other = build_tokenizer()
    assert other.get_vocab() == tokenizer.get_vocab()
    assert other.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert 900 <= len(tokenizer) <= 1100


def test_special_tokens_are_single_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
        ids = tokenizer.encode(f"ab{token}cd", add_special_tokens=False)
        assert ids.count(token_id) == 1
    assert tokenizer.padding_side == "right"
    assert tokenizer.model_max_length >= 32768


def test_any_text_round_trips(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "Zürich 😀 naïve — ∑x² \t{'k': [1, 2]}\n\n  end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None


def test_offsets_map_back_to_text(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "What is 17 + 25?\n  def add(a, b):\n    return a + b<|im_end|> done"
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = enc["offset_mapping"]
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    for (_, end), (start, _) in itertools.pairwise(offsets):
        assert end == start  # contiguous, no trimmed whitespace
    assert "".join(text[s:e] for s, e in offsets) == text
    for token_id, (start, end) in zip(enc["input_ids"], offsets, strict=True):
        assert tokenizer.decode([token_id]) == text[start:end]


def test_chat_template_is_qwen3s(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.chat_template == stock_template("qwen3")
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == EXPECTED_QWEN3
    prompt = tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == EXPECTED_CHATML.rsplit("17 + 25 = 42.", 1)[0]
    assert prompt.endswith("<|im_start|>assistant\n")


def test_template_tokens_are_qwens_added_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    """The tokens Qwen's templates render are single, non-special ids (decoding keeps them, as Qwen's tokenizer
    does) after the 1000 BPE entries; the model's vocabulary stays 1024 rows."""
    assert TEMPLATE_TOKENS == ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                               "</think>"]
    ids = [tokenizer.convert_tokens_to_ids(t) for t in TEMPLATE_TOKENS]
    assert ids == list(range(1000, 1006)) and len(tokenizer) == 1006
    text = "<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><tool_response>5</tool_response>"
    assert [i for i in tokenizer.encode(text) if i >= 1000] == [1004, 1005, 1000, 1001, 1002, 1003]
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_assistant_mask_covers_content_and_im_end() -> None:
    """The ChatML template's {% generation %} markers (data.chat_template: chatml) mark each answer and its end."""
    tokenizer = build_tokenizer(CHATML_TEMPLATE)
    out = tokenizer.apply_chat_template(MESSAGES, return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    assert tokenizer.decode(ids) == EXPECTED_CHATML
    masked = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tokenizer.decode(masked) == "17 + 25 = 42.<|im_end|>"
    first = mask.index(1)
    assert all(mask[first : first + len(masked)])  # one contiguous span
    assert mask[-1] == 0  # trailing newline is not trained on


def test_write_and_load(model_dir: Path) -> None:
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / "README.md").is_file()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert len(model.model.layers) == 2
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.dtype == torch.float32 and model.config.vocab_size == 1024
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == EXPECTED_QWEN3

    batch = tokenizer(["What is 2 + 3?", "2 + 3 = 5."], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        loss = model(**batch, labels=labels).loss
    assert math.isfinite(loss.item())
    # A random model should be close to uniform over the vocabulary.
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 1.0


def test_same_seed_gives_identical_weights(model_dir: Path, tmp_path: Path) -> None:
    same = load_file(write_tiny_qwen3(tmp_path / "same") / "model.safetensors")
    ref = load_file(model_dir / "model.safetensors")
    assert same.keys() == ref.keys()
    assert all(torch.equal(same[k], ref[k]) for k in ref)
    other = load_file(write_tiny_qwen3(tmp_path / "other", seed=1) / "model.safetensors")
    assert not all(torch.equal(other[k], ref[k]) for k in ref)
