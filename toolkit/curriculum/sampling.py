"""Which samples form a stage's global batch at a given step: the data-ordering engine of the curriculum.

`StageSampler.batch(k)` is a pure function of (stage configuration, dataset sizes, difficulty / length arrays,
seed, stage index, global batch, stage length, k). Nothing depends on the call history or the number of
processes, so resuming at any step is exact and 1 and N processes see the same global batches. A step costs
O(global_batch) plus at most one per-epoch array (a permutation or a mixture block), which is cached: there is
never an O(k) replay from step 0.

The datasets of a stage are concatenated: dataset d owns the global indices [offset_d, offset_d + sizes[d]).
`difficulty` and `lengths` are per concatenated sample; "sorted order" means ascending difficulty (or ascending
token length when `difficulty` is None), ties broken by index. Every mode uses
`steps_per_epoch = num_samples // global_batch`, and a stage needs at least one global batch of samples.

Modes:

* No weights (epochs). Each epoch is `steps_per_epoch` full global batches taken from the front of that epoch's
  order; the remainder is dropped. `shuffle`: a fresh permutation per epoch seeded by [seed, stage_index, epoch]
  (identical to `curriculum.global_batch_indices`), so a different remainder is dropped each epoch.
  `sequential`: file order every epoch. `easy_to_hard` without pacing: the sorted order every epoch
  (`hard_to_easy`: the same over the negated difficulty, hardest first, here and below). With both
  fixed orders the same tail (the last samples, or the hardest ones) is dropped every epoch.
* Weights (a mixture). Every position of the stage is one draw; its dataset is chosen with probability
  weights[d] / sum(weights). Positions are grouped in blocks of one epoch (`steps_per_epoch * global_batch`
  draws, so a batch never straddles two blocks). Block b draws its per-dataset counts from a multinomial and
  then arranges them by a seeded permutation, both from one RNG seeded by block b: together this is exactly
  i.i.d. categorical draws, yet the number of draws of each dataset before block b is a sum of cheap
  multinomial draws (O(b * datasets), cached) instead of a replay of the positions.
  Within the chosen dataset:
  - `shuffle`, `replacement=True`: uniform with replacement (seeded per step);
  - `shuffle`, `replacement=False`: the n-th draw from dataset d takes element n mod size_d of d's permutation
    number n // size_d (a new seeded permutation per pass), so a dataset repeats nothing until exhausted;
  - `sequential`: the same walk over d in file order;
  - `easy_to_hard` (our choice): the same walk over d sorted by difficulty (easy first, each pass again).
  `replacement=True` is only accepted with `shuffle`: a fixed walk cannot also draw at random.
* `easy_to_hard` with `pacing` (competence-based curriculum, Platanios et al. 2019): at progress
  t = step / total_steps the competence is c = min(1, start + (1 - start) t) (linear) or
  min(1, sqrt(start^2 + (1 - start^2) t)) (sqrt). The batch is `global_batch` uniform draws, seeded by
  [seed, stage_index, step], from the first ceil(c N) samples of the sorted order; without replacement within
  the batch when that prefix holds at least a global batch, else with replacement. Not combinable with weights.
  Note that the last step (t = 1 - 1 / total_steps) has c slightly below 1 unless the curve saturates earlier.

`replacement=True` needs weights: a stage without weights iterates in epochs. Invalid input raises ToolkitError.

`keep` (a stage `drop` by a model's scores, known only once the model has scored the rows): a mask over the
samples; the sampler is then the one above over the kept samples alone (each dataset's size its kept count), its
indices mapped back to the samples' own. The stage's length depends only on how many are kept.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import numpy as np

from toolkit.config.schema import ORDERED
from toolkit.errors import ToolkitError

# Seed-stream tags: distinct, nonzero (SeedSequence ignores trailing zeros, so tags must not be trailing).
_TAG_BLOCK = 0x6D697842  # mixture block: counts + arrangement
_TAG_PASS = 0x6D697850   # per-dataset permutation of one pass
_TAG_DRAW = 0x6D697844   # per-step within-dataset draws with replacement
_CACHE = 2               # per-epoch arrays kept (current and previous epoch, or the two passes a batch spans)

Order = Literal["shuffle", "sequential", "easy_to_hard", "hard_to_easy"]

V = TypeVar("V")


@dataclass(frozen=True)
class Pacing:
    """Competence schedule of an easy-to-hard stage: the fraction of the sorted data usable at each step."""

    kind: Literal["linear", "sqrt"]
    start_fraction: float  # 0 < start_fraction <= 1

    def competence(self, t: float) -> float:
        """Competence at stage progress t (0 at the first step, 1 at the end); clamped to 1."""
        s, t = self.start_fraction, max(0.0, t)
        if self.kind == "linear":
            return min(1.0, s + (1.0 - s) * t)
        return min(1.0, math.sqrt(s * s + (1.0 - s * s) * t))


class _Lru(Generic[V]):
    """Tiny LRU cache for per-epoch arrays, so sequential access computes each array once."""

    def __init__(self, capacity: int) -> None:
        self._data: OrderedDict[tuple[int, ...], V] = OrderedDict()
        self._capacity = capacity

    def get(self, key: tuple[int, ...], make: Callable[[], V]) -> V:
        """The cached value for key, else make() (then cached, evicting the least recently used)."""
        if key in self._data:
            self._data.move_to_end(key)
            return self._data[key]
        value = make()
        self._data[key] = value
        while len(self._data) > self._capacity:
            self._data.popitem(last=False)
        return value


class StageSampler:
    """Global batch of each step of one stage, as a pure function of its configuration (see module docstring)."""

    def __init__(self, *, sizes: list[int], weights: list[float] | None, replacement: bool, order: Order,
                 difficulty: np.ndarray | None, lengths: np.ndarray, pacing: Pacing | None, seed: int,
                 stage_index: int, global_batch: int, total_steps: int, keep: np.ndarray | None = None) -> None:
        self._kept: np.ndarray | None = None  # with keep: the kept samples' indices, what batches map through
        self._settings = dict(sizes=sizes, weights=weights, replacement=replacement, order=order, lengths=lengths,
                              pacing=pacing, seed=seed, stage_index=stage_index, global_batch=global_batch,
                              total_steps=total_steps)
        if keep is not None:
            keep = np.asarray(keep, dtype=bool)
            if keep.shape != (sum(sizes),):
                raise ToolkitError(f"Stage {stage_index}: keep has shape {keep.shape}, expected ({sum(sizes)},).")
            self._kept = np.flatnonzero(keep)
            starts = np.cumsum([0, *sizes]).astype(np.int64)
            sizes = [int(keep[a:b].sum()) for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)]
            lengths = np.asarray(lengths)[keep]
            difficulty = None if difficulty is None else np.asarray(difficulty)[keep]
        _validate(sizes=sizes, weights=weights, replacement=replacement, order=order, difficulty=difficulty,
                  lengths=lengths, pacing=pacing, seed=seed, stage_index=stage_index, global_batch=global_batch,
                  total_steps=total_steps)
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)[:-1]]).astype(np.int64)
        self._n = int(self._sizes.sum())
        self._order: Order = order
        self._replacement = replacement
        self._pacing = pacing
        self._seed, self._stage = int(seed), int(stage_index)
        self._g, self._total_steps = int(global_batch), int(total_steps)
        self._steps_per_epoch = self._n // self._g
        self._probs = None if weights is None else np.asarray(weights, dtype=np.float64) / float(sum(weights))
        self._sorted: np.ndarray | None = None  # global indices in ascending difficulty (easy_to_hard only)
        self._local_sorted: list[np.ndarray] = []  # per dataset, local indices in ascending difficulty
        if order in ORDERED:
            key = np.asarray(lengths if difficulty is None else difficulty, dtype=np.float64)
            key = -key if order == "hard_to_easy" else key
            self._sorted = np.argsort(key, kind="stable")  # stable: ties keep index order
            if weights is not None:  # within each dataset, local indices sorted by difficulty
                self._local_sorted = [np.argsort(key[o:o + s], kind="stable")
                                      for o, s in zip(self._offsets.tolist(), sizes, strict=True)]
        self._epochs: _Lru[np.ndarray] = _Lru(_CACHE)                    # shuffle: epoch -> permutation
        self._blocks: _Lru[tuple[np.ndarray, np.ndarray]] = _Lru(_CACHE)  # mixture block -> (dataset, rank)
        self._passes: _Lru[np.ndarray] = _Lru(_CACHE * len(sizes))        # mixture (dataset, pass) -> perm
        self._cum_counts: list[np.ndarray] = [np.zeros(len(sizes), dtype=np.int64)]  # draws before block b

    def with_difficulty(self, difficulty: np.ndarray, keep: np.ndarray | None = None) -> StageSampler:
        """The same stage's sampler ordered by `difficulty` (one per sample): a model's scores, known only once
        the model has scored the stage's rows at its entry (toolkit/train/stage_scores.py); `keep`: the samples
        a drop by those scores leaves (a mask over all of them), else this sampler's own."""
        if keep is None and self._kept is not None:
            keep = np.zeros(sum(self._settings["sizes"]), dtype=bool)
            keep[self._kept] = True
        return StageSampler(difficulty=difficulty, keep=keep, **self._settings)

    @property
    def kept(self) -> np.ndarray | None:
        """The indices of the samples a drop keeps (None: every sample): what draws outside the order pick from."""
        return self._kept

    @property
    def num_samples(self) -> int:
        """Samples in the stage (all datasets concatenated)."""
        return self._n

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch: num_samples // global_batch (for a mixture, an epoch of draws)."""
        return self._steps_per_epoch

    def competence(self, step_in_stage: int) -> float:
        """Fraction of the difficulty-sorted data available at a step (1.0 without pacing)."""
        if self._pacing is None:
            return 1.0
        return self._pacing.competence(step_in_stage / self._total_steps)

    def available(self, step_in_stage: int) -> int:
        """How many of the easiest samples a paced step draws from: ceil(competence * num_samples)."""
        c = self.competence(step_in_stage)
        return min(self._n, max(1, math.ceil(round(c * self._n, 9))))  # round: 0.1 * 1000 is 100.00000000000001

    def batch(self, step_in_stage: int) -> list[int]:
        """Global indices (into the concatenated datasets) of the global batch at a step of this stage."""
        chosen = self._batch(step_in_stage)
        return chosen if self._kept is None else self._kept[chosen].tolist()

    def _batch(self, step_in_stage: int) -> list[int]:
        k = int(step_in_stage)
        if k < 0:
            raise ValueError(f"step_in_stage must be >= 0, got {k}")
        if self._pacing is not None:
            return self._paced_batch(k)
        if self._probs is not None:
            return self._mixture_batch(k)
        epoch, j = divmod(k, self._steps_per_epoch)
        lo, hi = j * self._g, (j + 1) * self._g
        if self._order == "sequential":
            return list(range(lo, hi))
        if self._order in ORDERED:
            assert self._sorted is not None
            return self._sorted[lo:hi].tolist()
        perm = self._epochs.get((epoch,), lambda: np.random.default_rng(
            [self._seed, self._stage, epoch]).permutation(self._n))
        return perm[lo:hi].tolist()

    # --- competence-paced easy_to_hard ----------------------------------------------------------------------------

    def _paced_batch(self, k: int) -> list[int]:
        """Uniform draws from the easiest ceil(c N) samples; without replacement when the prefix allows."""
        assert self._sorted is not None
        m = self.available(k)
        rng = np.random.default_rng([self._seed, self._stage, k])
        pos = rng.choice(m, size=self._g, replace=m < self._g)
        return self._sorted[pos].tolist()

    # --- weighted mixture -----------------------------------------------------------------------------------------

    def _block_rng(self, b: int) -> np.random.Generator:
        return np.random.default_rng([self._seed, self._stage, _TAG_BLOCK, b])

    def _block_counts(self, rng: np.random.Generator) -> np.ndarray:
        """Per-dataset draws of one block: the first thing drawn from the block's RNG."""
        assert self._probs is not None
        return rng.multinomial(self._steps_per_epoch * self._g, self._probs).astype(np.int64)

    def _draws_before(self, b: int) -> np.ndarray:
        """Draws of each dataset in blocks 0..b-1, from cached cumulative counts (each block costs O(datasets))."""
        while len(self._cum_counts) <= b:
            nb = len(self._cum_counts) - 1
            self._cum_counts.append(self._cum_counts[-1] + self._block_counts(self._block_rng(nb)))
        return self._cum_counts[b]

    def _make_block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset of each position, how many earlier positions of the block chose the same dataset)."""
        rng = self._block_rng(b)
        counts = self._block_counts(rng)
        choice = rng.permutation(np.repeat(np.arange(len(counts), dtype=np.int32), counts))
        by_dataset = np.argsort(choice, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rank = np.empty(choice.size, dtype=np.int64)
        rank[by_dataset] = np.arange(choice.size, dtype=np.int64) - np.repeat(starts, counts)
        return choice, rank

    def _pass_order(self, d: int, q: int) -> np.ndarray:
        """Local order of dataset d in its q-th pass (replacement=False)."""
        if self._order == "sequential":
            return np.arange(int(self._sizes[d]), dtype=np.int64)
        if self._order in ORDERED:
            return self._local_sorted[d]
        return self._passes.get((d, q), lambda: np.random.default_rng(
            [self._seed, self._stage, _TAG_PASS, d, q]).permutation(int(self._sizes[d])))

    def _mixture_batch(self, k: int) -> list[int]:
        b, j = divmod(k, self._steps_per_epoch)
        choice, rank = self._blocks.get((b,), lambda: self._make_block(b))
        ds = choice[j * self._g:(j + 1) * self._g]
        sizes = self._sizes[ds]
        if self._replacement:
            local = np.random.default_rng([self._seed, self._stage, _TAG_DRAW, k]).integers(0, sizes)
            return (self._offsets[ds] + local).tolist()
        n_th = self._draws_before(b)[ds] + rank[j * self._g:(j + 1) * self._g]  # n-th draw from its dataset
        passes, within = np.divmod(n_th, sizes)
        local = np.empty_like(within)
        keys = ds.astype(np.int64) * (int(passes.max()) + 1) + passes
        for key in np.unique(keys).tolist():  # a handful of (dataset, pass) groups per batch
            sel = keys == key
            d, q = int(ds[sel][0]), int(passes[sel][0])
            local[sel] = self._pass_order(d, q)[within[sel]]
        return (self._offsets[ds] + local).tolist()


def _validate(*, sizes: list[int], weights: list[float] | None, replacement: bool, order: str,
              difficulty: np.ndarray | None, lengths: np.ndarray, pacing: Pacing | None, seed: int,
              stage_index: int, global_batch: int, total_steps: int) -> None:
    """Raise ToolkitError naming the offending value; everything checked before any array is built."""
    if not sizes or sum(sizes) == 0:
        raise ToolkitError(f"Stage {stage_index} is empty (dataset sizes {sizes}): give it at least one sample.")
    if any(s < 0 for s in sizes):
        raise ToolkitError(f"Stage {stage_index}: dataset sizes must be >= 0, got {sizes}.")
    n = sum(sizes)
    if global_batch < 1 or total_steps < 1:
        raise ToolkitError(f"Stage {stage_index}: global batch ({global_batch}) and total steps ({total_steps}) "
                           "must be positive.")
    if n < global_batch:
        raise ToolkitError(
            f"Stage {stage_index} has {n} samples, fewer than one global batch of {global_batch} "
            "(micro_batch_size x grad_accum x processes). Add data or lower the batch size.")
    if seed < 0 or stage_index < 0:
        raise ToolkitError(f"Seed ({seed}) and stage index ({stage_index}) must be >= 0.")
    if order not in ("shuffle", "sequential", *ORDERED):
        raise ToolkitError(f"Stage {stage_index}: order must be shuffle, sequential, easy_to_hard or hard_to_easy, "
                           f"got {order!r}.")
    if weights is not None:
        if len(weights) != len(sizes):
            raise ToolkitError(f"Stage {stage_index} has {len(sizes)} datasets but {len(weights)} weights; "
                               "give one weight per dataset.")
        for i, w in enumerate(weights):
            if not (math.isfinite(w) and w > 0):
                raise ToolkitError(f"Stage {stage_index}: weight {i} is {w}; weights must be positive numbers.")
        for i, s in enumerate(sizes):
            if s == 0:
                raise ToolkitError(f"Stage {stage_index}: dataset {i} is empty but has weight {weights[i]}; "
                                   "a mixture cannot draw from it.")
    if replacement and weights is None:
        raise ToolkitError(f"Stage {stage_index}: replacement needs weights (a mixture); a stage without weights "
                           "iterates over its data in epochs.")
    if replacement and order != "shuffle":
        raise ToolkitError(f"Stage {stage_index}: replacement draws at random, which contradicts order {order!r}; "
                           "use order shuffle or replacement false.")
    if pacing is not None:
        if order not in ORDERED:
            raise ToolkitError(f"Stage {stage_index}: pacing applies only to order easy_to_hard or hard_to_easy, "
                               f"not {order!r}.")
        if weights is not None:
            raise ToolkitError(f"Stage {stage_index}: pacing with weights (a paced mixture) is not supported; "
                               "drop the weights or the pacing.")
        if pacing.kind not in ("linear", "sqrt"):
            raise ToolkitError(f"Stage {stage_index}: pacing kind must be linear or sqrt, got {pacing.kind!r}.")
        if not (0.0 < pacing.start_fraction <= 1.0):
            raise ToolkitError(f"Stage {stage_index}: pacing start_fraction must be in (0, 1], "
                               f"got {pacing.start_fraction}.")
    if np.shape(lengths) != (n,):
        raise ToolkitError(f"Stage {stage_index}: lengths has shape {np.shape(lengths)}, expected ({n},) "
                           "(one per sample of the concatenated datasets).")
    if difficulty is not None:
        if np.shape(difficulty) != (n,):
            raise ToolkitError(f"Stage {stage_index}: difficulty has shape {np.shape(difficulty)}, expected ({n},) "
                               "(one per sample of the concatenated datasets).")
        try:
            values = np.asarray(difficulty, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ToolkitError(f"Stage {stage_index}: difficulty must be numeric ({e}).") from None
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise ToolkitError(f"Stage {stage_index}: difficulty of sample {int(bad[0])} is "
                               f"{difficulty[int(bad[0])]} ({bad.size} non-finite in all); every sample needs a "
                               "finite number.")
