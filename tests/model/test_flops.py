"""Tests for the model-FLOPs count, the peak table and MFU."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from toolkit.model.flops import (
    PEAK_TFLOPS,
    attention_flops_per_token,
    batch_train_flops,
    mfu,
    peak_flops,
    train_flops_per_token,
)
from toolkit.model.memory import load_model_config
from toolkit.model.params import count_params


@pytest.fixture
def small() -> Qwen3Config:
    return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=False)


def test_hand_count(small: Qwen3Config) -> None:
    # q: 64x(4*16) = 4096, k and v: 64x(2*16) = 2048 each, o: (4*16)x64 = 4096
    attention = 4096 + 2048 + 2048 + 4096
    mlp = 3 * 64 * 128  # gate, up, down = 24576
    counts = count_params(small)
    assert counts["attention_per_layer"] == attention == 12288
    assert counts["mlp_per_layer"] == mlp == 24576
    assert counts["per_layer"] == 36864
    assert counts["layers"] == 73728
    assert counts["lm_head"] == counts["embeddings"] == 65536
    assert counts["matmul"] == 139264  # N = 2 * 36864 + 65536, embeddings excluded
    assert counts["total"] == 204800
    assert train_flops_per_token(small, lora=False) == 6 * 139264 == 835584
    assert train_flops_per_token(small, lora=True) == 4 * 139264 == 557056
    # attention at s = 128: 3 * L * (2 * 2 * s * a*d / 2) = 3 * 2 * 16384 = 98304
    assert attention_flops_per_token(small, 128) == 98304
    assert train_flops_per_token(small, lora=False, seq_len=128) == 835584 + 98304


def test_tied_head_still_costs_a_matmul(small: Qwen3Config) -> None:
    small.tie_word_embeddings = True
    counts = count_params(small)
    assert counts["matmul"] == 139264
    assert counts["total"] == 204800 - 65536


def test_lora_is_two_thirds_of_full_for_the_dense_part(small: Qwen3Config) -> None:
    full, lora = train_flops_per_token(small, lora=False), train_flops_per_token(small, lora=True)
    assert lora / full == pytest.approx(2 / 3)
    # The attention term has both gradients either way, so it is the same with LoRA.
    assert (train_flops_per_token(small, lora=True, seq_len=512) - lora
            == train_flops_per_token(small, lora=False, seq_len=512) - full)


def test_attention_term_scales_with_seq_len(small: Qwen3Config) -> None:
    a1, a2 = attention_flops_per_token(small, 1000), attention_flops_per_token(small, 2000)
    assert a2 == 2 * a1
    assert train_flops_per_token(small, lora=False, seq_len=None) == train_flops_per_token(small, lora=False)


def test_batch_flops_use_each_samples_own_length(small: Qwen3Config) -> None:
    dense = 6 * 139264
    per_layer_att = 6 * 2 * 64  # 6 * L * a*d, times s per token
    expected = sum(n * (dense + per_layer_att * n) for n in (10, 100, 37))
    assert batch_train_flops(small, [10, 100, 37], lora=False) == expected
    # Padding to the longest sample would count more: the real lengths are what is summed.
    assert batch_train_flops(small, [100, 100, 100], lora=False) > expected
    assert batch_train_flops(small, [], lora=True) == 0


def test_qwen3_8b_matches_published_size() -> None:
    counts = count_params(load_model_config("Qwen/Qwen3-8B"))
    assert counts["layers"] == 36 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288)
    assert counts["layers"] == pytest.approx(6.95e9, rel=0.01)  # published non-embedding size
    assert counts["matmul"] == pytest.approx(7.57e9, rel=0.01)
    assert counts["total"] == pytest.approx(8.2e9, rel=0.02)  # published total, embeddings included


def test_peak_lookup_and_override() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA A10G") == PEAK_TFLOPS["A10G"] * 1e12
    assert peak_flops("NVIDIA L40S") == 362e12
    assert peak_flops("NVIDIA L40") == 181e12
    assert peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert peak_flops(None) is None
    assert peak_flops("cpu") is None
    assert peak_flops("cpu", override_tflops=1.5) == 1.5e12
    assert peak_flops("NVIDIA H100 80GB HBM3", override_tflops=500) == 500e12


def test_mfu_arithmetic() -> None:
    # 4 devices at 100 TFLOP/s for 2 s can do 8e14 FLOPs; 2e14 done is 25 %.
    assert mfu(2e14, 2.0, 4, 100e12) == pytest.approx(0.25)
    assert mfu(2e14, 2.0, 4, None) is None
    assert mfu(2e14, 0.0, 4, 100e12) is None


def test_h200_nvl_is_not_the_sxm_peak() -> None:
    assert peak_flops("NVIDIA H200 NVL") == 835.0e12 and peak_flops("NVIDIA H200") == 989.0e12
    assert PEAK_TFLOPS["H200 NVL"] < PEAK_TFLOPS["H200"]


def test_lm_head_charged_only_for_tokens_with_logits(small: Qwen3Config) -> None:
    """The chunked / Liger heads compute logits for label tokens only: the head's matmul is charged for those."""
    lengths = [100, 28]
    every = batch_train_flops(small, lengths, lora=True)
    assert every == sum(n * train_flops_per_token(small, lora=True, seq_len=n) for n in lengths)  # the default
    labelled = batch_train_flops(small, lengths, lora=True, head_tokens=40)
    assert every - labelled == (128 - 40) * 4 * count_params(small)["lm_head"]
    full = batch_train_flops(small, lengths, lora=False, head_tokens=40)
    assert full - batch_train_flops(small, lengths, lora=False, head_tokens=0) == 40 * 6 * 65536
