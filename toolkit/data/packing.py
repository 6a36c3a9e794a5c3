"""Padding-free sample packing: several samples share one row, with no attention across them.

Why: chat samples vary a lot in length, so a right-padded micro-batch spends much of its compute (embeddings,
MLPs, LoRA, the LM head) on pad tokens. Packing groups samples into rows of at most `capacity` tokens
(`pack_samples`, best-fit decreasing), and `PackedCollator` flattens a micro-batch into one `[1, total_tokens]`
row with no padding at all.

Guarantees:
  * No cross-sample attention. `position_ids` restart at 0 at every sample start and there is no
    `attention_mask`; the collator adds the varlen boundaries (`cu_seq_lens_q/k`, `max_length_q/k`:
    `flash_boundaries` below), which reach every attention call through the model's kwargs.
    flash_attention_2 runs varlen on them; the toolkit's `sdpa_packed` / `eager_packed` kernels
    (toolkit/model/attention.py) attend within each sample span, with no T x T mask. transformers' stock sdpa and eager
    would split the row too (`masking_utils.find_packed_sequence_indices`), with a dense `[T, T]` mask. All of
    this holds only when `attention_mask` is None and there is no KV cache: a 2D all-ones mask, or
    `use_cache=True` (the config default, which builds a DynamicCache even in training), silently turns the row
    back into one causal sequence. `check_packing_support` checks the model.
  * Positions restart, so RoPE sees each sample exactly as it would alone.
  * Loss normalisation is unchanged: every sample's first label is IGNORE_INDEX, so after the loss's label
    shift no token predicts across a boundary, and the set of label tokens (hence `num_items_in_batch`) is
    exactly that of the padded batch.

Cost: with flash attention or the toolkit's kernels each sample attends only within itself, so attention costs
the sum of the samples' squared lengths, not the square of the row's.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from heapq import heappop, heappush
from typing import Any

import torch
from transformers import DataCollatorWithFlattening

from toolkit.data.encoding import IGNORE_INDEX


def pack_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group sample indices into bins of total length <= `capacity` by best-fit decreasing.

    Samples are placed longest first (ties in index order), each into the bin with the least room that still
    fits it (ties: the bin opened first), else into a new bin. Ordering kept for the caller's curriculum:
    indices inside a bin are in their original order, and bins are ordered by the smallest index they hold,
    so an ordered stage stays roughly in order. Deterministic; every index appears exactly once.

    O(n log n): bins are bucketed by remaining room, with a sorted list of the distinct rooms (at most
    capacity + 1 of them) searched by bisect and a heap of bin ids per room.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    for i, length in enumerate(lengths):
        if not 0 <= length <= capacity:
            raise ValueError(f"sample {i} has length {length}, outside [0, capacity={capacity}]")
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)  # stable: ties by index
    bin_of = [0] * len(lengths)
    rooms: list[int] = []  # sorted distinct remaining capacities that have at least one bin
    bins_by_room: dict[int, list[int]] = {}  # remaining capacity -> heap of bin ids
    num_bins = 0
    for i in order:
        length = lengths[i]
        k = bisect_left(rooms, length)
        if k < len(rooms):
            room = rooms[k]
            heap = bins_by_room[room]
            b = heappop(heap)
            if not heap:
                del bins_by_room[room]
                del rooms[k]
        else:
            b, room = num_bins, capacity
            num_bins += 1
        bin_of[i] = b
        room -= length
        if room in bins_by_room:
            heappush(bins_by_room[room], b)
        else:
            bins_by_room[room] = [b]
            insort(rooms, room)
    # Walking indices in order yields bins sorted internally and ordered by their smallest index.
    slot = [-1] * num_bins
    bins: list[list[int]] = []
    for i, b in enumerate(bin_of):
        if slot[b] < 0:
            slot[b] = len(bins)
            bins.append([])
        bins[slot[b]].append(i)
    return bins


def pack_samples(samples: list[dict[str, list[int]]], capacity: int) -> list[dict[str, list[int]]]:
    """Pack samples into rows of <= `capacity` tokens: concatenated `input_ids` and `labels`, and
    `position_ids` restarting at 0 per sample (the boundary marker the model and collator rely on).

    Each sample's first label must be IGNORE_INDEX (the data layer guarantees it): otherwise the last token
    of the previous sample would be trained to predict it.
    """
    for i, s in enumerate(samples):
        if not s["input_ids"] or len(s["labels"]) != len(s["input_ids"]):
            raise ValueError(f"sample {i} is empty or its labels do not match its input_ids in length")
        if s["labels"][0] != IGNORE_INDEX:
            raise ValueError(f"sample {i} has a loss on its first token; it would be predicted across a boundary")
    bins = pack_best_fit_decreasing([len(s["input_ids"]) for s in samples], capacity)
    return [pack_row([samples[i] for i in bin_]) for bin_ in bins]


def pack_row(samples: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """One packed row: concatenated ids and labels, `position_ids` restarting at 0 at every sample."""
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for s in samples:
        row["input_ids"] += s["input_ids"]
        row["labels"] += s["labels"]
        row["position_ids"] += range(len(s["input_ids"]))
    return row


def unpack_row(row: dict[str, Any]) -> list[dict[str, list[int]]]:
    """Split a packed row back into its samples at the position-id restarts; a plain sample is returned as is."""
    ids, labels = _as_list(row["input_ids"]), _as_list(row["labels"])
    if "position_ids" not in row:
        return [{"input_ids": ids, "labels": labels}]
    pos = _as_list(row["position_ids"])
    if not pos or pos[0] != 0:
        raise ValueError("a packed row's position_ids must start at 0")
    starts = [t for t, p in enumerate(pos) if p == 0]
    ends = [*starts[1:], len(pos)]
    return [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip(starts, ends, strict=True)]


def _as_list(x: Sequence[int] | torch.Tensor) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


class PackedCollator(DataCollatorWithFlattening):
    """Padding-free collator: flattens a micro-batch of packed rows (or plain samples) into one row.

    Returns int64 tensors of shape [1, total_tokens]: `input_ids`, `labels` and `position_ids`, and
    deliberately no `attention_mask` (its presence would disable boundary detection in transformers); plus the
    row's varlen boundaries (`flash_boundaries`: `cu_seq_lens_q/k` tensors, `max_length_q/k` ints), so no
    attention layer recomputes them. transformers' `DataCollatorWithFlattening` does the flattening; it treats
    each feature as one sequence, so packed rows are first split back into their samples at the position-id
    restarts. Its `labels[0] = -100` per sequence is a no-op for our samples.
    """

    def __init__(self) -> None:
        super().__init__(return_position_ids=True, separator_id=IGNORE_INDEX, return_tensors="pt")

    def __call__(self, features: list[dict[str, Any]], return_tensors: str | None = None,
                 separator_id: int | None = None) -> dict[str, Any]:
        if not features:
            raise ValueError("cannot collate an empty micro-batch")
        samples = [s for row in features for s in unpack_row(row)]
        batch = super().__call__(samples, return_tensors="pt", separator_id=IGNORE_INDEX)
        return {**batch, **flash_boundaries(batch["position_ids"])}


def flash_boundaries(position_ids: torch.Tensor) -> dict[str, Any]:
    """The varlen boundaries of a packed row from its `position_ids` (`[1, T]` or `[T]`, restarting at 0 at every
    sample): `cu_seq_lens_q/k`, int32 offsets of the sample starts plus T (flash-attn's `cu_seqlens`), and
    `max_length_q/k`, the longest sample as a Python int. Computed on the host, where the collator runs."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().reshape(-1)
    if pos.numel() == 0 or starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("a packed row's position_ids must start at 0")
    cu = torch.cat([starts, torch.tensor([pos.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
