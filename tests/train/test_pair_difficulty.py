"""A preference stage ordered and dropped by the model's scores of its pairs (toolkit/train/stage_scores.py
`pair_measure`): difficulty by margin (chosen minus rejected summed log-prob; large is easy) or chosen_loss (the
chosen side's mean per-token NLL; low is easy), with model current, taken at the stage's entry.

Against an independent computation (each side's log-prob from plain full logits in float64): the stage's
difficulty equals it, the pairs a drop leaves out are exactly the easiest and hardest by it, and the first batch
holds the easiest kept pairs. A dpo stage with model current takes no second pass: its reference pass reads the
same scores file. A launch resumed inside the stage reads the scores back and draws the same batches."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.train.test_loop import _kept, build_run  # noqa: F401  (the fixture keeps signal handlers off the runner)
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.plan import PairSides
from toolkit.train.loop import enter_stage
from toolkit.train.stage_scores import entry_sums, order_by_model, pair_measure

DROP = (0.25, 0.125)


@torch.no_grad()
def _side_sums(model: torch.nn.Module, sides: PairSides) -> tuple[np.ndarray, np.ndarray]:
    """Each side's summed label-token log-prob and label count, from full logits in float64."""
    logps, counts = [], []
    for side in (sides[i] for i in range(len(sides))):
        logp = F.log_softmax(model(input_ids=torch.tensor([side["input_ids"]])).logits[0].double(), dim=-1)
        target = torch.tensor(side["labels"][1:])
        keep = target != IGNORE_INDEX
        logps.append(float(logp[:-1][keep].gather(1, target[keep].unsqueeze(1)).sum()))
        counts.append(int(keep.sum()))
    return np.array(logps), np.array(counts)


def test_a_pair_stage_is_ordered_and_dropped_by_the_models_scores_of_its_pairs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """By margin, end to end; chosen_loss from the same kept sums (`pair_measure`: the rest of the path is one)."""
    caplog.set_level(logging.INFO, logger="toolkit")
    by = "margin"
    overrides = ("stages.0.objective=dpo", "stages.0.data=[dummy:pairs]", "stages.0.order=easy_to_hard",
                 f"stages.0.difficulty={{by: {by}, model: current}}",
                 f"stages.0.drop={{easiest: {DROP[0]}, hardest: {DROP[1]}}}", "stages.1.max_steps=1",
                 "train.micro_batch_size=2", "data.max_seq_len=96", "schedule.warmup_ratio=0")
    run = build_run(tmp_path, *overrides)
    stage = run.curriculum.stages[0]
    n = len(stage.data.samples)
    easy, hard = int(n * DROP[0]), int(n * DROP[1])
    assert stage.data.dropped_by_score == (easy, hard) and easy > 0 and hard > 0
    planned = stage.plan
    assert planned.num_samples == n - easy - hard  # planned before any score

    model = run.accelerator.unwrap_model(run.model).eval()
    logps, counts = _side_sums(model, PairSides(stage.data.samples.parts))
    chosen, rejected = logps[0::2], logps[1::2]
    expected = -(chosen - rejected)  # higher is harder: a large margin is easy
    ranked = np.argsort(expected, kind="stable")
    assert np.min(np.diff(expected[ranked])) > 3e-5  # no near-ties (each within 1e-5 below): one ranking

    assert enter_stage(run, stage, 0) is None  # scores, orders, drops, then the dpo stage's reference
    np.testing.assert_allclose(stage.data.difficulty, expected, rtol=1e-5, atol=1e-5)
    ref = run.pairs.train[stage.index]
    np.testing.assert_allclose(ref.chosen, chosen, rtol=1e-5, atol=1e-5)
    # One pass: the reference read the difficulty's scores file (the same key), none was written beside it.
    assert len(list((tmp_path / "run" / "scores").glob("scores-*.npz"))) == 1
    assert "reference log-probs (the policy at step 0): read from" in caplog.text

    left_out = set(ranked[:easy].tolist()) | set(ranked[n - hard:].tolist())
    batches = [stage.sampler.batch(k) for k in range(stage.plan.steps)]
    drawn = [i for batch in batches for i in batch]
    assert set(drawn) == set(range(n)) - left_out  # exactly the kept pairs, every one of them
    kept_order = [i for i in ranked.tolist() if i not in left_out]
    assert batches[0] == kept_order[:len(batches[0])]  # the easiest kept pairs first
    assert stage.plan == planned  # the scores moved no length

    sums, _ = entry_sums(run, stage, 0)  # read back from the file
    np.testing.assert_allclose(pair_measure("chosen_loss", sums), -chosen / counts[0::2], rtol=1e-5, atol=1e-6)

    caplog.clear()  # a launch resumed inside the stage reads the scores and draws the same batches
    again = build_run(tmp_path, *overrides)
    resumed = again.curriculum.stages[0]
    np.testing.assert_array_equal(order_by_model(again, resumed, 2), stage.data.difficulty)
    assert "read from" in caplog.text
    assert [resumed.sampler.batch(k) for k in range(resumed.plan.steps)] == batches
