"""The summary arithmetic of bench/rl_curriculum.py (steps to a target reward, the spread over seeds, the rise
against seed-to-seed noise), on synthetic curves: the bench's runs themselves take minutes and belong in bench/."""

from __future__ import annotations

import importlib.util
import math

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("rl_curriculum", REPO / "bench" / "rl_curriculum.py")
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_steps_to_target_is_the_first_step_that_reaches_it() -> None:
    curve = {2: 0.2, 4: 0.35, 6: 0.3, 8: 0.4}  # not monotone: the first crossing counts, not a later one
    assert bench.steps_to_target(curve, 0.35) == 4  # reaching it exactly counts
    assert bench.steps_to_target(curve, 0.31) == 4
    assert bench.steps_to_target(curve, 0.4) == 8
    assert bench.steps_to_target(curve, 0.41) is None
    assert bench.steps_to_target({8: 0.5, 2: 0.1, 4: 0.5}, 0.5) == 4  # by step, whatever the dict's order


def test_spread_and_mean_curve_over_seeds() -> None:
    s = bench.spread([0.2, 0.4, 0.3])
    assert s["mean"] == pytest.approx(0.3) and s["std"] == pytest.approx(0.1)  # the sample std (n - 1)
    assert (s["min"], s["max"]) == (0.2, 0.4)
    assert bench.spread([0.5])["std"] == 0.0
    curve = bench.mean_curve([{2: 0.2, 4: 0.4}, {2: 0.4, 4: 0.6, 6: 0.9}])
    assert sorted(curve) == [2, 4]  # a step one seed lacks is left out, not averaged over fewer seeds
    assert curve[4]["mean"] == pytest.approx(0.5)


def test_rise_is_measured_against_the_seed_spread() -> None:
    curves = [{2: 0.20, 10: 0.40}, {2: 0.22, 10: 0.46}, {2: 0.24, 10: 0.43}]
    r = bench.rise(curves)
    assert r["mean_rise"] == pytest.approx((0.2 + 0.24 + 0.19) / 3) and r["min_rise"] == pytest.approx(0.19)
    assert r["start_std"] == pytest.approx(0.02) and r["end_std"] == pytest.approx(0.03)
    assert r["rise_over_noise"] == pytest.approx(0.21 / 0.03)  # the larger of the two spreads
    assert math.isinf(bench.rise([{1: 0.1, 2: 0.3}])["rise_over_noise"])  # one seed: no spread to compare with


def test_window_means_take_the_first_and_last_quarter() -> None:
    curve = {s: float(s) for s in range(1, 9)}  # 8 steps: quarters of 2
    assert bench.window_means(curve) == {0: 1.5, 1: 7.5}
    assert bench.window_means({1: 0.2, 2: 0.4}) == {0: 0.2, 1: 0.4}  # at least one step each


def test_groups_drawn_count_the_steps_up_to_the_target() -> None:
    drawn = {1: 8, 2: 4, 3: 12, 4: 4}
    assert bench.drawn_until(drawn, 2) == 12 and bench.drawn_until(drawn, 4) == 28
    assert bench.drawn_until(drawn, None) is None
