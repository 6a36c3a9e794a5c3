"""Tests for toolkit/curriculum/stages.py: stage layout, step lookup, seeded batches
(toolkit.curriculum.sampling.StageSampler in shuffle
mode), rank split and per-stage LR schedules (cosine, linear, constant, wsd, continue)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup, get_wsd_schedule

from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.curriculum.sampling import StageSampler
from toolkit.curriculum.stages import (
    Curriculum,
    Patience,
    StagePlan,
    apply_stage_steps,
    build_curriculum,
    build_lr_lambda,
    end_stage_early,
    locate,
    plan_stages,
    rank_micro_batches,
    samples_seen,
)
from toolkit.data.encoding import DataStats
from toolkit.data.plan import TrainingSet
from toolkit.errors import ToolkitError


def _two_stages(**overrides) -> list[StagePlan]:
    """Stage 'a': 100 samples, 2 epochs of 12 steps; stage 'b': 50 samples, max_steps 5 (global batch 2 x 2 x 2)."""
    kwargs = dict(micro_batches=[2, 2], grad_accum=2, world_size=2, epochs=[2, None], max_steps=[None, 5],
                  lrs=[1e-3, 5e-4], warmup_ratios=[0.1, 0.2], min_lr_ratios=[0.1, 0.0], schedules=["cosine"] * 2)
    kwargs.update(overrides)
    return plan_stages(["a", "b"], [100, 50], **kwargs)


def _one_stage(n: int, global_batch: int, *, epochs: float | None = None, max_steps: int | None = None,
               lr: float = 1.0, warmup_ratio: float = 0.0, min_lr_ratio: float = 0.0, schedule: str = "cosine",
               decay_ratio: float = 0.1) -> StagePlan:
    (plan,) = plan_stages(["s"], [n], micro_batches=[global_batch], grad_accum=1, world_size=1, epochs=[epochs],
                          max_steps=[max_steps], lrs=[lr], warmup_ratios=[warmup_ratio],
                          min_lr_ratios=[min_lr_ratio], schedules=[schedule], decay_ratio=decay_ratio)
    return plan


def global_batch_indices(plan: StagePlan, step_in_stage: int, *, seed: int) -> list[int]:
    """The stage's global batch at a step: StageSampler in shuffle mode without weights (the removed API's role)."""
    sampler = StageSampler(sizes=[plan.num_samples], weights=None, replacement=False, order="shuffle",
                           difficulty=None, lengths=np.ones(plan.num_samples), pacing=None, seed=seed,
                           stage_index=plan.index, global_batch=plan.global_batch, total_steps=plan.steps)
    return sampler.batch(step_in_stage)


# --- plan_stages ---------------------------------------------------------------------------------------------------


def test_plan_two_stages_exact() -> None:
    a, b = _two_stages()
    assert a == StagePlan(index=0, name="a", num_samples=100, steps=24, start_step=0, lr=1e-3, warmup_steps=3,
                          min_lr_ratio=0.1, global_batch=8, micro_batch=2, steps_per_epoch=12, schedule="cosine",
                          decay_ratio=0.1)
    assert b == StagePlan(index=1, name="b", num_samples=50, steps=5, start_step=24, lr=5e-4, warmup_steps=1,
                          min_lr_ratio=0.0, global_batch=8, micro_batch=2, steps_per_epoch=6, schedule="cosine",
                          decay_ratio=0.1)
    assert (a.end_step, b.end_step) == (24, 29)


def test_plan_default_is_one_epoch() -> None:
    plan = _one_stage(100, 8)
    assert (plan.steps, plan.steps_per_epoch, plan.start_step, plan.end_step) == (12, 12, 0, 12)


def test_plan_max_steps_beyond_an_epoch() -> None:
    plan = _one_stage(20, 8, max_steps=7)
    assert (plan.steps, plan.steps_per_epoch) == (7, 2)


@pytest.mark.parametrize(("epochs", "steps"), [(0.5, 6), (1.25, 15), (2.75, 33), (0.01, 1)])
def test_plan_fractional_epochs(epochs: float, steps: int) -> None:
    plan = _one_stage(100, 8, epochs=epochs)  # 12 steps per epoch
    assert plan.steps == steps
    assert plan.steps_per_epoch == 12


def test_plan_three_stages_are_contiguous() -> None:
    plans = plan_stages(["x", "y", "z"], [16, 40, 9], micro_batches=[2, 2, 2], grad_accum=2, world_size=1,
                        epochs=[1, 0.5, None], max_steps=[None, None, 3], lrs=[1.0, 2.0, 3.0],
                        warmup_ratios=[0.0] * 3, min_lr_ratios=[0.0] * 3, schedules=["cosine"] * 3)
    assert [(p.index, p.start_step, p.steps, p.end_step, p.steps_per_epoch) for p in plans] == [
        (0, 0, 4, 4, 4), (1, 4, 5, 9, 10), (2, 9, 3, 12, 2)]


def test_plan_warmup_steps_round_up() -> None:
    assert _one_stage(100, 8, warmup_ratio=0.0).warmup_steps == 0
    assert _one_stage(100, 8, warmup_ratio=0.05).warmup_steps == 1  # 0.6 -> 1
    assert _one_stage(100, 8, warmup_ratio=0.25).warmup_steps == 3  # exactly 3
    assert _one_stage(100, 8, max_steps=40, warmup_ratio=0.1).warmup_steps == 4


def test_plan_warmup_steps_exact_product_is_not_rounded_up() -> None:
    assert _one_stage(1000, 10, max_steps=100, warmup_ratio=0.07).warmup_steps == 7


def test_plan_stage_smaller_than_global_batch_is_error() -> None:
    with pytest.raises(ToolkitError, match=r"Stage 'tiny' has 7 usable samples, fewer than one global batch of 8"):
        plan_stages(["big", "tiny"], [100, 7], micro_batches=[2, 2], grad_accum=2, world_size=2, epochs=[None, None],
                    max_steps=[None, None], lrs=[1.0, 1.0], warmup_ratios=[0.0, 0.0], min_lr_ratios=[0.0, 0.0],
                    schedules=["cosine"] * 2)


def test_plan_stage_of_exactly_one_global_batch() -> None:
    plan = _one_stage(8, 8, epochs=3)
    assert (plan.steps, plan.steps_per_epoch) == (3, 1)


def test_plan_per_stage_micro_batches() -> None:
    # Global batch of a stage = its micro batch x grad_accum x world: a 2 x 2 x 2 = 8, b 4 x 2 x 2 = 16.
    a, b = plan_stages(["a", "b"], [100, 100], micro_batches=[2, 4], grad_accum=2, world_size=2, epochs=[1, 2],
                       max_steps=[None, None], lrs=[1.0, 1.0], warmup_ratios=[0.25, 0.25], min_lr_ratios=[0.0, 0.0],
                       schedules=["cosine"] * 2)
    assert (a.micro_batch, a.global_batch, a.steps_per_epoch, a.steps, a.start_step) == (2, 8, 12, 12, 0)
    assert (b.micro_batch, b.global_batch, b.steps_per_epoch, b.steps, b.start_step) == (4, 16, 6, 12, 12)
    assert (a.warmup_steps, b.warmup_steps) == (3, 3)
    # Each stage's batches have its own size and split exactly into its own micro batches on every rank.
    for plan in (a, b):
        indices = global_batch_indices(plan, 1, seed=0)
        assert len(indices) == plan.global_batch
        split = [rank_micro_batches(indices, rank=r, world_size=2, micro_batch_size=plan.micro_batch, grad_accum=2)
                 for r in range(2)]
        assert all(len(mb) == plan.micro_batch for micro in split for mb in micro)
        assert sorted(i for micro in split for mb in micro for i in mb) == sorted(indices)


def test_plan_larger_micro_batch_of_later_stage_needs_more_data() -> None:
    with pytest.raises(ToolkitError, match=r"Stage 'b' has 12 usable samples, fewer than one global batch of 16"):
        plan_stages(["a", "b"], [12, 12], micro_batches=[2, 4], grad_accum=2, world_size=2, epochs=[None, None],
                    max_steps=[None, None], lrs=[1.0, 1.0], warmup_ratios=[0.0, 0.0], min_lr_ratios=[0.0, 0.0],
                    schedules=["cosine"] * 2)


def test_plan_records_schedule_and_decay_ratio() -> None:
    plans = _two_stages(schedules=["wsd", "continue"], decay_ratio=0.25)
    assert [(p.schedule, p.decay_ratio) for p in plans] == [("wsd", 0.25), ("continue", 0.25)]


# --- locate ------------------------------------------------------------------------------------------------------


def test_locate_boundaries() -> None:
    a, b = _two_stages()
    assert locate([a, b], 0) == (a, 0)
    assert locate([a, b], 23) == (a, 23)  # last step of stage 0
    assert locate([a, b], 24) == (b, 0)   # first step of stage 1
    assert locate([a, b], 28) == (b, 4)   # last step of stage 1
    assert locate([a, b], 29) == (b, 4)   # past the end: last stage's last step
    assert locate([a, b], 10_000) == (b, 4)


# --- global batches (StageSampler, shuffle without weights) ------------------------------------------------------


def test_batches_within_epoch_are_disjoint_and_cover() -> None:
    plan = _one_stage(100, 8, epochs=2)  # 12 steps per epoch, 96 of 100 samples used per epoch
    for epoch in range(2):
        batches = [global_batch_indices(plan, epoch * 12 + k, seed=3) for k in range(12)]
        assert all(len(b) == 8 for b in batches)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat) == 12 * 8
        assert set(flat) <= set(range(100))


def test_new_epoch_is_a_different_permutation() -> None:
    plan = _one_stage(100, 8, epochs=2)
    epoch0 = [i for k in range(12) for i in global_batch_indices(plan, k, seed=3)]
    epoch1 = [i for k in range(12, 24) for i in global_batch_indices(plan, k, seed=3)]
    assert epoch0 != epoch1
    assert global_batch_indices(plan, 0, seed=3) != global_batch_indices(plan, 12, seed=3)


def test_batches_are_deterministic_and_seed_dependent() -> None:
    plan = _one_stage(100, 8, epochs=2)
    for step in (0, 5, 13):
        assert global_batch_indices(plan, step, seed=11) == global_batch_indices(plan, step, seed=11)
    assert global_batch_indices(plan, 0, seed=11) != global_batch_indices(plan, 0, seed=12)
    # Rebuilding the identical plan (e.g. after a resume) gives the same batches.
    assert global_batch_indices(_one_stage(100, 8, epochs=2), 7, seed=11) == global_batch_indices(plan, 7, seed=11)


def test_batches_differ_between_stages_of_same_size() -> None:
    plans = plan_stages(["p", "q"], [64, 64], micro_batches=[8, 8], grad_accum=1, world_size=1, epochs=[None, None],
                        max_steps=[None, None], lrs=[1.0, 1.0], warmup_ratios=[0.0, 0.0], min_lr_ratios=[0.0, 0.0],
                        schedules=["cosine"] * 2)
    assert global_batch_indices(plans[0], 0, seed=0) != global_batch_indices(plans[1], 0, seed=0)


def test_batches_full_epoch_when_size_is_multiple() -> None:
    plan = _one_stage(64, 8)
    flat = [i for k in range(8) for i in global_batch_indices(plan, k, seed=0)]
    assert sorted(flat) == list(range(64))


def test_batches_are_the_seeded_epoch_permutation() -> None:
    # The removed global_batch_indices: batch k = slice k % steps_per_epoch of the permutation seeded by
    # [seed, stage index, epoch]. The sampler must reproduce it exactly (same data order as before the rewrite).
    a, b = _two_stages()
    for plan in (a, b):
        for k in (0, 5, plan.steps_per_epoch, plan.steps - 1):
            epoch, j = divmod(k, plan.steps_per_epoch)
            perm = np.random.default_rng([7, plan.index, epoch]).permutation(plan.num_samples)
            g = plan.global_batch
            assert global_batch_indices(plan, k, seed=7) == perm[j * g:(j + 1) * g].tolist()


# --- rank_micro_batches ------------------------------------------------------------------------------------------


def test_rank_split_exact_layout() -> None:
    indices = list(range(100, 112))  # world 2 x micro 2 x accum 3
    r0 = rank_micro_batches(indices, rank=0, world_size=2, micro_batch_size=2, grad_accum=3)
    r1 = rank_micro_batches(indices, rank=1, world_size=2, micro_batch_size=2, grad_accum=3)
    assert r0 == [[100, 101], [104, 105], [108, 109]]
    assert r1 == [[102, 103], [106, 107], [110, 111]]
    for r, micro in ((0, r0), (1, r1)):
        for j, mb in enumerate(micro):
            s = j * 2 + r
            assert mb == indices[s * 2:(s + 1) * 2]


def test_two_rank_split_covers_same_global_batch_as_one_rank() -> None:
    plan = _one_stage(100, 16)
    indices = global_batch_indices(plan, 3, seed=5)
    single = rank_micro_batches(indices, rank=0, world_size=1, micro_batch_size=2, grad_accum=8)
    assert [i for mb in single for i in mb] == indices
    two = [i for r in range(2)
           for mb in rank_micro_batches(indices, rank=r, world_size=2, micro_batch_size=2, grad_accum=4) for i in mb]
    assert len(two) == 16
    assert sorted(two) == sorted(indices)
    four = [i for r in range(4)
            for mb in rank_micro_batches(indices, rank=r, world_size=4, micro_batch_size=4, grad_accum=1) for i in mb]
    assert sorted(four) == sorted(indices)


# --- build_lr_lambda ---------------------------------------------------------------------------------------------


def _cosine_min_lr(k: int, warmup: int, total: int, min_rate: float) -> float:
    """transformers' _get_cosine_schedule_with_warmup_lr_lambda (num_cycles=0.5) with min_lr_rate."""
    if k < warmup:
        return k / max(1, warmup)
    progress = (k - warmup) / max(1, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0.0, factor * (1 - min_rate) + min_rate)


