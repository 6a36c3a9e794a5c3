"""Ulysses sequence parallelism without processes: the layout, the slices of a micro-batch, the refusals, and a
slice without label tokens. That 2 and 4 processes train the single process's losses is tests/e2e/test_strategies.py's
(with a spy on what each kernel receives), exact resume tests/e2e/test_resume.py's."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.packing import PackedCollator
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import forward_sums, segment_ids
from toolkit.model.loss_head import install_loss_head, liger_available, triton_interpreted
from toolkit.strategies import sequence_parallel
from toolkit.strategies.sequence_parallel import Layout, shard_batch, shard_segments


def test_layout_groups_consecutive_processes_into_replicas() -> None:
    """DeepSpeed's sequence-parallel groups are consecutive ranks: ranks 0-1 one replica, 2-3 the next."""
    places = [Layout(processes=4, rank=r, sp_size=2) for r in range(4)]
    assert [(p.dp_size, p.dp_rank, p.sp_rank) for p in places] == [(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
    assert not Layout(processes=2, rank=1).sequence_parallel and Layout(processes=2, rank=1).dp_rank == 1


def samples(lengths: list[int]) -> list[dict[str, list[int]]]:
    """Rows of the given lengths whose first two tokens are prompt (no label), as the encoder writes them."""
    rows = []
    for n, length in enumerate(lengths):
        ids = [10 * n + i + 1 for i in range(length)]
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 2 + ids[2:]})
    return rows


def whole(parts: list[dict], key: str) -> torch.Tensor:
    return torch.cat([p[key] for p in parts], dim=1)


