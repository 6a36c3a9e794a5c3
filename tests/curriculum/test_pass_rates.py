"""Prompt selection for RL stages (toolkit/curriculum/pass_rates.py): failure-rate prioritised sampling (Kimi
k1.5), dynamic sampling's counts, pass-rate buckets, and their checkpointed state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from toolkit.curriculum.pass_rates import DrawCounts, SuccessRates, pass_rate_buckets
from toolkit.errors import ToolkitError


def test_prompts_are_drawn_in_proportion_to_their_failure_rate() -> None:
    rates = SuccessRates(4)
    rates.record([0] * 4 + [1] * 4 + [2] * 4, [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0])  # prompt 3 never drawn
    np.testing.assert_allclose(rates.rates, [1.0, 0.25, 0.0, np.nan])
    np.testing.assert_allclose(rates.weights(), [0.0, 0.75, 1.0, 1.0])
    counts = np.zeros(4)
    for step in range(3000):
        counts[rates.sample(1, seed=3, step=step)] += 1
    np.testing.assert_allclose(counts / counts.sum(), [0.0, 0.75 / 2.75, 1 / 2.75, 1 / 2.75], atol=0.03)
    assert sorted(rates.sample(3, seed=3, step=0).tolist()) == [1, 2, 3]  # the solved prompt only when needed
    assert sorted(rates.sample(4, seed=3, step=0).tolist()) == [0, 1, 2, 3]
    assert rates.sample(2, seed=3, step=5).tolist() == rates.sample(2, seed=3, step=5).tolist()


def test_the_state_survives_a_checkpoint_and_resumes_the_same_draws() -> None:
    rates, counts = SuccessRates(5), DrawCounts()
    rates.record([0, 0, 1, 4], [1, 0, 1, 0.5])
    counts.add([True, False, False])
    counts.add([True])
    saved = json.loads(json.dumps({"rates": rates.state_dict(), "counts": counts.state_dict()}))
    again, again_counts = SuccessRates(5), DrawCounts()
    again.load_state_dict(saved["rates"])
    again_counts.load_state_dict(saved["counts"])
    assert again.sample(3, seed=1, step=9).tolist() == rates.sample(3, seed=1, step=9).tolist()
    assert again_counts == DrawCounts(drawn=4, dropped=2, rollouts=2)
    with pytest.raises(ToolkitError, match="cover 5 prompts but the stage has 6: its data changed"):
        SuccessRates(6).load_state_dict(saved["rates"])


def test_pass_rate_buckets() -> None:
    buckets = pass_rate_buckets([0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 1], 3)
    assert buckets == {"pass_rate/zero": 0.25, "pass_rate/mixed": 0.5, "pass_rate/all": 0.25}