def test_cosine_schedule_per_stage() -> None:
    a, b = _two_stages()  # a: 24 steps, warmup 3, peak 1e-3, floor 0.1; b: 5 steps, warmup 1, peak 5e-4, floor 0
    lr = build_lr_lambda([a, b], "cosine")
    assert lr(0) == 0.0
    assert lr(1) == pytest.approx(1e-3 / 3)
    assert lr(2) == pytest.approx(2e-3 / 3)
    assert lr(3) == pytest.approx(1e-3)  # end of warmup: the stage's peak
    last_a = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 20 / 21)))
    assert lr(23) == pytest.approx(last_a, rel=1e-12)
    assert lr(23) == pytest.approx(1e-3 * _cosine_min_lr(23, 3, 24, 0.1), rel=1e-12)
    assert 1e-4 < lr(23) < 1.1e-4  # close to peak * min_lr_ratio
    # Stage b restarts its own warmup from its own peak.
    assert lr(24) == 0.0
    assert lr(25) == pytest.approx(5e-4)
    assert lr(28) == pytest.approx(5e-4 * 0.5 * (1 + math.cos(math.pi * 3 / 4)), rel=1e-12)
    for step in range(24):
        assert lr(step) == pytest.approx(1e-3 * _cosine_min_lr(step, 3, 24, 0.1), rel=1e-12, abs=0)
    for k in range(5):
        assert lr(24 + k) == pytest.approx(5e-4 * _cosine_min_lr(k, 1, 5, 0.0), rel=1e-12, abs=0)
    # Past the end: the last step's value.
    assert lr(100) == lr(28)


