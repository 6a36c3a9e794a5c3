"""What reaches the attention kernels for a packed row (toolkit/model/attention.py), checked on CPU by spying on them.

* sdpa_packed: every call of `torch.nn.functional.scaled_dot_product_attention` is one sample span, causal, with no
  mask and the key/value heads not repeated (enable_gqa); no tensor anywhere in forward or backward has T x T
  trailing dims (the stock sdpa path, checked alongside, builds exactly such a mask).
* a flash kernel (a fake one registered through transformers' AttentionInterface, with transformers' flash mask)
  gets the collator's boundaries, `cu_seq_lens_q/k` and int `max_length_q/k`, after the loop's device move.
* the varlen branch (CUDA only) gets [T, heads, d] tensors, int32 offsets, int lengths, causal window, enable_gqa;
  fa4_packed's (FlashAttention-4, stood in for) the same in FA4's names, its key/value heads not repeated.
* `choose_attention`: auto takes the fastest kernel that runs; one that cannot run here is refused in one line.
* the loss and gradients of a packed batch equal the padded batch's (tests/data/test_packing.py, every kernel).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from toolkit.builtin.text_model import write_tiny_qwen3
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.packing import PackedCollator, flash_boundaries
from toolkit.errors import ToolkitError
from toolkit.model import attention
from toolkit.model.attention import EAGER_PACKED, FA4_PACKED, SDPA_PACKED, check_packing_support, choose_attention
from toolkit.model.load import enable_gradient_checkpointing
from toolkit.train.loop import to_device

LENGTHS = (7, 12, 5, 9)  # one packed row of 33 tokens
HEADS, KV_HEADS = 4, 2  # the tiny Qwen3: grouped-query attention
FAKE_FLASH = "toolkit_test_fake_varlen"  # a name with "flash" in it would send transformers to the hub for a kernel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_attention"))


def load(model_dir: Path, attn: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    if attn != FAKE_FLASH:
        check_packing_support(model)
    return model.train()


def packed_batch(seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    samples = [{"input_ids": [rng.randrange(3, 900) for _ in range(n)],
                "labels": [IGNORE_INDEX] + [rng.randrange(3, 900) for _ in range(n - 1)]} for n in LENGTHS]
    return PackedCollator()(samples)


class SdpaSpy:
    """Records what each scaled_dot_product_attention call receives."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, **kw: Any) -> torch.Tensor:
            self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "mask": None if attn_mask is None else
                               tuple(attn_mask.shape), "is_causal": is_causal, "enable_gqa": kw.get("enable_gqa")})
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


class SquareTensors(TorchDispatchMode):
    """Every tensor an op produces whose last two dims are T x T (an attention mask or score matrix of the row)."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens, self.found = tokens, []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-2:] == (self.tokens, self.tokens):
                self.found.append((str(func), tuple(t.shape)))
        return out


def train_step(model: PreTrainedModel, batch: dict[str, Any]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def test_sdpa_packed_calls_sdpa_per_span_without_any_t_by_t_tensor(model_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    batch, tokens = packed_batch(), sum(LENGTHS)
    spy = SdpaSpy(monkeypatch)
    model = load(model_dir, SDPA_PACKED)
    enable_gradient_checkpointing(model)
    with SquareTensors(tokens) as square:
        train_step(model, batch)
    assert not square.found, square.found[:5]
    layers = model.config.num_hidden_layers
    assert len(spy.calls) == 2 * layers * len(LENGTHS)  # forward and checkpoint recompute, per layer, per sample
    assert sorted({c["q"][2] for c in spy.calls}) == sorted(LENGTHS)  # the boundaries arrived: one call per span
    for call in spy.calls:
        assert call["mask"] is None and call["is_causal"] and call["enable_gqa"]
        assert call["q"][1] == HEADS and call["k"][1] == KV_HEADS  # GQA not expanded by hand

    # The stock sdpa path on the same row: a T x T mask, key/value heads repeated, no causal flag.
    spy.calls.clear()
    with SquareTensors(tokens) as square:
        train_step(load(model_dir, "sdpa"), batch)
    assert square.found and all(c["mask"] == (1, 1, tokens, tokens) for c in spy.calls)
    assert all(c["k"][1] == HEADS and not c["is_causal"] for c in spy.calls)


def test_sdpa_packed_finds_the_spans_without_collator_boundaries(model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed row with position_ids only (built elsewhere) is split the same way, and gives the same loss."""
    batch = packed_batch()
    bare = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    model = load(model_dir, SDPA_PACKED)
    spy = SdpaSpy(monkeypatch)
    loss_bare = train_step(model, bare)
    assert sorted(c["q"][2] for c in spy.calls) == sorted(LENGTHS * model.config.num_hidden_layers)
    torch.testing.assert_close(train_step(model, batch), loss_bare, rtol=0, atol=0)