@pytest.mark.parametrize("sp", [2, 3])
def test_a_packed_row_is_cut_after_its_labels_are_shifted(sp: int) -> None:
    """The slices put back together are the row padded to a multiple of sp_size: the targets shifted over the whole
    row (a slice's last token's target is the next slice's first token), the padding a sample of its own without
    labels, and each slice carrying the whole row's boundaries. The rows' lengths put every cut, for 2 and for 3
    slices, before a labelled token, so a shift within each slice (its last target lost) fails for both."""
    batch = PackedCollator()(samples([5, 6, 8]))  # 19 tokens: 2 slices of 10, 3 of 7, each with padding
    n = 19
    parts, real = zip(*(shard_batch(batch, Layout(sp, r, sp)) for r in range(sp)), strict=True)
    total = n + (-n % sp)
    assert total > n and sum(real) == n and all(p["input_ids"].shape == (1, total // sp) for p in parts)
    torch.testing.assert_close(whole(parts, "input_ids")[:, :n], batch["input_ids"])
    shifted = torch.cat([batch["labels"][:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    assert torch.equal(whole(parts, "shift_labels")[:, :n], shifted)
    for before, after in itertools.pairwise(parts):  # the cut's target: the next slice's first token, a labelled one
        assert before["shift_labels"][0, -1] == after["labels"][0, 0] != IGNORE_INDEX
    assert torch.equal(whole(parts, "labels")[:, :n], batch["labels"])  # what the loop counts, as without Ulysses
    assert (whole(parts, "shift_labels")[:, n:] == IGNORE_INDEX).all()
    positions = whole(parts, "position_ids")[0].tolist()
    assert positions[:n] == [*range(5), *range(6), *range(8)] and positions[n:] == list(range(total - n))
    cu = [0, 5, 11, 19, total]
    for p in parts:
        assert p["cu_seq_lens_q"].tolist() == cu and p["cu_seq_lens_k"] is p["cu_seq_lens_q"]
        assert p["max_length_q"] == 8 and isinstance(p["max_length_q"], int)
        assert "attention_mask" not in p


def test_padded_rows_get_positions_and_keep_their_padding_on_the_right(models: dict[str, str]) -> None:
    """Right-padded rows: position ids 0..T-1 (Ulysses all-gathers them), no mask (causal attention never looks
    right), the real tokens counted from the mask."""
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    batch = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE_INDEX,
                                   return_tensors="pt")(samples([7, 4]))
    parts, real = zip(*(shard_batch(batch, Layout(2, r, 2)) for r in range(2)), strict=True)
    assert sum(real) == 11 and [p["input_ids"].shape for p in parts] == [(2, 4), (2, 4)]
    assert whole(parts, "position_ids").tolist() == [list(range(8))] * 2
    assert torch.equal(whole(parts, "shift_labels")[:, :6], batch["labels"][:, 1:])
    assert not any("attention_mask" in p or "cu_seq_lens_q" in p for p in parts)


def test_a_key_that_cannot_be_cut_is_refused() -> None:
    batch = {**PackedCollator()(samples([4])), "pixel_values": torch.zeros(1, 3)}
    with pytest.raises(ToolkitError, match="'pixel_values', which cannot be split"):
        shard_batch(batch, Layout(2, 0, 2))


LIGER = pytest.param("liger", marks=pytest.mark.skipif(not (liger_available() and triton_interpreted()),
                                                      reason="liger-kernel (an optional extra) is not installed"))


@pytest.mark.parametrize("head", ["chunked", LIGER, "standard"])
def test_a_slice_without_label_tokens_adds_zero_not_nan(head: str, models: dict[str, str]) -> None:
    """A slice holding only prompt tokens: its loss term is 0 (divided by the global batch's token count) and its
    gradients zero and finite, with every loss head (Liger's kernels in Triton's CPU interpreter, as CI runs them)."""
    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    install_loss_head(model, head)
    part, _ = shard_batch(PackedCollator()(samples([6, 6])), Layout(2, 0, 2))
    part["shift_labels"][:] = IGNORE_INDEX
    part["labels"][:] = IGNORE_INDEX
    loss = model(**part, num_items_in_batch=torch.tensor(7.0)).loss
    loss.backward()
    assert loss.item() == 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)


def test_each_slice_computes_its_share_of_the_rows_loss(models: dict[str, str]) -> None:
    """The loss head takes a slice's shifted targets as they are: the slices' losses (each over the whole batch's
    token count) add up to the whole row's. Here the model sees the whole row each time (attention across slices is
    Ulysses' part, proven by the launches)."""
    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    install_loss_head(model, "chunked")
    batch = PackedCollator()(samples([6, 5, 7]))  # 18 tokens: 2 slices of 9, no padding
    count = torch.tensor(float((batch["labels"] != IGNORE_INDEX).sum()))
    full = model(**batch, num_items_in_batch=count).loss
    shares = []
    for rank in range(2):
        part, _ = shard_batch(batch, Layout(2, rank, 2))
        mine = torch.full_like(batch["labels"], IGNORE_INDEX)
        mine[:, rank * 9:(rank + 1) * 9] = part["shift_labels"]
        shares.append(model(**batch, shift_labels=mine, num_items_in_batch=count).loss)
    torch.testing.assert_close(shares[0] + shares[1], full)


@pytest.mark.parametrize("rows", [[6, 5, 7], [5, 6, 8]], ids=["even", "padded"])
def test_each_slice_s_segment_sums_add_up_to_the_whole_rows(rows: list[int], models: dict[str, str]) -> None:
    """A preference pair's log-prob under Ulysses: each process's per-segment sums over its slice (its segments
    shifted over the whole row, `shard_segments`) add up to the whole row's per-segment sums, across a cut that
    falls inside a segment; the pair numbers ride along whole. A shift within each slice loses the target at the
    cut and fails. As above, the model sees the whole row (attention across slices is Ulysses' part, proven by
    tests/e2e/test_preference_stages.py)."""
    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    install_loss_head(model, "chunked")
    batch = {**PackedCollator()(samples(rows)), "pair_index": torch.tensor([0])}
    seg, count = segment_ids(batch)
    n = batch["input_ids"].shape[1]
    whole_sums, whole_tokens = forward_sums(model, {k: v for k, v in batch.items() if k != "pair_index"},
                                            torch.device("cpu"))
    total_sums, total_tokens = torch.zeros_like(whole_sums), torch.zeros_like(whole_tokens)
    for rank in range(2):
        place = Layout(2, rank, 2)
        part, _ = shard_batch(batch, place)
        assert torch.equal(part["pair_index"], batch["pair_index"])
        chunk = part["input_ids"].shape[1]
        mine = torch.full((1, 2 * chunk), IGNORE_INDEX)
        mine[:, rank * chunk:(rank + 1) * chunk] = part["shift_labels"]
        owners = torch.full((1, 2 * chunk), -1)
        owners[:, rank * chunk:(rank + 1) * chunk] = shard_segments(seg, place)
        inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"], "shift_labels": mine[:, :n],
                  "position_ids": batch["position_ids"]}
        sums, tokens = forward_sums(model, inputs, torch.device("cpu"), (owners[:, :n], count))
        total_sums, total_tokens = total_sums + sums, total_tokens + tokens
    assert torch.equal(total_tokens, whole_tokens)
    torch.testing.assert_close(total_sums, whole_sums, rtol=1e-6, atol=1e-6)
    # Each position's owner is the segment of the token it predicts, as the shifted labels are cut.
    cut = torch.cat([shard_segments(seg, Layout(2, r, 2)) for r in range(2)], dim=1)
    assert cut[0, :n - 1].tolist() == seg[0, 1:].tolist() and (cut[0, n - 1:] == -1).all()


# --- refusals before anything loads --------------------------------------------------------------------------------


def launch_env(monkeypatch: pytest.MonkeyPatch, *, deepspeed: bool = True, world: int = 2, **sizes: object) -> None:
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true" if deepspeed else "false")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for key, value in {"sp_size": 2, "dp_replicate_size": 1, "dp_shard_size": 1, **sizes}.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{key.upper()}", str(value))


def test_the_shipped_shape_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    launch_env(monkeypatch)
    assert sequence_parallel.check_launch() == 2
    launch_env(monkeypatch, world=4, dp_shard_size=2)
    assert sequence_parallel.check_launch() == 2
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "false")
    assert sequence_parallel.check_launch() == 1