def test_cosine_is_monotone_after_warmup() -> None:
    lr = build_lr_lambda(_two_stages(), "cosine")
    values = [lr(s) for s in range(3, 24)]
    assert all(x > y for x, y in itertools.pairwise(values))


def test_cosine_without_warmup_starts_at_peak() -> None:
    plan = _one_stage(100, 8, lr=2e-4, warmup_ratio=0.0, min_lr_ratio=0.5)  # 12 steps
    lr = build_lr_lambda([plan], "cosine")
    assert plan.warmup_steps == 0
    assert lr(0) == pytest.approx(2e-4)
    assert lr(11) == pytest.approx(2e-4 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * 11 / 12))), rel=1e-12)


def test_cosine_matches_transformers_function() -> None:
    a, b = _two_stages()
    lr = build_lr_lambda([a, b], "cosine")
    for plan in (a, b):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=plan.lr)
        sched = get_cosine_with_min_lr_schedule_with_warmup(opt, plan.warmup_steps, plan.steps,
                                                             min_lr_rate=plan.min_lr_ratio)
        for k in range(plan.steps):
            assert lr(plan.start_step + k) == pytest.approx(plan.lr * sched.lr_lambdas[0](k), rel=1e-12, abs=0)


def test_linear_schedule_per_stage() -> None:
    a, b = _two_stages(schedules=["linear"] * 2)
    lr = build_lr_lambda([a, b], "linear")
    assert lr(0) == 0.0
    assert lr(3) == pytest.approx(1e-3)
    assert lr(13) == pytest.approx(1e-3 * 11 / 21)
    assert lr(23) == pytest.approx(1e-3 / 21)  # (24 - 23) / (24 - 3)
    assert lr(24) == 0.0
    assert lr(25) == pytest.approx(5e-4)
    assert lr(28) == pytest.approx(5e-4 / 4)


