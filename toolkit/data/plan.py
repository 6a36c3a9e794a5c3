"""Packing and ordering: a stage's rows as index arrays over its sources' token stores.

From a store's per-row columns alone (no token is read, except the few rows a truncation cuts), `select_rows` applies
the stage's length policy (`data.max_seq_len`, `data.overlength`) and drops rows with nothing to train, counting
each; `SourceRows` then serves the kept rows, packed with packing (best-fit decreasing over the kept lengths, as
index arrays), and their lengths and difficulty, which the sampler orders by (`toolkit/curriculum/sampling.py`). A row
is assembled only when a batch asks for it. Results are the same as encoding the rows one by one and applying the policy
to each (`toolkit.data.encoding.fit_to_length`): row order is the source's, and a packed row holds its samples in that
order.

A preference stage's pair store holds each pair as two rows (chosen, rejected): `select_pairs` applies the policy
per pair as `toolkit.data.pairs.fit_pair` does, `PairRows` serves each kept pair as one packed row of its two sides,
and `PairSides` the stage's sides one by one (for the reference pass).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toolkit.atomic import write_atomic
from toolkit.data.encoding import IGNORE_INDEX, DataStats, overlength_message
from toolkit.data.packing import pack_best_fit_decreasing, pack_row
from toolkit.data.pairs import PairStats, fit_pair
from toolkit.data.sources import oversize_message
from toolkit.data.store import Store
from toolkit.errors import ToolkitError


@dataclass
class Selection:
    """The rows of a store a stage keeps (`index`), each cut to `limit` tokens, with their lengths and trained
    token counts after the cut, and what happened to the others."""

    index: np.ndarray  # store rows, in order
    lengths: np.ndarray
    label_tokens: np.ndarray
    limit: int
    stats: DataStats


def select_rows(store: Store, *, max_seq_len: int, overlength: str) -> Selection:
    """data.overlength over the store's rows: "error" raises naming the first row over `max_seq_len`, "drop"
    drops those rows, "truncate" cuts them (a vision row whose images reach past the cut is dropped instead);
    rows left with no trained token are skipped. All counted in the stats. A row stored unread, over the row byte
    cap, counts as over-length for "drop"; "error" and "truncate" refuse it (nothing of it was read to keep)."""
    lengths = store.lengths
    over = lengths > max_seq_len
    if store.oversize and overlength != "drop":  # rows too large to read (toolkit/data/sources.py row_byte_cap)
        first = min(store.oversize)
        if overlength == "truncate" or not over[:first].any():
            raise ToolkitError(oversize_message(store.where(first), store.oversize[first], store.oversize_cap))
    if store.oversize:
        over[list(store.oversize)] = True
    if overlength == "error" and over.any():
        first = int(np.flatnonzero(over)[0])
        raise ToolkitError(overlength_message(store.where(first), int(lengths[first]), max_seq_len,
                                              store.capped.get(first)))
    drop = over if overlength == "drop" else over & (store.uncuttable > max_seq_len if store.vision else False)
    cut = over & ~drop
    labels = store.label_tokens.copy()
    for i in np.flatnonzero(cut).tolist():
        labels[i] = store.labels_within(i, max_seq_len)
    no_label = ~drop & (labels == 0)
    keep = ~drop & ~no_label
    index = np.flatnonzero(keep)
    kept_lengths = np.minimum(lengths[index], max_seq_len)
    stats = DataStats(rows=len(store), kept=len(index), dropped_overlength=int(drop.sum()), truncated=int(cut.sum()),
                      no_label_tokens=int(no_label.sum()), tokens=int(kept_lengths.sum()),
                      label_tokens=int(labels[index].sum()))
    return Selection(index, kept_lengths, labels[index], max_seq_len, stats)


def identical_pairs(store: Store, candidates: np.ndarray) -> np.ndarray:
    """Which of the pairs `candidates` (a mask over pair indices) render their two sides to the same tokens and the
    same trained mask. Only pairs whose sides have equal lengths and trained-token counts are read; a side the size
    guard cut (only its start stored) is never taken as equal."""
    n = len(store) // 2
    lengths, labels = store.lengths.reshape(n, 2), store.label_tokens.reshape(n, 2)
    same = np.zeros(n, dtype=bool)
    for k in np.flatnonzero(candidates & (lengths[:, 0] == lengths[:, 1]) & (labels[:, 0] == labels[:, 1])).tolist():
        if 2 * k in store.capped or 2 * k + 1 in store.capped:
            continue
        (a, ma), (b, mb) = store.tokens(2 * k), store.tokens(2 * k + 1)
        same[k] = bool(np.array_equal(a, b) and np.array_equal(ma, mb))
    return same


def select_pairs(store: Store, *, max_seq_len: int, overlength: str, identical: str = "error") -> Selection:
    """data.overlength over a pair store's pairs (store rows 2k, chosen, and 2k + 1, rejected), as
    `toolkit.data.pairs.fit_pair` applies it pair by pair, from the store's columns: a pair with no completion token
    on a side is dropped (checked first, as fit_pair does); over `max_seq_len` (its longer side), "error" raises
    naming the pair's row, "drop" drops it, "truncate" cuts the prompt's start first, then the completions' ends,
    and drops it when a side is left with no completion token. Tokens are read only for the pairs a truncation
    cuts. `index` holds pair indices k, `lengths` both sides' tokens after the fit, `label_tokens` both sides'
    trained tokens; the stats count pairs. A side stored unread (over the row byte cap) makes its pair over-length
    for "drop" and is refused otherwise; a side the size guard cut is over-length even when its stored start holds
    no trained token, and cannot be truncated (only its start is stored). A vision pair over-length under
    "truncate" is dropped, as an image row is: the cut would take its prompt's images."""
    if len(store) % 2:
        raise ToolkitError(f"{store.source.name}: the token store holds {len(store)} rows, not pairs of rows; "
                           "delete it from data.cache_dir so it is prepared again.")
    n = len(store) // 2
    lengths, labels = store.lengths.reshape(n, 2), store.label_tokens.reshape(n, 2)
    unread = np.zeros(n, dtype=bool)
    if store.oversize:
        unread[[i // 2 for i in store.oversize]] = True
        if overlength != "drop":
            first = min(store.oversize)
            raise ToolkitError(oversize_message(store.where(first), store.oversize[first], store.oversize_cap))
    # A side the size guard cut stores only its start, which may hold none of its trained tokens: it is over-length
    # (its text is), not a side with no completion, and is counted and refused as such.
    cut_short = np.zeros(2 * n, dtype=bool)
    if store.capped:
        cut_short[list(store.capped)] = True
    no_completion = ((labels == 0) & ~cut_short.reshape(n, 2)).any(axis=1) & ~unread
    alike = identical_pairs(store, ~unread & ~no_completion)
    if alike.any() and identical == "error":
        k = int(np.flatnonzero(alike)[0])
        more = f" (and {int(alike.sum()) - 1} more pairs)" if alike.sum() > 1 else ""
        raise ToolkitError(f"{store.where(2 * k)}: the chosen and the rejected side render to the same tokens"
                           f"{more}: such a pair cannot teach (its loss is ln 2, with no gradient). Fix the row, or "
                           "set data.identical_pairs: skip to drop such pairs (counted in the stage's data line).")
    no_completion &= ~alike  # counted apart
    longest = lengths.max(axis=1)
    over = ((longest > max_seq_len) | unread) & ~no_completion & ~alike
    if overlength == "error" and over.any():
        k = int(np.flatnonzero(over)[0])
        side = 2 * k + int(lengths[k, 1] > lengths[k, 0])
        raise ToolkitError(overlength_message(store.where(2 * k), int(longest[k]), max_seq_len,
                                              store.capped.get(side)))
    drop = over if overlength == "drop" else np.zeros(n, dtype=bool)
    if store.vision:  # a vision pair's images are in its prompt, which a truncation cuts first: dropped, as rows are
        drop |= over & (store.uncuttable.reshape(n, 2)[:, 0] > 0)
    cut = over & ~drop
    kept_lengths, kept_labels = lengths.sum(axis=1), labels.sum(axis=1)
    for k in np.flatnonzero(cut).tolist():
        capped = [side for side in (2 * k, 2 * k + 1) if side in store.capped]
        if capped:
            raise ToolkitError(overlength_message(store.where(2 * k), int(longest[k]), max_seq_len,
                                                  store.capped[capped[0]])
                               .replace("set data.overlength to drop or truncate", "set data.overlength: drop"))
        skip = _pair_skip(store, k, int(longest[k]), max_seq_len)
        masks = [store.tokens(side)[1][skip:skip + max_seq_len] for side in (2 * k, 2 * k + 1)]
        kept_lengths[k] = sum(len(m) for m in masks)
        kept_labels[k] = sum(int(np.count_nonzero(m)) for m in masks)
        if any(not m.any() for m in masks):
            no_completion[k] = True
    keep = ~drop & ~no_completion & ~alike
    index = np.flatnonzero(keep)
    stats = DataStats(rows=n, kept=len(index), dropped_overlength=int(drop.sum()), truncated=int(cut.sum()),
                      no_label_tokens=int(no_completion.sum()), tokens=int(kept_lengths[index].sum()),
                      label_tokens=int(kept_labels[index].sum()), identical=int(alike.sum()), pairs=True)
    return Selection(index, kept_lengths[index].astype(np.int64), kept_labels[index].astype(np.int64), max_seq_len,
                     stats)


def _pair_skip(store: Store, k: int, longest: int, max_seq_len: int) -> int:
    """The prompt tokens a truncation cuts off the start of pair k (fit_pair: down to one prompt token)."""
    mask = store.tokens(2 * k)[1]
    prompt = int(np.argmax(mask != 0)) if mask.any() else len(mask)
    return min(longest - max_seq_len, max(prompt - 1, 0))


def kept_difficulty(store: Store, selection: Selection) -> np.ndarray | None:
    """The kept rows' `difficulty` for easy_to_hard: None when no row has one (order by length); an error naming
    the row when some kept row has none, or one that is not a number."""
    if not store.has_difficulty and not store.bad_difficulty:
        return None
    values = store.difficulty[selection.index]
    for i in np.flatnonzero(~np.isfinite(values)).tolist():
        row = int(selection.index[i])
        value = store.bad_difficulty.get(row)
        problem = f"difficulty {value} is not a number" if value is not None else "no difficulty"
        raise ToolkitError(f"{store.where(row)}: {problem}; easy_to_hard needs a number on every row (or on none, "
                           "to order by token length).")
    return values


def kept_frames(store: Store, selection: Selection) -> np.ndarray | None:
    """The kept rows' sampled video frames (`difficulty: {by: frames}`), over all of a row's videos as the stage's
    frame caps sampled them (0 for a row without a video: a text entry of a video stage comes first)."""
    return store.video_counts()[1][selection.index].astype(np.float64)


STORE_MEASURES = {"field": kept_difficulty, "frames": kept_frames}
"""Each difficulty.by read from the rows' store, as its kept rows' values (None: the store has none); an unset
`by` reads the `difficulty` key as `field` does. by: length is the selection's own lengths (the sampler's order when
the values are None); a model's scores come at training (toolkit/train/stage_scores.py)."""


def drop_by_difficulty(keys: list[np.ndarray], *, easiest: float, hardest: float) -> list[np.ndarray]:
    """Per source, which kept rows stay once the stage's `easiest` and `hardest` shares are dropped (stage.drop):
    the rows of all the stage's sources ranked together by `keys` (each source's kept rows' difficulty), ties by
    position, floor(share x rows) dropped from each end."""
    flat = np.concatenate(keys) if keys else np.zeros(0, np.float64)
    keep = kept_by_rank(flat, *drop_counts(len(flat), easiest=easiest, hardest=hardest))
    return np.split(keep, np.cumsum([len(k) for k in keys])[:-1].astype(np.int64)) if keys else []


def drop_counts(rows: int, *, easiest: float, hardest: float) -> tuple[int, int]:
    """How many of `rows` stage.drop leaves out at the easy and the hard end: floor(share x rows) each, known
    before any row is ranked (a stage dropped by a model's scores is planned with them before the scores exist)."""
    return math.floor(round(easiest * rows, 9)), math.floor(round(hardest * rows, 9))  # 0.1 * 1000: 100.00000000000001


def kept_by_rank(keys: np.ndarray, n_easy: int, n_hard: int) -> np.ndarray:
    """The mask of the rows kept once the `n_easy` lowest and the `n_hard` highest `keys` are left out (ties by
    position: of equal keys the earlier row counts as the easier)."""
    n = len(keys)
    order = np.argsort(np.asarray(keys, dtype=np.float64), kind="stable")
    keep = np.ones(n, dtype=bool)
    keep[order[:n_easy]] = False
    if n_hard:
        keep[order[n - n_hard:]] = False
    return keep


def kept_subset(selection: Selection, keep: np.ndarray) -> Selection:
    """The selection without the rows `keep` leaves out (stage.drop), counted in its stats."""
    stats = DataStats(**vars(selection.stats))
    dropped = int((~keep).sum())
    stats.kept -= dropped
    stats.dropped_by_difficulty += dropped
    stats.tokens, stats.label_tokens = int(selection.lengths[keep].sum()), int(selection.label_tokens[keep].sum())
    return Selection(selection.index[keep], selection.lengths[keep], selection.label_tokens[keep], selection.limit,
                     stats)


def packing_plan(store: Store, selection: Selection) -> tuple[np.ndarray, np.ndarray]:
    """The packed rows of a selection as index arrays: packed row k holds the kept rows
    members[offsets[k]:offsets[k + 1]] (best-fit decreasing over the kept lengths, `pack_best_fit_decreasing`).

    A plan depends only on the store and the length policy, so it is kept in the store's folder (`plans/`) once
    computed: at a million rows it saves each rank seconds per launch. A plan file that does not fit the selection
    is computed again."""
    path = None
    if store.path is not None:
        rows = hashlib.sha256(np.ascontiguousarray(selection.index, dtype=np.int64).tobytes()).hexdigest()[:16]
        policy = f"{selection.limit}-{len(selection.index)}-{int(selection.lengths.sum())}-{rows}"
        path = store.path / "plans" / f"packed-{policy}.npz"
        with contextlib.suppress(OSError, ValueError, KeyError):
            with np.load(path, allow_pickle=False) as saved:
                offsets, members = saved["offsets"], saved["members"]
            if len(members) == len(selection.index) and offsets[-1] == len(members) and np.array_equal(
                    np.sort(members), np.arange(len(members))):
                return offsets, members
    bins = pack_best_fit_decreasing(selection.lengths.tolist(), selection.limit)
    offsets = np.cumsum([0, *map(len, bins)]).astype(np.int64)
    members = np.fromiter((i for b in bins for i in b), np.int64, int(offsets[-1]))
    if path is not None:
        with contextlib.suppress(OSError):  # a read-only cache only costs the time
            write_atomic(path, lambda f: np.savez(f, offsets=offsets, members=members))
    return offsets, members


class SourceRows(Sequence[dict[str, Any]]):
    """One source's rows for a stage: its kept rows, or with packing the packed rows (a list of kept rows each,
    `position_ids` restarting at every one, no more than `limit` tokens). Indexable; a row is read from the store
    when asked for."""

    def __init__(self, store: Store, selection: Selection, *, packing: bool,
                 difficulty: np.ndarray | None = None) -> None:
        self.store, self.selection = store, selection
        self.bins: tuple[np.ndarray, np.ndarray] | None = None  # (offsets, members): packed row k holds
        self.difficulty = difficulty                             # members[offsets[k]:offsets[k + 1]]
        self.lengths = selection.lengths
        if packing:
            offsets, members = packing_plan(store, selection)
            self.bins = (offsets, members)
            n_bins = len(offsets) - 1
            self.lengths = (np.add.reduceat(selection.lengths[members], offsets[:-1]) if n_bins
                            else np.zeros(0, np.int64))
            if difficulty is not None:
                self.difficulty = np.maximum.reduceat(difficulty[members], offsets[:-1]) if n_bins else difficulty

    def __len__(self) -> int:
        return len(self.lengths)

    def members(self, k: int) -> list[int]:
        """The kept rows (positions in the selection) in row k."""
        if self.bins is None:
            return [k]
        offsets, members = self.bins
        return members[offsets[k]:offsets[k + 1]].tolist()

    def _sample(self, j: int) -> dict[str, Any]:
        return self.store.sample(int(self.selection.index[j]), self.selection.limit)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        k %= len(self)
        if self.bins is None:
            return self._sample(k)
        return packed_row([self._sample(j) for j in self.members(k)])


class PairRows(Sequence[dict[str, Any]]):
    """One source's kept pairs for a preference stage (a pair store and its `select_pairs` selection): item k is
    kept pair k as one packed row of its two sides, chosen then rejected (`packed_row`: `position_ids` restart at 0
    at the rejected side), each fitted as `toolkit.data.pairs.fit_pair` fits it (recomputed on read). Pairs are
    never bin-packed together: a micro-batch's pairs are flattened by the collator (`toolkit.data.collate`)."""

    pairs = True

    def __init__(self, store: Store, selection: Selection, *, difficulty: np.ndarray | None = None) -> None:
        self.store, self.selection = store, selection
        self.bins: tuple[np.ndarray, np.ndarray] | None = None
        self.difficulty = difficulty
        self.lengths = selection.lengths

    def __len__(self) -> int:
        return len(self.selection.index)

    def sides(self, k: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Kept pair k's chosen and rejected samples (`input_ids`, `labels`), fitted under the selection's limit."""
        j = int(self.selection.index[k])
        chosen, rejected = self.store.sample(2 * j), self.store.sample(2 * j + 1)
        fitted = fit_pair(chosen, rejected, max_seq_len=self.selection.limit, overlength="truncate",
                          where=self.store.where(2 * j), stats=PairStats())
        if fitted is None:  # select_pairs kept it: the store changed under the selection
            raise ToolkitError(f"{self.store.where(2 * j)}: a kept pair lost its completion; delete the token "
                               "store from data.cache_dir so it is prepared again.")
        return fitted

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        return packed_row(list(self.sides(int(k) % len(self))))


def kl_partner(k: int, rows: int, chunk: int) -> int:
    """Of `rows` rows in chunks of `chunk`, the row whose completion row k's KL side takes: the previous one in its
    chunk, the chunk's last for its first (TRL's `[completions[-1]] + completions[:-1]` per batch)."""
    start = k - k % chunk
    end = min(start + chunk, rows)
    return end - 1 if k == start else k - 1


class KtoRows(Sequence[dict[str, Any]]):
    """One source's kept rows for a kto stage (a kto store, whose rows carry their `desirable` label, and its
    `select_rows` selection): item k is kept row k as one packed row of two sides, the row itself then its KL side,
    which the stage's pair machinery treats as a pair (`pairs`: the pair collator, the reference pass over
    `PairSides`, `pair_index`). The KL side is the row's prompt with another row's completion, spliced as token ids
    as TRL's KTOTrainer splices them (`prompt_ids + KL_completion_ids`): TRL rotates the completions by one within
    each chunk of `per_device_train_batch_size` rows of the dataset, (x1, y1) ... (xn, yn) -> (x1, yn), (x2, y1),
    ..., (xn, yn-1); here within each chunk of `chunk` (the stage's micro_batch_size) kept rows of the source, so
    rows in their file order batch exactly as TRL's sequential sampler batches them. A KL side over the limit loses
    its completion's end (TRL's right truncation)."""

    pairs = True

    def __init__(self, store: Store, selection: Selection, *, chunk: int, difficulty: np.ndarray | None = None
                 ) -> None:
        if store.desirable is None:
            raise ValueError(f"{store.source.name}: not a kto store (its rows carry no label)")
        self.store, self.selection, self.chunk = store, selection, max(int(chunk), 1)
        self.bins: tuple[np.ndarray, np.ndarray] | None = None
        self.difficulty = difficulty
        self.lengths = selection.lengths
        self.desirable = store.desirable[selection.index].astype(bool)

    def __len__(self) -> int:
        return len(self.selection.index)

    def partner(self, k: int) -> int:
        """The kept row whose completion row k's KL side takes (`kl_partner`)."""
        return kl_partner(k, len(self), self.chunk)

    def sides(self, k: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Kept row k (`input_ids`, `labels`, cut to the selection's limit) and its KL side."""
        limit = self.selection.limit
        own = self.store.sample(int(self.selection.index[k]), limit)
        other = self.store.sample(int(self.selection.index[self.partner(k)]), limit)
        cut = next(i for i, y in enumerate(own["labels"]) if y != IGNORE_INDEX)  # the prompt's tokens
        at = next(i for i, y in enumerate(other["labels"]) if y != IGNORE_INDEX)
        kl = {"input_ids": (own["input_ids"][:cut] + other["input_ids"][at:])[:limit],
              "labels": ([IGNORE_INDEX] * cut + other["labels"][at:])[:limit]}
        return own, kl

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        k = int(k) % len(self)
        return {**packed_row(list(self.sides(k))), "desirable": bool(self.desirable[k])}


class PairSides(Sequence[dict[str, Any]]):
    """A preference stage's pairs' sides as plain samples (`input_ids`, `labels`), over its sources' `PairRows` in
    the stage's order: item 2i is the chosen side of the stage's pair i, 2i + 1 its rejected side (what the
    reference pass scores, one sequence per item)."""

    def __init__(self, parts: Sequence[PairRows]) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0, *map(len, self.parts)]).astype(np.int64)

    def __len__(self) -> int:
        return 2 * int(self.starts[-1])

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        if not -len(self) <= j < len(self):
            raise IndexError(j)
        i, side = divmod(int(j) % len(self), 2)
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k].sides(i - int(self.starts[k]))[side]