@pytest.mark.parametrize(("env", "message"), [
    ({"deepspeed": False}, "runs under DeepSpeed ZeRO-2 or ZeRO-3 only"),
    ({"cp_size": 2, "sp_size": 1}, "FSDP2 context parallelism is not supported here"),
    ({"tp_size": 2}, "tensor parallelism is not supported"),
    ({"world": 4}, r"= 2, but the launch has 4 process\(es\): set dp_shard_size to 2"),
    ({"sp_seq_length_is_variable": "false"}, "Set it to true"),
    ({"sp_backend": "ring"}, "the only backend is deepspeed"),
])
def test_launch_shapes_refused(env: dict[str, object], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launch_env(monkeypatch, **env)
    with pytest.raises(ToolkitError, match=message):
        sequence_parallel.check_launch()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"heads": 6, "kv_heads": 2, "sp": 4}, "the model has 6 attention heads"),
    ({"heads": 12, "kv_heads": 3, "sp": 2}, "3 key/value heads"),
    ({"vision": True}, "vision-language model"),
    ({"max_seq_lens": [128, 1]}, "data.max_seq_len is 1, shorter than parallelism_config_sp_size 2"),
])
def test_models_and_rows_refused(kwargs: dict[str, object], message: str) -> None:
    args = {"heads": 4, "kv_heads": 2, "vision": False, "max_seq_lens": [128], **kwargs}
    with pytest.raises(ToolkitError, match=message):
        sequence_parallel.check_model(int(args.pop("sp", 2)), **args)  # type: ignore[arg-type]
    sequence_parallel.check_model(4, heads=8, kv_heads=2, vision=False, max_seq_lens=[8])  # kv heads repeated


def test_the_kernel_family_follows_the_config() -> None:
    assert sequence_parallel.attention_request("auto", "sdpa") == "sdpa"
    assert sequence_parallel.attention_request("auto", None) == "sdpa"
    assert sequence_parallel.attention_request("flash_attention_2", "flash_attention_2") == "flash_attention_2"
    with pytest.raises(ToolkitError, match=r"model\.attn_implementation is sdpa but the accelerate config's"):
        sequence_parallel.attention_request("sdpa", "flash_attention_2")
    with pytest.raises(ToolkitError, match="'eager'; the toolkit runs Ulysses over sdpa or flash_attention_2"):
        sequence_parallel.attention_request("auto", "eager")