def test_constant_schedule_per_stage() -> None:
    a, b = _two_stages(schedules=["constant"] * 2)
    lr = build_lr_lambda([a, b], "constant")
    assert [lr(s) for s in (0, 1, 2)] == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3])
    assert [lr(s) for s in range(3, 24)] == pytest.approx([1e-3] * 21)
    assert lr(24) == 0.0
    assert [lr(s) for s in range(25, 29)] == pytest.approx([5e-4] * 4)


def test_lr_lambda_drives_lambda_lr() -> None:
    plans = _two_stages()
    lr_at = build_lr_lambda(plans, "cosine")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    seen = []
    for _ in range(29):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s) for s in range(29)])


def test_schedule_per_stage_may_differ() -> None:
    a, b = _two_stages(schedules=["linear", "constant"])
    lr = build_lr_lambda([a, b], "cosine")  # the default kind does not override a stage's own schedule
    assert lr(13) == pytest.approx(1e-3 * 11 / 21)
    assert lr(23) == pytest.approx(1e-3 / 21)
    assert lr(24) == 0.0
    assert [lr(s) for s in range(25, 29)] == pytest.approx([5e-4] * 4)


def test_stage_without_schedule_uses_default_kind() -> None:
    a, b = _two_stages(schedules=[None, "cosine"])
    lr = build_lr_lambda([a, b], "linear")
    assert lr(13) == pytest.approx(1e-3 * 11 / 21)
    assert lr(26) == pytest.approx(5e-4 * _cosine_min_lr(2, 1, 5, 0.0), rel=1e-12)