def test_eager_packed_spans_match_stock_eager(model_dir: Path) -> None:
    batch = packed_batch()
    model = load(model_dir, EAGER_PACKED)
    with SquareTensors(sum(LENGTHS)) as square:
        loss = train_step(model, batch)
    assert not square.found
    torch.testing.assert_close(loss, train_step(load(model_dir, "eager"), batch), rtol=1e-6, atol=1e-6)




def test_flash_kernel_receives_the_collators_boundaries(model_dir: Path) -> None:
    """A flash kernel registered through AttentionInterface (with transformers' flash mask) is handed the
    collator's varlen boundaries: cu_seq_lens on the device, max lengths as ints, no mask."""
    seen: list[dict[str, Any]] = []

    def fake_flash(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        seen.append({"mask": attention_mask, **{k: kwargs.get(k) for k in attention.BOUNDARY_KEYS}})
        cu = kwargs["cu_seq_lens_q"]  # an exact varlen kernel: causal attention within each span
        outs = [torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, enable_gqa=True).transpose(1, 2)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
        return torch.cat(outs, dim=1), None

    AttentionInterface.register(FAKE_FLASH, fake_flash)
    AttentionMaskInterface.register(FAKE_FLASH, flash_attention_mask)
    batch = to_device(packed_batch(), torch.device("cpu"))  # the loop's move: ints stay ints
    loss = train_step(load(model_dir, FAKE_FLASH), batch)
    offsets = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    assert len(seen) == load(model_dir, FAKE_FLASH).config.num_hidden_layers
    for call in seen:
        assert call["mask"] is None
        assert call["cu_seq_lens_q"].tolist() == call["cu_seq_lens_k"].tolist() == offsets
        assert call["cu_seq_lens_q"].dtype == torch.int32
        assert type(call["max_length_q"]) is int and call["max_length_q"] == call["max_length_k"] == max(LENGTHS)
    torch.testing.assert_close(loss, train_step(load(model_dir, SDPA_PACKED), batch), rtol=1e-6, atol=1e-6)


def per_span_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, **sdpa: Any
                  ) -> torch.Tensor:
    """An exact CPU stand-in for torch's varlen kernel: sdpa on each span of `[T, heads, d]` tensors."""
    spans = zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), **sdpa).transpose(0, 1)
        for a, b in spans])


def loss_with_varlen_equals_per_span(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                     varlen: Callable[..., torch.Tensor]) -> Any:
    """The packed batch's loss through sdpa_packed's varlen branch (`varlen` standing in for torch's kernel)
    equals the per-span sdpa one; returns the model."""
    batch = packed_batch()
    model = load(model_dir, SDPA_PACKED)
    expected = train_step(model, batch)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen)
    monkeypatch.setattr(attention, "varlen_runs", lambda query, dropout: True)
    torch.testing.assert_close(train_step(model, batch), expected, rtol=1e-6, atol=1e-6)
    return model


