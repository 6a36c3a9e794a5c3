"""Tests for toolkit/curriculum/sampling.py: pure per-step global batches for shuffle / sequential / easy-to-hard
epochs,
weighted mixtures (with and without replacement) and competence-paced curricula."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest

from toolkit.curriculum.sampling import Pacing, StageSampler
from toolkit.errors import ToolkitError

_LENGTHS = np.arange(100)[::-1] % 17  # token lengths of the default 100-sample stage (many ties)


def _sampler(sizes: list[int] | None = None, **overrides: Any) -> StageSampler:
    """Stage of 3 datasets (30 + 50 + 20 samples), shuffle, global batch 8, 100 steps; overridable."""
    sizes = sizes if sizes is not None else [30, 50, 20]
    n = sum(sizes)
    kwargs: dict[str, Any] = dict(sizes=sizes, weights=None, replacement=False, order="shuffle", difficulty=None,
                                  lengths=_LENGTHS if n == 100 else np.zeros(n), pacing=None, seed=7, stage_index=1,
                                  global_batch=8, total_steps=100)
    kwargs.update(overrides)
    return StageSampler(**kwargs)


def _dataset_of(indices: np.ndarray, sizes: list[int]) -> np.ndarray:
    return np.searchsorted(np.cumsum(sizes), indices, side="right")


# --- purity -----------------------------------------------------------------------------------------------------------

MODES: list[dict[str, Any]] = [
    dict(),
    dict(order="sequential"),
    dict(order="easy_to_hard", difficulty=np.random.default_rng(0).random(100)),
    dict(order="easy_to_hard", pacing=Pacing("sqrt", 0.2)),
    dict(weights=[1.0, 2.0, 0.5]),
    dict(weights=[1.0, 2.0, 0.5], replacement=True),
    dict(weights=[1.0, 2.0, 0.5], order="sequential"),
    dict(weights=[1.0, 2.0, 0.5], order="easy_to_hard"),
]


@pytest.mark.parametrize("mode", MODES)
def test_batch_is_pure_and_independent_of_call_order(mode: dict[str, Any]) -> None:
    a, b = _sampler(**mode), _sampler(**mode)
    steps = [500, 3, 57, 0, 499, 3, 12, 1000]
    first = {k: a.batch(k) for k in steps}
    second = {k: b.batch(k) for k in reversed(steps)}
    assert first == second
    assert all(len(v) == 8 and all(0 <= i < 100 for i in v) for v in first.values())
    assert all(isinstance(i, int) for i in first[3])


def test_seed_and_stage_index_change_the_order() -> None:
    base = [_sampler().batch(k) for k in range(5)]
    assert base != [_sampler(seed=8).batch(k) for k in range(5)]
    assert base != [_sampler(stage_index=2).batch(k) for k in range(5)]


# --- epochs without weights -------------------------------------------------------------------------------------------


def test_shuffle_epochs_are_disjoint_batches_and_differ() -> None:
    s = _sampler()
    assert s.num_samples == 100 and s.steps_per_epoch == 12
    epochs = [[i for j in range(12) for i in s.batch(e * 12 + j)] for e in range(2)]
    for flat in epochs:
        assert len(set(flat)) == len(flat) == 12 * 8  # disjoint batches
    assert epochs[0] != epochs[1]
    assert set(epochs[0]) != set(epochs[1])  # a different remainder is dropped


def test_shuffle_matches_the_per_epoch_seeded_permutation() -> None:
    """Same order as curriculum.global_batch_indices: permutation seeded by [seed, stage_index, epoch]."""
    s = _sampler()
    perm = np.random.default_rng([7, 1, 3]).permutation(100)
    assert s.batch(3 * 12 + 5) == perm[40:48].tolist()


def test_sequential_is_file_order_every_epoch() -> None:
    s = _sampler(order="sequential")
    assert [s.batch(k) for k in range(12)] == [list(range(8 * k, 8 * k + 8)) for k in range(12)]
    assert s.batch(12) == list(range(8)) and s.batch(25) == list(range(8, 16))


def test_easy_to_hard_without_pacing_is_nondecreasing_every_epoch() -> None:
    difficulty = np.random.default_rng(1).integers(0, 10, size=100).astype(float)  # many ties
    s = _sampler(order="easy_to_hard", difficulty=difficulty)
    assert s.competence(0) == 1.0 and s.competence(99) == 1.0
    epoch = [i for k in range(12) for i in s.batch(k)]
    assert np.all(np.diff(difficulty[epoch]) >= 0)
    expected = np.lexsort((np.arange(100), difficulty))[:96]  # ties broken by index
    assert epoch == expected.tolist()
    assert [i for k in range(12, 24) for i in s.batch(k)] == epoch


def test_hard_to_easy_is_the_hardest_first_ties_by_index_paced_or_not() -> None:
    difficulty = np.random.default_rng(1).integers(0, 10, size=100).astype(float)  # many ties
    s = _sampler(order="hard_to_easy", difficulty=difficulty)
    epoch = [i for k in range(12) for i in s.batch(k)]
    assert epoch == np.lexsort((np.arange(100), -difficulty))[:96].tolist()
    assert np.all(np.diff(difficulty[epoch]) <= 0)
    paced = _sampler(order="hard_to_easy", difficulty=difficulty, pacing=Pacing("linear", 0.2))
    first = paced.batch(0)  # competence 0.2: the hardest fifth only
    assert set(first) <= set(np.lexsort((np.arange(100), -difficulty))[:20].tolist())
    mixed = _sampler(order="hard_to_easy", difficulty=difficulty, weights=[1.0, 2.0, 0.5])
    drawn = [i for k in range(3) for i in mixed.batch(k)]
    for lo, hi in ((0, 30), (30, 80), (80, 100)):  # each dataset walked hardest first
        own = [i for i in drawn if lo <= i < hi]
        assert np.all(np.diff(difficulty[own]) <= 0)


def test_with_difficulty_is_the_same_stage_sampled_over_new_scores() -> None:
    """A model's scores arrive at the stage's entry: the sampler built over lengths, then given them, is the one
    built over them from the start (pacing and mixture included)."""
    scores = np.random.default_rng(2).random(100)
    for settings in ({}, {"pacing": Pacing("sqrt", 0.3)}, {"weights": [1.0, 2.0, 0.5]}):
        later = _sampler(order="easy_to_hard", difficulty=None, **settings).with_difficulty(scores)
        built = _sampler(order="easy_to_hard", difficulty=scores, **settings)
        assert [later.batch(k) for k in range(8)] == [built.batch(k) for k in range(8)]
    with pytest.raises(ToolkitError, match="difficulty"):
        _sampler(order="easy_to_hard", difficulty=None).with_difficulty(np.full(100, np.nan))


def test_a_kept_mask_is_the_stage_sampled_over_its_kept_samples_alone() -> None:
    """A drop by a model's scores: the sampler given `keep` draws only kept samples, exactly as a sampler built
    over the kept samples alone (each dataset's size its kept count) with its indices mapped back; `with_difficulty`
    keeps the mask unless given another."""
    rng = np.random.default_rng(5)
    scores = rng.random(100)
    keep = rng.random(100) > 0.2
    kept = np.flatnonzero(keep)
    sizes = [int(keep[0:30].sum()), int(keep[30:80].sum()), int(keep[80:100].sum())]
    for settings in ({}, {"order": "sequential"}, {"order": "easy_to_hard", "difficulty": scores},
                     {"order": "hard_to_easy", "difficulty": scores, "pacing": Pacing("linear", 0.5)},
                     {"weights": [1.0, 2.0, 0.5]}, {"weights": [1.0, 2.0, 0.5], "replacement": True}):
        masked = _sampler(keep=keep, **settings)
        sub = dict(settings)
        if "difficulty" in sub:
            sub["difficulty"] = scores[keep]
        alone = _sampler(sizes, **sub, lengths=_LENGTHS[keep])
        assert masked.num_samples == len(kept) == alone.num_samples
        assert [masked.batch(k) for k in range(12)] == [kept[alone.batch(k)].tolist() for k in range(12)], settings
    later = _sampler(order="easy_to_hard", keep=keep).with_difficulty(scores)
    assert set(i for k in range(later.steps_per_epoch) for i in later.batch(k)) <= set(kept.tolist())
    assert later.batch(0) == kept[np.argsort(scores[keep], kind="stable")][:8].tolist()


def test_easy_to_hard_without_difficulty_sorts_by_length() -> None:
    lengths = np.random.default_rng(2).integers(1, 500, size=100)
    s = _sampler(order="easy_to_hard", lengths=lengths)
    epoch = [i for k in range(12) for i in s.batch(k)]
    assert epoch == np.lexsort((np.arange(100), lengths))[:96].tolist()


# --- mixtures ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replacement", [False, True])
def test_mixture_fractions_follow_the_weights(replacement: bool) -> None:
    sizes, weights = [3000, 5000, 2000], [1.0, 3.0, 4.0]
    s = _sampler(sizes, weights=weights, replacement=replacement, lengths=np.zeros(10_000), global_batch=100)
    drawn = np.array([i for k in range(100) for i in s.batch(k)])
    frac = np.bincount(_dataset_of(drawn, sizes), minlength=3) / drawn.size
    p = np.array(weights) / sum(weights)
    assert np.all(np.abs(frac - p) <= 3 * np.sqrt(p * (1 - p) / drawn.size))


def test_mixture_without_replacement_exhausts_each_dataset_before_repeating() -> None:
    sizes = [30, 50, 20]
    s = _sampler(sizes, weights=[1.0, 1.0, 1.0])  # 12 steps per block: walks cross block and pass boundaries
    drawn = np.array([i for k in range(60) for i in s.batch(k)])
    ds = _dataset_of(drawn, sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for d, size in enumerate(sizes):
        mine = drawn[ds == d]
        assert mine.size >= 2 * size
        for p in range(mine.size // size):  # every full pass is a permutation of the dataset
            assert sorted(mine[p * size:(p + 1) * size].tolist()) == list(range(offsets[d], offsets[d] + size))
        assert mine[:size].tolist() != mine[size:2 * size].tolist()  # a new permutation each pass


def test_mixture_with_replacement_repeats() -> None:
    s = _sampler([30, 50, 20], weights=[1.0, 1.0, 1.0], replacement=True)
    drawn = [i for k in range(4) for i in s.batch(k)]
    assert len(set(drawn)) < len(drawn)


def test_mixture_sequential_and_easy_to_hard_walk_each_dataset_in_order() -> None:
    sizes = [30, 50, 20]
    seq = _sampler(sizes, weights=[2.0, 1.0, 1.0], order="sequential")
    drawn = np.array([i for k in range(30) for i in seq.batch(k)])
    ds = _dataset_of(drawn, sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for d, size in enumerate(sizes):
        mine = drawn[ds == d]
        assert mine.tolist() == (offsets[d] + np.arange(mine.size) % size).tolist()
    difficulty = np.random.default_rng(3).random(100)
    e2h = _sampler(sizes, weights=[2.0, 1.0, 1.0], order="easy_to_hard", difficulty=difficulty)
    drawn = np.array([i for k in range(12) for i in e2h.batch(k)])
    for d in range(3):
        mine = drawn[_dataset_of(drawn, sizes) == d][:sizes[d]]
        assert np.all(np.diff(difficulty[mine]) >= 0)


# --- competence pacing ------------------------------------------------------------------------------------------------


def test_competence_curves() -> None:
    lin = _sampler(order="easy_to_hard", pacing=Pacing("linear", 0.2), total_steps=100)
    sq = _sampler(order="easy_to_hard", pacing=Pacing("sqrt", 0.2), total_steps=100)
    assert lin.competence(0) == pytest.approx(0.2) and sq.competence(0) == pytest.approx(0.2)
    assert lin.competence(25) == pytest.approx(0.2 + 0.8 * 0.25)
    assert sq.competence(25) == pytest.approx(math.sqrt(0.04 + 0.96 * 0.25))
    assert lin.competence(100) == 1.0 and sq.competence(100) == 1.0 and sq.competence(10**6) == 1.0
    assert lin.competence(99) < 1.0 and lin.available(99) == 100  # ceil(0.992 * 100)
    assert sq.competence(25) > lin.competence(25)  # sqrt opens the data faster early on


@pytest.mark.parametrize("kind", ["linear", "sqrt"])
def test_paced_batches_stay_in_the_easy_prefix_and_get_harder(kind: str) -> None:
    n = 1000
    difficulty = np.random.default_rng(4).random(n)
    s = _sampler([400, 600], order="easy_to_hard", difficulty=difficulty, lengths=np.zeros(n),
                 pacing=Pacing(kind, 0.1), global_batch=32, total_steps=200)
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(difficulty, kind="stable")] = np.arange(n)
    for k in range(0, 200, 7):
        b = s.batch(k)
        assert len(set(b)) == 32  # prefix >= global batch: no repeats within the batch
        assert rank[b].max() < math.ceil(s.competence(k) * n - 1e-9)
    early = np.mean([difficulty[s.batch(k)].mean() for k in range(10)])
    late = np.mean([difficulty[s.batch(k)].mean() for k in range(190, 200)])
    assert early < late


def test_paced_prefix_smaller_than_batch_draws_with_replacement() -> None:
    s = _sampler(order="easy_to_hard", pacing=Pacing("linear", 0.05), global_batch=8)  # 5 samples available
    b = s.batch(0)
    assert len(b) == 8 and len(set(b)) <= 5
    assert set(b) <= set(np.lexsort((np.arange(100), _LENGTHS)).tolist()[:5])


# --- validation -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(weights=[1.0, 0.0, 1.0]), "weight 1"),
    (dict(weights=[1.0, -2.0, 1.0]), "weight 1"),
    (dict(weights=[1.0, 1.0]), "3 datasets but 2 weights"),
    (dict(pacing=Pacing("linear", 0.5)), "easy_to_hard"),
    (dict(order="sequential", pacing=Pacing("linear", 0.5)), "easy_to_hard"),
    (dict(order="easy_to_hard", pacing=Pacing("linear", 0.0)), "start_fraction"),
    (dict(order="easy_to_hard", pacing=Pacing("sqrt", 1.5)), "start_fraction"),
    (dict(order="easy_to_hard", pacing=Pacing("linear", 0.5), weights=[1.0, 1.0, 1.0]), "not supported"),
    (dict(order="easy_to_hard", difficulty=np.where(np.arange(100) == 42, np.nan, 1.0)), "sample 42"),
    (dict(sizes=[]), "empty"),
    (dict(sizes=[0, 0], lengths=np.zeros(0)), "empty"),
    (dict(global_batch=101), "100 samples, fewer than one global batch of 101"),
    (dict(replacement=True), "needs weights"),
    (dict(replacement=True, weights=[1.0, 1.0, 1.0], order="sequential"), "contradicts"),
    (dict(lengths=np.zeros(99)), "lengths"),
    (dict(difficulty=np.zeros(3)), "difficulty"),
])
def test_invalid_configuration_raises(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ToolkitError, match=message):
        _sampler(**overrides)


# --- performance ------------------------------------------------------------------------------------------------------


def test_large_mixture_step_is_fast() -> None:
    sizes = [500_000, 300_000, 200_000]
    s = _sampler(sizes, weights=[1.0, 1.0, 2.0], lengths=np.zeros(1_000_000), global_batch=64,
                 total_steps=100_000)
    t0 = time.perf_counter()
    b = s.batch(90_000)
    assert time.perf_counter() - t0 < 5.0
    assert len(set(b)) == 64 and s.batch(90_000) == b