def test_wsd_warmup_stable_decay() -> None:
    # 100 steps: warmup 10, decay round(0.2 * 100) = 20, so stable on [10, 80) and decay on [80, 100); the
    # decay's first step has progress 0, so it is still exactly the peak.
    plan = _one_stage(1000, 10, max_steps=100, lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1, schedule="wsd",
                      decay_ratio=0.2)
    assert (plan.steps, plan.warmup_steps) == (100, 10)
    lr = build_lr_lambda([plan], "cosine")
    warmup = [lr(s) for s in range(11)]
    assert warmup[0] == pytest.approx(1e-4)  # transformers' wsd warms up from min_lr_ratio * peak
    assert all(x < y for x, y in itertools.pairwise(warmup))
    assert [lr(s) for s in range(10, 81)] == [1e-3] * 71  # the stable phase is exactly the peak
    decay = [lr(s) for s in range(80, 100)]
    assert all(x > y for x, y in itertools.pairwise(decay))
    assert lr(99) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 19 / 20))), rel=1e-12)
    assert 1e-4 < lr(99) < 1.06e-4  # within 6% of min_lr_ratio * peak at the last step (reached after it)
    assert lr(1000) == lr(99)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    ref = get_wsd_schedule(opt, num_warmup_steps=10, num_decay_steps=20, num_training_steps=100, min_lr_ratio=0.1)
    for k in range(100):
        assert lr(k) == pytest.approx(1e-3 * ref.lr_lambdas[0](k), rel=1e-12, abs=0)


@pytest.mark.parametrize(("steps", "decay_ratio", "decay_steps"), [(24, 0.1, 2), (10, 0.25, 2), (12, 0.25, 3),
                                                                   (40, 0.1, 4)])
def test_wsd_decay_steps_are_rounded(steps: int, decay_ratio: float, decay_steps: int) -> None:
    plan = _one_stage(100, 4, max_steps=steps, lr=1.0, min_lr_ratio=0.0, schedule="wsd", decay_ratio=decay_ratio)
    lr = build_lr_lambda([plan], "cosine")
    values = [lr(s) for s in range(steps)]
    # No warmup: the peak from step 0 through the decay's first step (progress 0), then strictly below it.
    assert values[:steps - decay_steps + 1] == [1.0] * (steps - decay_steps + 1)
    assert all(v < 1.0 for v in values[steps - decay_steps + 1:])
    last = 0.5 * (1 + math.cos(math.pi * (decay_steps - 1) / decay_steps))
    assert values[-1] == pytest.approx(last, rel=1e-12)


def test_wsd_per_stage_restarts() -> None:
    a, b = _two_stages(schedules=["wsd", "wsd"], decay_ratio=0.25)  # a: 24 steps, 6 decay; b: 5 steps, 1 decay
    lr = build_lr_lambda([a, b], "cosine")
    for plan, decay in ((a, 6), (b, 1)):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        ref = get_wsd_schedule(opt, num_warmup_steps=plan.warmup_steps, num_decay_steps=decay,
                               num_training_steps=plan.steps, min_lr_ratio=plan.min_lr_ratio)
        for k in range(plan.steps):
            assert lr(plan.start_step + k) == pytest.approx(plan.lr * ref.lr_lambdas[0](k), rel=1e-12, abs=0)
    assert lr(24) == 0.0  # stage b restarts its warmup (min_lr_ratio 0) ...
    assert lr(25) == 5e-4  # ... up to its own peak


def _three_stages_with_continue(schedules: list[str]) -> list[StagePlan]:
    """a: 24 steps (warmup 3, peak 1e-3, floor 0.1); b: 12 steps; c: 5 steps (warmup 1, peak 2e-4); batch 8."""
    return plan_stages(["a", "b", "c"], [100, 100, 50], micro_batches=[2, 2, 2], grad_accum=2, world_size=2,
                       epochs=[2, 1, None], max_steps=[None, None, 5], lrs=[1e-3, 5e-4, 2e-4],
                       warmup_ratios=[0.1, 0.2, 0.2], min_lr_ratios=[0.1, 0.0, 0.0], schedules=schedules,
                       decay_ratio=0.25)