def test_varlen_branch_gets_flash_layout(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA in 16-bit sdpa_packed calls torch's varlen kernel; here it is replaced by an exact CPU stand-in that
    records its arguments, and the loss must equal the per-span sdpa one."""
    calls: list[dict[str, Any]] = []

    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, *, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
               enable_gqa: bool = False) -> torch.Tensor:
        calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "cu": cu_q, "max": (max_q, max_k),
                      "window": window_size, "gqa": enable_gqa, "same": cu_k is cu_q})
        return per_span_sdpa(q, k, v, cu_q, scale=scale, is_causal=True, enable_gqa=enable_gqa)

    model = loss_with_varlen_equals_per_span(model_dir, monkeypatch, varlen)
    tokens, head_dim = sum(LENGTHS), model.config.head_dim
    assert len(calls) == model.config.num_hidden_layers
    for call in calls:
        assert call["q"] == (tokens, HEADS, head_dim) and call["k"] == (tokens, KV_HEADS, head_dim)
        assert call["cu"].dtype == torch.int32 and call["same"] and call["max"] == (max(LENGTHS), max(LENGTHS))
        assert call["window"] == (-1, 0) and call["gqa"]


def test_varlen_of_torch_2_10_gets_causal_and_repeated_heads(model_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """torch 2.10's varlen_attn had `is_causal` and neither `window_size` nor `enable_gqa`: sdpa_packed asks it for
    causal attention that way and repeats the key/value heads itself, with the same loss."""
    calls: list[dict[str, Any]] = []

    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, *, is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
        calls.append({"k": tuple(k.shape), "causal": is_causal})
        return per_span_sdpa(q, k, v, cu_q, scale=scale, is_causal=is_causal)  # no GQA: fails on unequal heads

    model = loss_with_varlen_equals_per_span(model_dir, monkeypatch, varlen)
    assert len(calls) == model.config.num_hidden_layers
    assert all(c["causal"] and c["k"] == (sum(LENGTHS), HEADS, model.config.head_dim) for c in calls)


def test_flash_boundaries() -> None:
    got = flash_boundaries(torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]]))
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 4, 8] and got["cu_seq_lens_k"] is got["cu_seq_lens_q"]
    assert got["max_length_q"] == got["max_length_k"] == 4 and type(got["max_length_q"]) is int
    with pytest.raises(ValueError, match="start at 0"):
        flash_boundaries(torch.tensor([[1, 2, 0]]))


def installed(monkeypatch: pytest.MonkeyPatch, *distributions: str) -> None:
    monkeypatch.setattr(attention, "_installed", lambda name: name in distributions)


def gpu(monkeypatch: pytest.MonkeyPatch, major: int, name: str = "NVIDIA H100 80GB HBM3") -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_auto_takes_the_best_exact_kernel(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """FlashAttention-4 > flash-attn 2 > torch's varlen (sdpa_packed on CUDA) > sdpa per span, each where it runs."""
    installed(monkeypatch)
    with caplog.at_level(logging.INFO, logger="toolkit.model.attention"):
        assert choose_attention("auto") == SDPA_PACKED  # no flash-attn, no CUDA here
    assert "attention: sdpa_packed (packed rows: sdpa per sample, no T x T mask)" in caplog.text
    assert choose_attention("sdpa") == SDPA_PACKED and choose_attention("eager") == EAGER_PACKED
    installed(monkeypatch, "flash-attn", "flash-attn-4")
    assert choose_attention("auto") == SDPA_PACKED  # flash-attn and FA4 without CUDA: not usable
    gpu(monkeypatch, 8, "NVIDIA A100-SXM4-80GB")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="toolkit.model.attention"):
        assert choose_attention("auto") == "flash_attention_2"  # FA4 is not for sm80
    assert "FlashAttention-4 is installed but not used: FlashAttention-4 runs on sm90 (Hopper) and sm100 " \
           "(Blackwell) GPUs; NVIDIA A100-SXM4-80GB is sm80" in caplog.text
    monkeypatch.setattr(attention, "_fa4_varlen", lambda: per_span_sdpa)  # the package's import, stood in for
    for major in (9, 10):
        gpu(monkeypatch, major)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="toolkit.model.attention"):
            assert choose_attention("auto") == choose_attention("flash4") == FA4_PACKED
        assert "attention: fa4_packed (packed rows: FlashAttention-4 varlen in 16-bit" in caplog.text
    installed(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="toolkit.model.attention"):
        assert choose_attention("auto") == SDPA_PACKED
    assert "PyTorch varlen flash in 16-bit" in caplog.text and "FlashAttention-4" not in caplog.text


