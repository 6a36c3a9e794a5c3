"""SFT then GRPO in one launch, end to end (recipes/sft_then_grpo.yaml: a LoRA SFT stage on the dummy facts, then a
GRPO stage on their questions as prompts, with a user reward under TRL's contract; a checkpoint per step).

One single-process run (micro-batches of 2 completions, grad_accum 2: 2 prompts x 2 generations a step) is the
reference. Checked against it, in one launch set:
* the GRPO stage trains: its groups' rewards differ and give a gradient, TRL's metric names are logged with the
  step's generation and scoring time, and every completion is written with its rewards;
* 2 processes under DDP, FSDP2, ZeRO-2, ZeRO-3 and ZeRO-3 offload (grad_accum 1): the same completions and rewards
  (each seeded per step, prompt and sample, drawn on whichever rank), the same per-step losses, gradient norms and
  final adapter;
* an exact resume from the checkpoint inside the GRPO stage: every later step and the final adapter to the bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import dummy_run_args, relaunch, train_forked
from tests.e2e.test_resume import EXACT_KEYS
from toolkit.metrics.log import read_metrics

pytestmark = pytest.mark.slow

RECIPE = "recipes/sft_then_grpo.yaml"
SETTINGS = ("stages.1.rewards=[{scorer: 'tests.helpers.user_rewards:vowel_share'}]",
            "stages.1.rl={num_generations: 2, max_completion_length: 8}", "checkpoint.keep_last=10")
TWO_PROCESSES = ("ddp", "fsdp", "zero2", "zero3", "zero3_offload")
TRL_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/vowel_share/mean", "completions/mean_length",
               "completions/clipped_ratio", "entropy", "clip_ratio/region_mean")


def by_step(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl", "train")}


def rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts" / "grpo.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_sft_then_grpo_trains_agrees_on_two_processes_and_resumes_exactly(tmp_path: Path) -> None:
    one = tmp_path / "one"
    train_forked("single", 1, one, *SETTINGS, recipe=RECIPE, dummy_samples=32)
    steps = by_step(one)
    assert sorted(steps) == list(range(1, 8)) and {steps[s]["stage"] for s in (5, 6, 7)} == {"grpo"}
    for s in (5, 6, 7):
        assert all(k in steps[s] for k in TRL_METRICS), steps[s]
        assert steps[s]["time/generation"] > 0 and steps[s]["time/scoring"] >= 0
        # Groups with rewards apart: a gradient (the loss itself is ~0 here, at ratio 1 with equal lengths).
        assert steps[s]["frac_reward_zero_std"] < 1 and steps[s]["grad_norm"] > 1e-4
    assert all(k not in steps[4] for k in TRL_METRICS)
    drawn = rollouts(one)
    assert [r["step"] for r in drawn] == [5] * 4 + [6] * 4 + [7] * 4 and [r["slot"] for r in drawn[:4]] == [0, 1, 2, 3]
    assert len({r["completion"] for r in drawn}) > 6  # sampled, not repeated
    mean = sum(r["rewards"][0] for r in drawn if r["step"] == 5) / 4
    assert steps[5]["reward"] == pytest.approx(mean, abs=1e-9)

    b = load_file(one / "final" / "adapter_model.safetensors")
    for strategy in TWO_PROCESSES:  # generation with the full weights gathered once; under ZeRO-3 / FSDP in lockstep
        two = tmp_path / strategy
        train_forked(strategy, 2, two, *SETTINGS, "train.grad_accum=1", recipe=RECIPE, dummy_samples=32)
        assert [(r["completion"], r["rewards"]) for r in rollouts(two)] == \
            [(r["completion"], r["rewards"]) for r in drawn], strategy
        theirs = by_step(two)
        for s, r in steps.items():
            assert theirs[s]["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7), (strategy, s)
            assert theirs[s]["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), (strategy, s)
            for key in TRL_METRICS:
                if key in r:
                    assert theirs[s][key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), (strategy, s, key)
        a = load_file(two / "final" / "adapter_model.safetensors")
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=f"{strategy}: {k}")

    resumed = tmp_path / "from-5"
    checkpoint = one / "checkpoints" / "step-00000005"
    argv = dummy_run_args(*SETTINGS, f"output_dir={resumed}", f"checkpoint.resume={checkpoint}", recipe=RECIPE,
                          dummy_samples=32)
    (code,) = relaunch("single", [(argv, resumed.with_suffix(".log"))], mixed_precision="no")
    assert code == 0, resumed.with_suffix(".log").read_text()[-4000:]
    assert "resumed (exact)" in resumed.with_suffix(".log").read_text()
    again = by_step(resumed)
    assert sorted(again) == [6, 7]
    for s in (6, 7):
        for key in (*EXACT_KEYS, *TRL_METRICS):
            assert again[s].get(key) == steps[s].get(key), (s, key)
    def unplaced(rows: list[dict]) -> list[dict]:  # the dummy files live in each run's own folder
        return [{k: v for k, v in r.items() if k != "where"} for r in rows]

    assert unplaced(rollouts(resumed)) == unplaced([r for r in drawn if r["step"] > 5])
    final = load_file(resumed / "final" / "adapter_model.safetensors")
    assert all(torch.equal(final[k], b[k]) for k in b)