def test_continue_extends_previous_cosine() -> None:
    a, b, c = plans = _three_stages_with_continue(["cosine", "continue", "cosine"])
    assert (a.steps, b.steps, c.steps, b.start_step, c.start_step) == (24, 12, 5, 24, 36)
    lr = build_lr_lambda(plans, "cosine")
    # Stages a and b form one cosine over 36 steps from a's peak, warmup and floor (b's own lr / warmup ignored).
    for step in range(36):
        assert lr(step) == pytest.approx(1e-3 * _cosine_min_lr(step, 3, 36, 0.1), rel=1e-12, abs=0)
    assert lr(24) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 21 / 33))), rel=1e-12)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    ref = get_cosine_with_min_lr_schedule_with_warmup(opt, 3, 36, min_lr_rate=0.1)
    assert [lr(s) for s in range(36)] == pytest.approx([1e-3 * ref.lr_lambdas[0](k) for k in range(36)], rel=1e-12)
    # No re-warmup at the boundary: strictly decreasing from a's peak through the last step of b.
    values = [lr(s) for s in range(3, 36)]
    assert all(x > y for x, y in itertools.pairwise(values))
    assert lr(23) > lr(24) > lr(25)
    # Stage c (not continue) restarts with its own warmup and peak.
    assert lr(36) == 0.0
    assert lr(37) == pytest.approx(2e-4)
    for k in range(5):
        assert lr(36 + k) == pytest.approx(2e-4 * _cosine_min_lr(k, 1, 5, 0.0), rel=1e-12, abs=0)


def test_continue_chain_spans_all_following_continues() -> None:
    plans = _three_stages_with_continue(["cosine", "continue", "continue"])
    lr = build_lr_lambda(plans, "cosine")
    for step in range(41):
        assert lr(step) == pytest.approx(1e-3 * _cosine_min_lr(step, 3, 41, 0.1), rel=1e-12, abs=0)
    assert lr(1000) == lr(40)


def test_continue_wsd_decays_over_the_combined_length() -> None:
    # a (wsd) + b (continue): one wsd over 36 steps, decay round(0.25 * 36) = 9 steps, all inside stage b.
    plans = _three_stages_with_continue(["wsd", "continue", "cosine"])
    lr = build_lr_lambda(plans, "cosine")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    ref = get_wsd_schedule(opt, num_warmup_steps=3, num_decay_steps=9, num_training_steps=36, min_lr_ratio=0.1)
    for k in range(36):
        assert lr(k) == pytest.approx(1e-3 * ref.lr_lambdas[0](k), rel=1e-12, abs=0)
    assert [lr(s) for s in range(3, 28)] == [1e-3] * 25  # stable through the boundary into b (decay from 27)
    assert lr(28) < 1e-3
    assert lr(36) == 0.0


# --- early stage advance (eval patience) ----------------------------------------------------------------------------

def _three_stages() -> list[StagePlan]:
    """Stages of 10, 6 and 4 steps (global batch 4), each with its own cosine schedule and warmup."""
    return plan_stages(["a", "b", "c"], [40, 24, 16], micro_batches=[2, 2, 2], grad_accum=1, world_size=2,
                       epochs=[None, None, None], max_steps=[10, 6, 4], lrs=[1e-3, 5e-4, 2e-4],
                       warmup_ratios=[0.2, 0.2, 0.0], min_lr_ratios=[0.1] * 3, schedules=["cosine"] * 3)


def test_end_stage_early_moves_later_stages_up() -> None:
    plans = _three_stages()
    cut = end_stage_early(plans, 0, 3)
    assert [(p.name, p.start_step, p.steps) for p in cut] == [("a", 0, 3), ("b", 3, 6), ("c", 9, 4)]
    assert [p.end_step for p in cut] == [3, 9, 13]
    assert locate(cut, 3) == (cut[1], 0) and locate(cut, 12) == (cut[2], 3)
    assert samples_seen(cut, 5) == 5 * 4
    # later stages keep their own schedules, shifted: same LR at the same step within the stage
    old, new = build_lr_lambda(plans, "cosine"), build_lr_lambda(cut, "cosine")
    assert [new(3 + k) for k in range(6)] == [old(10 + k) for k in range(6)]
    assert [new(k) for k in range(3)] == [old(k) for k in range(3)]  # the cut stage's steps so far unchanged
    assert plans[1].start_step == 10  # the input is not modified


def test_end_stage_early_twice_and_apply_stage_steps() -> None:
    plans = _three_stages()
    cut = end_stage_early(end_stage_early(plans, 0, 3), 1, 2)
    assert [(p.start_step, p.steps) for p in cut] == [(0, 3), (3, 2), (5, 4)]
    assert apply_stage_steps(plans, [p.steps for p in cut]) == cut  # what resume does with the saved lengths
    assert apply_stage_steps(plans, [10, 6, 4]) == plans
    with pytest.raises(ValueError):
        end_stage_early(plans, 0, 11)
    with pytest.raises(ValueError):
        apply_stage_steps(plans, [10, 6])