@pytest.mark.parametrize(("requested", "machine", "message"), [
    ("flash4", "cpu", "model.attn_implementation is flash4 but flash-attn-4 is not installed: pip install "
                      "'curriculum-toolkit[flash4]' (sm90 / sm100 GPUs); or use auto or sdpa."),
    ("flash4", "cpu+fa4", "model.attn_implementation is flash4 but FlashAttention-4 needs a CUDA GPU (sm90 Hopper or "
                          "sm100 Blackwell) and there is none; or use auto or sdpa."),
    ("flash4", "sm80+fa4", "model.attn_implementation is flash4 but FlashAttention-4 runs on sm90 (Hopper) and sm100 "
                           "(Blackwell) GPUs; NVIDIA A100 is sm80; or use auto or sdpa."),
    ("flash4", "sm90+broken-fa4", "model.attn_implementation is flash4 but flash-attn-4 is installed but does not "
                                  "import (No module named 'cutlass'); reinstall it; or use auto or sdpa."),
    ("flash_attention_2", "cpu", "model.attn_implementation is flash_attention_2 but flash-attn is not installed"),
    ("flash_attention_2", "cpu+fa2", "model.attn_implementation is flash_attention_2 but there is no CUDA device: "
                                     "use auto or sdpa."),
])
def test_a_kernel_that_cannot_run_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, requested: str,
                                                         machine: str, message: str) -> None:
    installed(monkeypatch, *[name for name, mark in (("flash-attn-4", "fa4"), ("flash-attn", "fa2"))
                             if mark in machine])
    if machine.startswith("sm"):
        gpu(monkeypatch, int(machine[2]), "NVIDIA A100")

    def broken() -> None:
        raise ModuleNotFoundError("No module named 'cutlass'")

    monkeypatch.setattr(attention, "_fa4_varlen", broken if "broken" in machine else lambda: per_span_sdpa)
    with pytest.raises(ToolkitError) as refused:
        choose_attention(requested)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_fa4_gets_packed_rows_in_flash_layout(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fa4_packed hands packed rows to FlashAttention-4's varlen function (a CPU stand-in that records its
    arguments): [T, heads, d] with the key/value heads not repeated, the collator's int32 offsets on the query's
    device, max_seqlen a host int, causal. The loss equals sdpa_packed's per-span one; unpacked rows never reach it."""
    calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None
                               = None, cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                               max_seqlen_k: int | None = None, softmax_scale: float | None = None,
                               causal: bool = False, **rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "cu_q": cu_seqlens_q, "cu_k": cu_seqlens_k,
                      "max": (max_seqlen_q, max_seqlen_k), "causal": causal, "rest": rest, "device": q.device})
        out = per_span_sdpa(q, k, v, cu_seqlens_q, scale=softmax_scale, is_causal=causal, enable_gqa=True)
        return out, torch.zeros(q.shape[1], q.shape[0])  # (out, lse), as flash-attn-4 returns them

    batch = to_device(packed_batch(), torch.device("cpu"))
    expected = train_step(load(model_dir, SDPA_PACKED), batch)
    monkeypatch.setattr(attention, "_fa4_varlen", lambda: flash_attn_varlen_func)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: pytest.fail("torch's varlen ran instead of FA4"))
    monkeypatch.setattr(attention, "varlen_runs", lambda query, dropout: True)  # CUDA, 16-bit
    model = load(model_dir, FA4_PACKED)
    torch.testing.assert_close(train_step(model, batch), expected, rtol=1e-6, atol=1e-6)
    tokens, head_dim = sum(LENGTHS), model.config.head_dim
    offsets = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    assert len(calls) == model.config.num_hidden_layers
    for call in calls:
        assert call["q"] == (tokens, HEADS, head_dim) and call["k"] == (tokens, KV_HEADS, head_dim)
        assert call["cu_q"] is call["cu_k"] and call["cu_q"].dtype == torch.int32
        assert call["cu_q"].device == call["device"] and call["cu_q"].tolist() == offsets
        assert type(call["max"][0]) is int and call["max"] == (max(LENGTHS), max(LENGTHS))
        assert call["causal"] and not call["rest"]

    calls.clear()  # a padded batch: the stock sdpa path, FA4 never called
    padded = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]]),
              "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
              "labels": torch.tensor([[IGNORE_INDEX, 6, 7, IGNORE_INDEX], [IGNORE_INDEX, 9, 10, 11]])}
    torch.testing.assert_close(train_step(model, padded), train_step(load(model_dir, "sdpa"), padded), rtol=0, atol=0)
    assert not calls


def test_unpacked_batches_run_stock_sdpa_to_the_bit(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Padded rows (and a single unpadded row) take transformers' own sdpa path with its own mask: same calls, same
    loss and gradients, bit for bit (the golden fp32 losses of the strategy tests rely on it)."""
    rng = random.Random(1)
    rows = [[rng.randrange(3, 900) for _ in range(n)] for n in LENGTHS]
    width = max(LENGTHS)
    padded = {"input_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
              "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
              "labels": torch.tensor([[IGNORE_INDEX, *r[1:]] + [IGNORE_INDEX] * (width - len(r)) for r in rows])}
    single = {"input_ids": torch.tensor([rows[0]]), "labels": torch.tensor([[IGNORE_INDEX, *rows[0][1:]]])}
    spy = SdpaSpy(monkeypatch)
    results = {}
    for attn in ("sdpa", SDPA_PACKED):
        model = load(model_dir, attn)
        results[attn] = [(train_step(model, batch), [p.grad.clone() for p in model.parameters()])
                         for batch in (padded, single)]
    half = len(spy.calls) // 2
    assert spy.calls[:half] == spy.calls[half:]
    for (loss, grads), (loss2, grads2) in zip(results["sdpa"], results[SDPA_PACKED], strict=True):
        assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))


def test_fa4_without_max_seqlen_parameters_is_not_handed_them() -> None:
    """Not every FlashAttention-4 release takes max_seqlen_q/k (transformers checks for them too): such a version
    is called without them, and its (out, lse) pair gives the output."""
    got: dict[str, Any] = {}

    def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, softmax_scale: float | None = None,
                               causal: bool = False) -> tuple[torch.Tensor, None]:
        got.update(causal=causal, scale=softmax_scale)
        return q, None

    q = torch.randn(5, HEADS, 8)
    out = attention._causal_fa4(flash_attn_varlen_func, q, q[:, :KV_HEADS], q[:, :KV_HEADS],
                                torch.tensor([0, 2, 5], dtype=torch.int32), 3, 0.5)
    assert out is q and got == {"causal": True, "scale": 0.5}