class KeptRows(Sequence[dict[str, Any]]):
    """A stage's kept rows one by one, unpacked, over its sources in order: what a model scores (a packed row's
    samples are scored apart, each given only itself)."""

    def __init__(self, parts: Sequence[SourceRows]) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0, *(len(p.selection.index) for p in self.parts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i) % len(self)
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k]._sample(i - int(self.starts[k]))

    def per_row(self, values: np.ndarray) -> np.ndarray:
        """Kept-row values as the stage's rows' (the sampler's): a packed row takes its hardest sample's."""
        out = []
        for part, lo, hi in zip(self.parts, self.starts[:-1].tolist(), self.starts[1:].tolist(), strict=True):
            mine = np.asarray(values[lo:hi], dtype=np.float64)
            if part.bins is not None and len(part.bins[0]) > 1:
                offsets, members = part.bins
                mine = np.maximum.reduceat(mine[members], offsets[:-1])
            out.append(mine)
        return np.concatenate(out) if out else np.zeros(0, np.float64)


def packed_row(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """`toolkit.data.packing.pack_row`, and for vision-language samples their images and grids in order, with how many
    images each sample has (`image_counts`: the collator splits them back per sample). An image is never split:
    samples are packed whole."""
    row: dict[str, Any] = pack_row(samples)
    if any("images" in s for s in samples):
        row["images"] = [p for s in samples for p in s.get("images", [])]
        row["image_grid_thw"] = [g for s in samples for g in s.get("image_grid_thw", [])]
        row["image_counts"] = [len(s.get("images", [])) for s in samples]
    return row


class StageRows(Sequence[dict[str, Any]]):
    """A stage's rows: its sources' rows one after another (the sampler's global indices). An item of a pair part
    (`PairRows`) carries `pair_index`, its index here: the stage's pair i (whose sides are `PairSides` 2i, 2i + 1)."""

    def __init__(self, parts: Sequence[SourceRows | PairRows]) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0, *map(len, self.parts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i = int(i) % len(self)
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        row = self.parts[k][i - int(self.starts[k])]
        return {**row, "pair_index": i} if getattr(self.parts[k], "pairs", False) else row


@dataclass
class TrainingSet:
    """A stage's training rows: samples (packed rows with packing; any indexable sequence), per-source sizes,
    difficulty (None: no row has one, easy_to_hard then sorts by length), lengths, statistics."""

    samples: Sequence[dict[str, Any]]
    sizes: list[int]
    difficulty: Any  # np.ndarray | list[float] | None
    lengths: Any  # np.ndarray | list[int]
    stats: DataStats
    dropped_by_score: tuple[int, int] | None = None
    """A drop by a model's scores (stage.drop with difficulty by loss | perplexity | ifd): how many of `samples`
    it leaves out at the easy and the hard end, once the scores exist (toolkit/train/stage_scores.py); the stage
    is planned over the rest."""

    @property
    def planned_rows(self) -> int:
        """The rows the stage samples from: `samples`, less those a drop by scores will leave out."""
        return len(self.samples) - sum(self.dropped_by_score or (0, 0))


def training_set(parts: Sequence[SourceRows | PairRows], *, needs_difficulty: bool) -> TrainingSet:
    """The stage's training set over its sources' rows."""
    stats = DataStats()
    for part in parts:
        stats.add(part.selection.stats)
    difficulty = None
    if needs_difficulty and parts and all(p.difficulty is not None for p in parts):
        difficulty = np.concatenate([p.difficulty for p in parts])
    lengths = np.concatenate([p.lengths for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)
    return TrainingSet(StageRows(parts), [len(p) for p in parts], difficulty, lengths, stats)


# --- convenience: files to rows, as a stage loads them ------------------------------------------------------------

@dataclass
class EncodedRows:
    """Some files' kept rows as plain samples (`input_ids`, `labels`), their difficulty and statistics."""

    samples: list[dict[str, Any]]
    difficulty: list[float | None]
    stats: DataStats


def _selections(paths: Sequence[Any], tokenizer: Any, *, max_seq_len: int, overlength: str, train_on: str,
                thinking: str, cache_dir: Any, encoder: Any, num_proc: int) -> list[tuple[Store, Selection]]:
    from pathlib import Path

    from toolkit.data.encoding import TextEncoder
    from toolkit.data.sources import Entry, resolve_source
    from toolkit.data.store import open_store

    encoder = encoder or TextEncoder(tokenizer, train_on=train_on, thinking=thinking)
    out = []
    for path in paths:
        entry = path if isinstance(path, Entry) else Entry(str(path))
        store = open_store(resolve_source(entry, Path()), encoder, None if cache_dir is None else Path(cache_dir),
                           num_proc=num_proc, max_tokens=max_seq_len)
        out.append((store, select_rows(store, max_seq_len=max_seq_len, overlength=overlength)))
    return out


def encode_files(paths: Sequence[Any], tokenizer: Any, *, max_seq_len: int, overlength: str, train_on: str,
                 thinking: str = "auto", cache_dir: Any = None, encoder: Any = None, num_proc: int = 1
                 ) -> EncodedRows:
    """Read, tokenise and length-police some sources (paths, or `Entry`s with a split and columns; through their
    stores when `cache_dir` is given, else in memory), as plain samples: for inspecting and small eval sets.
    `encoder` replaces the text encoder (vision-language rows)."""
    data = EncodedRows([], [], DataStats())
    for store, selection in _selections(paths, tokenizer, max_seq_len=max_seq_len, overlength=overlength,
                                        train_on=train_on, thinking=thinking, cache_dir=cache_dir, encoder=encoder,
                                        num_proc=num_proc):
        data.samples += [store.sample(int(i), selection.limit) for i in selection.index]
        values = store.difficulty[selection.index]
        data.difficulty += [None if np.isnan(v) else float(v) for v in values.tolist()]
        data.stats.add(selection.stats)
    return data


def load_training_set(paths: Sequence[Any], tokenizer: Any, *, max_seq_len: int, overlength: str, train_on: str,
                      packing: bool, needs_difficulty: bool, thinking: str = "auto", cache_dir: Any = None,
                      encoder: Any = None, num_proc: int = 1) -> TrainingSet:
    """A stage's training set over files (each one a source of the mixture), packed within each file."""
    parts = [SourceRows(store, selection, packing=packing,
                        difficulty=kept_difficulty(store, selection) if needs_difficulty else None)
             for store, selection in _selections(paths, tokenizer, max_seq_len=max_seq_len, overlength=overlength,
                                                 train_on=train_on, thinking=thinking, cache_dir=cache_dir,
                                                 encoder=encoder, num_proc=num_proc)]
    return training_set(parts, needs_difficulty=needs_difficulty)