def test_patience_counts_evaluations_without_improvement() -> None:
    patience = Patience(2, min_delta=0.1)
    assert [patience.update(x) for x in (3.0, 2.5, 2.45, 2.5)] == [False, False, False, True]
    assert patience.best == 2.5 and patience.since_best == 2  # 2.45 was not better by more than min_delta
    fresh = Patience(2)
    assert [fresh.update(x) for x in (1.0, 0.9, 0.95, 0.8, 0.85, 0.85)] == [False, False, False, False, False, True]


def test_patience_state_round_trips() -> None:
    patience = Patience(3)
    assert Patience.from_state(3, 0.0, patience.state()) == patience  # inf best survives JSON as None
    patience.update(2.0)
    patience.update(2.1)
    again = Patience.from_state(3, 0.0, patience.state())
    assert again == patience and [again.update(2.2), again.update(2.3)] == [False, True]
    assert Patience.from_state(4, 0.5, None) == Patience(4, 0.5)


# --- Curriculum -------------------------------------------------------------------------------------------------


def _curriculum(*overrides: str) -> Curriculum:
    """The embedded recipe's two stages (patience on the first) over 40 and 24 one-token rows, global batch 4."""
    recipe = load_recipe(None, ["train.micro_batch_size=2", "train.grad_accum=1", "eval.data=[e.jsonl]",
                                "eval.every_steps=1", "stages.0.max_steps=10", "stages.1.max_steps=6",
                                "stages.0.patience=2", *overrides])
    sets = [TrainingSet(samples=[{"input_ids": [i]} for i in range(n)], sizes=[n], difficulty=None, lengths=[1] * n,
                        stats=DataStats()) for n in (40, 24)]
    return build_curriculum(resolve_stages(recipe), sets, [[{"input_ids": [0]}], []], grad_accum=1, world_size=2,
                            seed=0, default_schedule=recipe.schedule.kind)


def test_curriculum_owns_each_stage_record() -> None:
    cur = _curriculum()
    first, second = cur.stages
    assert [(s.index, s.name, s.plan.steps, s.plan.global_batch) for s in cur.stages] == [
        (0, "warmup_short", 10, 4), (1, "longer_multiturn", 6, 4)]
    assert first.sampler.batch(0) != second.sampler.batch(0) and len(first.eval_rows) == 1 and not second.eval_rows
    assert cur.locate(10) == (second, 0) and cur.locate(99) == (second, 5) and cur.end_step == 16
    assert cur.samples_seen(12) == 12 * 4
    cur.set_trainable_params([5, 7])
    assert (first.trainable_params, second.trainable_params) == (5, 7)


def test_lambda_lr_follows_the_curriculum_after_an_early_advance() -> None:
    """LambdaLR calls the curriculum's method: after `end_stage_early` the scheduler gives the moved-up stages'
    schedule (no closure to rebind), exactly the pure schedule of the cut plans."""
    cur = _curriculum()
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cur.lr_at)
    for _ in range(3):
        opt.step()
        sched.step()
    cur.end_stage_early(cur.stages[0], 3)
    cut = end_stage_early(_curriculum().plans, 0, 3)  # the same cut of fresh, uncut plans
    assert cur.plans == cut and cur.end_step == 9 and cur.stages[1].plan.start_step == 3
    expected = build_lr_lambda(cut, "cosine")
    seen = []
    for _ in range(5):
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == [expected(s) for s in range(4, 9)]
    assert cur.stages[1].plan.warmup_steps == 1 and seen[0] == pytest.approx(cur.stages[1].plan.lr)  # its peak


def test_curriculum_state_restores_stage_lengths_and_patience_of_its_stage() -> None:
    cur = _curriculum()
    cur.enter(cur.stages[0])
    assert cur.patience is not None and not cur.patience.update(3.0) and not cur.patience.update(3.5)
    cur.end_stage_early(cur.stages[0], 4)
    mid, end = cur.state(stage_end=False), cur.state(stage_end=True)
    assert mid == {"stage_steps": [4, 6], "patience": {"best": 3.0, "since_best": 1}}
    assert end["patience"] is None and end["stage_steps"] == [4, 6]
    resumed = _curriculum()
    resumed.restore(mid, stage_index=0)
    assert resumed.plans == cur.plans
    resumed.enter(resumed.stages[0])
    assert resumed.patience == cur.patience  # the counters of the stage the checkpoint was taken in
    resumed.enter(resumed.stages[1])
    assert resumed.patience is None  # the next stage has no patience
    other = _curriculum("stages.1.patience=3")
    other.restore(mid, stage_index=0)
    other.enter(other.stages[1])
    assert other.patience == Patience(3)  # a later stage starts afresh
    longer = _curriculum("stages.1.max_steps=9")  # a later stage's new length (resume_force) is honoured
    longer.restore(mid, stage_index=0)
    assert [p.steps for p in longer.plans] == [4, 9]


