"""Tests for toolkit/data/packing.py: best-fit-decreasing bins, packed rows, the padding-free collator, and that a
packed batch trains exactly like the padded one on the tiny Qwen3 (LoRA loss and gradients, no cross-attention)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.masking_utils import find_packed_sequence_indices
from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

from toolkit.builtin.text_model import build_tokenizer, write_tiny_qwen3
from toolkit.data.collate import padding_collator
from toolkit.data.encoding import IGNORE_INDEX, encode_row
from toolkit.data.packing import PackedCollator, pack_best_fit_decreasing, pack_samples, unpack_row
from toolkit.model.attention import BOUNDARY_KEYS, EAGER_PACKED, SDPA_PACKED, check_packing_support

ROWS = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."}]},
    {"messages": [{"role": "system", "content": "You are a helpful math tutor."},
                  {"role": "user", "content": "What is 17 + 25?"},
                  {"role": "assistant", "content": "17 + 25 = 42, so the answer is 42."}]},
    {"messages": [{"role": "user", "content": "Reverse the list: apple, tree, cat."},
                  {"role": "assistant", "content": "cat, tree, apple"},
                  {"role": "user", "content": "And count the words?"},
                  {"role": "assistant", "content": "There are three words."}]},
    {"prompt": "def add(a, b):", "completion": "\n    return a + b"},
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure."}]},
]


def _random_sample(rng: random.Random, length: int) -> dict[str, list[int]]:
    ids = [rng.randrange(3, 900) for _ in range(length)]
    labels = [IGNORE_INDEX] + [t if rng.random() < 0.7 else IGNORE_INDEX for t in ids[1:]]
    return {"input_ids": ids, "labels": labels}


def _reference_bfd(lengths: list[int], capacity: int) -> list[list[int]]:
    """Quadratic textbook best-fit decreasing with the same tie-breaking, to cross-check the fast one."""
    rooms: list[int] = []
    members: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b, r in enumerate(rooms) if r >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b))
        else:
            b = len(rooms)
            rooms.append(capacity)
            members.append([])
        rooms[b] -= lengths[i]
        members[b].append(i)
    return sorted(sorted(m) for m in members)


# ---------------------------------------------------------------- bin packing


def test_bfd_hand_worked_example() -> None:
    # Longest first: 8->bin A (room 2), 6->B (4), 5->C (5), 4->B (tightest, room 0), 3(i0)->C (2),
    # 3(i6)->new D (7), 1->A (rooms 2,2 tie: the bin opened first). Bins listed by their smallest index.
    assert pack_best_fit_decreasing([3, 8, 4, 5, 1, 6, 3], 10) == [[0, 3], [1, 4], [2, 5], [6]]
    # Best fit, not first fit: after 8 (room 2) and 5+4 (room 1), the 1 goes to the tighter second bin.
    assert pack_best_fit_decreasing([8, 4, 5, 1], 10) == [[0], [1, 2, 3]]


def test_bfd_invariants_and_determinism() -> None:
    rng = random.Random(0)
    for _ in range(200):
        capacity = rng.randint(1, 40)
        lengths = [rng.randint(0, capacity) for _ in range(rng.randint(0, 60))]
        bins = pack_best_fit_decreasing(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(b and sum(lengths[i] for i in b) <= capacity for b in bins)
        assert all(b == sorted(b) for b in bins)
        assert [b[0] for b in bins] == sorted(b[0] for b in bins)
        assert bins == pack_best_fit_decreasing(list(lengths), capacity)
        assert sorted(bins) == _reference_bfd(lengths, capacity)


def test_bfd_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="sample 1 has length 11"):
        pack_best_fit_decreasing([3, 11, 2], 10)
    with pytest.raises(ValueError, match="capacity"):
        pack_best_fit_decreasing([1], 0)
    assert pack_best_fit_decreasing([], 10) == []


def test_bfd_large_input() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 2048) for _ in range(200_000)]
    bins = pack_best_fit_decreasing(lengths, 2048)
    assert sum(len(b) for b in bins) == len(lengths)
    assert len(bins) <= 1.02 * sum(lengths) / 2048 + 1  # near-perfect fill on uniform lengths


# ---------------------------------------------------------------- packed rows and collator


def test_pack_samples_rows() -> None:
    rng = random.Random(1)
    samples = [_random_sample(rng, n) for n in (5, 9, 3, 7, 1, 4, 6)]
    rows = pack_samples(samples, 12)
    bins = pack_best_fit_decreasing([len(s["input_ids"]) for s in samples], 12)
    assert len(rows) == len(bins)
    for row, bin_ in zip(rows, bins, strict=True):
        assert row["input_ids"] == [t for i in bin_ for t in samples[i]["input_ids"]]
        assert row["labels"] == [t for i in bin_ for t in samples[i]["labels"]]
        assert row["position_ids"] == [p for i in bin_ for p in range(len(samples[i]["input_ids"]))]
        starts = [t for t, p in enumerate(row["position_ids"]) if p == 0]
        assert len(starts) == len(bin_)
        assert all(row["labels"][t] == IGNORE_INDEX for t in starts)
        assert unpack_row(row) == [samples[i] for i in bin_]


def test_pack_samples_rejects_loss_on_first_token() -> None:
    with pytest.raises(ValueError, match="first token"):
        pack_samples([{"input_ids": [5, 6], "labels": [5, 6]}], 8)
    with pytest.raises(ValueError, match="empty"):
        pack_samples([{"input_ids": [], "labels": []}], 8)


def test_collator_flattens_packed_rows_and_plain_samples() -> None:
    rng = random.Random(2)
    samples = [_random_sample(rng, n) for n in (6, 2, 5, 3, 4)]
    rows = pack_samples(samples, 8)
    order = [i for bin_ in pack_best_fit_decreasing([len(s["input_ids"]) for s in samples], 8) for i in bin_]
    for features in (rows, [samples[i] for i in order]):
        batch = PackedCollator()(features)
        assert set(batch) == {"input_ids", "labels", "position_ids", *BOUNDARY_KEYS}  # no attention_mask, on purpose
        for k in ("input_ids", "labels", "position_ids"):
            assert batch[k].dtype == torch.long and batch[k].shape == (1, 20)
        assert batch["input_ids"][0].tolist() == [t for i in order for t in samples[i]["input_ids"]]
        assert batch["labels"][0].tolist() == [t for i in order for t in samples[i]["labels"]]
        assert batch["position_ids"][0].tolist() == [p for i in order for p in range(len(samples[i]["input_ids"]))]
        # The boundaries transformers will see for sdpa/eager match the samples.
        seq = find_packed_sequence_indices(batch["position_ids"])
        assert seq[0].tolist() == [k for k, i in enumerate(order) for _ in samples[i]["input_ids"]]


def test_flash_varlen_boundaries_match_collator() -> None:
    """flash_attention_2 infers cu_seqlens from position_ids; they must equal the collator's own."""
    rng = random.Random(3)
    samples = [_random_sample(rng, n) for n in (4, 1, 7, 3)]
    batch = PackedCollator()(pack_samples(samples, 8))
    assert _is_packed_sequence(batch["position_ids"], batch_size=1)
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert cu_q.tolist() == batch["cu_seq_lens_q"].tolist()
    assert int(max_q) == batch["max_length_q"] == 7