# --- mastery gates ----------------------------------------------------------------------------------------------

GATED = ("stages.0.advance_when={metric: eval_loss, at_most: 2.0, min_steps: 3}",)


def test_a_gate_is_met_once_its_metric_reaches_the_threshold_after_min_steps() -> None:
    from toolkit.config.schema import AdvanceWhen
    from toolkit.curriculum.stages import Gate

    gate = Gate(AdvanceWhen(metric="facts.exact", at_least=0.75, min_steps=3))
    assert not gate.update({"facts.exact": 0.5}, steps_in_stage=1, step=11)
    assert not gate.update({"facts.exact": 0.8}, steps_in_stage=2, step=12)  # met, but before min_steps
    assert not gate.update({"other": 1.0}, steps_in_stage=3, step=13)  # this eval did not report it
    assert (gate.last, gate.best, gate.best_step, gate.met_step) == (0.8, 0.8, 12, None)
    assert gate.update({"facts.exact": 0.75}, steps_in_stage=3, step=13)
    assert gate.summary() == {"metric": "facts.exact", "at_least": 0.75, "min_steps": 3, "required": False,
                              "met": True, "met_step": 13, "last": 0.75, "best": 0.8, "best_step": 12}
    assert Gate.from_state(gate.rule, gate.state()) == gate and Gate.from_state(gate.rule, None) == Gate(gate.rule)
    loss = Gate(AdvanceWhen(metric="eval_loss", at_most=1.0))
    assert not loss.update({"eval_loss": 1.5}, steps_in_stage=1, step=1)
    assert not loss.update({"eval_loss": float("nan")}, steps_in_stage=2, step=2)  # never met by a NaN
    assert loss.update({"eval_loss": 0.9}, steps_in_stage=3, step=3) and loss.best == 0.9


def test_the_curriculum_advances_on_its_gate_before_patience_and_says_why() -> None:
    cur = _curriculum(*GATED)
    first = cur.stages[0]
    cur.enter(first)
    assert cur.advance(first, 1, 1, {"eval_loss": 3.0}) is None
    assert cur.advance(first, 2, 2, {"eval_loss": 3.5}) is None
    assert cur.advance(first, 3, 3, {"eval_loss": 3.5}) == {"reason": "patience", "best_eval_loss": 3.0}
    cur.enter(first)  # afresh
    assert cur.advance(first, 1, 1, {"eval_loss": 1.0}) is None  # below 2.0, but before min_steps
    assert cur.advance(first, 2, 2, {"eval_loss": 1.5}) is None
    # patience has run out too (no improvement on 1.0 twice): the gate is the reason given
    assert cur.advance(first, 3, 3, {"eval_loss": 1.5}) == {"reason": "gate", "gate": "eval_loss <= 2",
                                                            "metric": "eval_loss", "value": 1.5}
    cur.end_stage_early(first, 3, "gate")
    ending = cur.ending()
    assert ending["ended_by"] == "gate" and ending["gate"]["met_step"] == 3
    assert cur.plans[1].start_step == 3 and cur.unmet_required_gate(first) is None
    cur.enter(cur.stages[1])
    assert cur.gate is None and cur.ending() == {"ended_by": "planned_length"}


def test_a_required_gate_left_unmet_stops_the_run_and_a_resume_there_stops_again() -> None:
    required = ("stages.0.advance_when={metric: eval_loss, at_most: 0.5, required: true}",)
    cur = _curriculum(*required)
    first = cur.stages[0]
    cur.enter(first)
    for step in range(1, 11):
        assert cur.advance(first, step, step, {"eval_loss": 3.0 - step / 10}) is None or step < 10
    message = cur.unmet_required_gate(first)
    assert message is not None and message.startswith(
        "stage 'warmup_short' reached its length (10 steps, step 10) without meeting advance_when eval_loss <= 0.5 "
        "(last 2, best 2 at step 10)")
    state = cur.state(stage_end=True)  # what the stage-end checkpoint holds
    assert state["gate"]["met_step"] is None and state["patience"] is None
    resumed = _curriculum(*required)
    resumed.restore(state, stage_index=0)
    with pytest.raises(ToolkitError, match="reached its length"):
        resumed.check_resumed_at(10, 0)
    resumed.check_resumed_at(9, 0)  # inside the stage: it trains on and may still meet the gate
    lowered = _curriculum("stages.0.advance_when={metric: eval_loss, at_most: 2.5, required: true}")
    lowered.restore(state, stage_index=0)
    lowered.check_resumed_at(10, 0)  # the last value meets the gate as the recipe now sets it
    optional = _curriculum("stages.0.advance_when={metric: eval_loss, at_most: 0.5}")
    optional.restore(state, stage_index=0)
    optional.check_resumed_at(10, 0)  # not required: the run moves on