# ---------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_packing"))


def _load(model_dir: Path, attn: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False  # as toolkit.model.load.load_model does; required for packing
    return model


def _lora(model: PreTrainedModel) -> torch.nn.Module:
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)  # B is zero at init, which would hide LoRA from the comparison
    return peft_model


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    num_items: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, num_items_in_batch=num_items).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("attn", ["sdpa", "eager", SDPA_PACKED, EAGER_PACKED])
def test_packed_batch_matches_padded_batch(model_dir: Path, attn: str) -> None:
    tokenizer = build_tokenizer()
    samples = [dict(zip(("input_ids", "labels"), encode_row(r, tokenizer, "assistant", f"row {i}"), strict=True))
               for i, r in enumerate(ROWS)]
    lengths = [len(s["input_ids"]) for s in samples]
    assert len(set(lengths)) == len(lengths)  # genuinely ragged
    model = _lora(_load(model_dir, attn))
    check_packing_support(model)

    padded = padding_collator(tokenizer)(samples)
    packed = PackedCollator()(pack_samples(samples, max(lengths) + 20))
    assert packed["input_ids"].shape == (1, sum(lengths))  # no padding at all
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    num_items = (padded["labels"] != IGNORE_INDEX).sum()
    assert (packed["labels"] != IGNORE_INDEX).sum() == num_items  # the normaliser is unchanged

    loss_padded, grads_padded = _loss_and_grads(model, dict(padded), num_items)
    loss_packed, grads_packed = _loss_and_grads(model, packed, num_items)
    torch.testing.assert_close(loss_packed * num_items, loss_padded * num_items, rtol=1e-5, atol=1e-7)
    assert grads_packed.keys() == grads_padded.keys() and any("lora_A" in n for n in grads_packed)
    for name, grad in grads_packed.items():
        torch.testing.assert_close(grad, grads_padded[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager", SDPA_PACKED, EAGER_PACKED])
def test_no_attention_across_samples(model_dir: Path, attn: str) -> None:
    model = _load(model_dir, attn).eval()
    check_packing_support(model)
    rng = random.Random(4)
    a, b, c = (_random_sample(rng, n) for n in (7, 5, 9))
    b2 = _random_sample(rng, 5)
    collate = PackedCollator()
    with torch.no_grad():
        logits = model(**collate([a, b, c])).logits[0]
        logits2 = model(**collate([a, b2, c])).logits[0]
        alone = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in (a, b, c)]
    sa, sb, sc = slice(0, 7), slice(7, 12), slice(12, 21)
    torch.testing.assert_close(logits2[sa], logits[sa], rtol=0, atol=1e-6)
    torch.testing.assert_close(logits2[sc], logits[sc], rtol=0, atol=1e-6)
    assert (logits2[sb] - logits[sb]).abs().max() > 1e-3
    for part, ref in zip((sa, sb, sc), alone, strict=True):  # each packed sample sees exactly what it sees alone
        torch.testing.assert_close(logits[part], ref, rtol=1e-5, atol=1e-5)


def test_kv_cache_or_mask_breaks_boundaries(model_dir: Path) -> None:
    """Why check_packing_support insists on use_cache=False and the collator sends no attention_mask:
    either one makes transformers 5.23 skip position-id boundary detection, and samples leak into each other."""
    model = _load(model_dir, "sdpa").eval()
    rng = random.Random(5)
    a, b, b2 = (_random_sample(rng, 6) for _ in range(3))
    collate = PackedCollator()
    with torch.no_grad():
        for extra in ({"use_cache": True}, {"attention_mask": torch.ones(1, 12, dtype=torch.long)}):
            leaked = model(**collate([b, a]), **extra).logits[0, 6:]
            leaked2 = model(**collate([b2, a]), **extra).logits[0, 6:]
            assert (leaked - leaked2).abs().max() > 1e-3, extra
    model.config.use_cache = True
    with pytest.raises(ValueError, match="use_cache"):
        check_packing_support(model)
    model.config.use_cache = False
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="attention"):
        check_packing_support(model)
