"""SFT then GRPO in one launch, end to end (recipes/sft_then_grpo.yaml: a LoRA SFT stage on the dummy facts, then a
GRPO stage on their questions as prompts, with a user reward under TRL's contract; a checkpoint per step).

One single-process run (micro-batches of 2 completions, grad_accum 2: 2 prompts x 2 generations a step) is the
reference. Checked against it, in one launch set:
* the GRPO stage trains: its groups' rewards differ and give a gradient, TRL's metric names are logged with the
  step's generation and scoring time, and every completion is written with its rewards;
* 2 processes under DDP, FSDP2, ZeRO-2, ZeRO-3 and ZeRO-3 offload (grad_accum 1): the same completions and rewards
  (each seeded per step, prompt and sample, drawn on whichever rank), the same per-step losses, gradient norms and
  final adapter;
* an exact resume from the checkpoint inside the GRPO stage: every later step and the final adapter to the bit;
* `advance_when` on the reward ends the stage at the logged step that meets it.

And an exact resume from every checkpoint of `[sft, grpo]` with the whole RL curriculum on
(test_sft_then_grpo_resumes_exactly_from_every_checkpoint).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, dummy_run_args, free_port, relaunch, run_launch, train_forked
from tests.e2e.test_preference_stages import header_launch_line
from tests.e2e.test_resume import EXACT_KEYS, assert_exact_from_every_checkpoint
from tests.metrics.test_report import page_data
from toolkit.data.plan import kept_by_rank
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

    # A gate on the reward, checked at each logged step: met at the stage's first step, it ends the stage there.
    gated = tmp_path / "gated"
    threshold = steps[5]["reward"]
    train_forked("single", 1, gated, *SETTINGS, f"stages.1.advance_when={{metric: reward, at_least: {threshold}}}",
                 recipe=RECIPE, dummy_samples=32)
    events = [r for r in read_metrics(gated / "metrics.jsonl") if r.get("event") == "early_advance"]
    assert [(e["step"], e["reason"], e["value"]) for e in events] == [(5, "gate", threshold)]
    assert sorted(by_step(gated)) == [1, 2, 3, 4, 5]


CURRICULUM = ("stages.0.max_steps=1", "stages.1.rl={num_generations: 2, max_completion_length: 8, "
              "dynamic_sampling: true, max_resample: 2, prioritize: failure_rate, beta: 0.04}",
              "stages.1.difficulty={by: pass_rate, model: current, samples: 3}", "stages.1.drop={easiest: 0.25}",
              "checkpoint.keep_last=10")


@pytest.mark.timeout(600)
def test_prioritized_dynamic_sampling_agrees_on_two_processes(tmp_path: Path) -> None:
    """rl.prioritize and rl.dynamic_sampling on the letters task (`contains`: binary correctness): groups all right
    or all wrong are dropped and prompts drawn again by failure rate, among the prompts a drop by pass rate keeps
    (measured by the policy entering the stage); with rl.beta the KL to the policy as it entered the stage (0 at its
    first step, then not; the warmup's first lr is 0); 2 processes (DDP, FSDP2, ZeRO-3: the reference swapped into
    the gathered weights) draw and train the same. Its resumes (from every checkpoint) are
    test_sft_then_grpo_resumes_exactly_from_every_checkpoint's."""
    one = tmp_path / "one"
    train_forked("single", 1, one, *CURRICULUM, recipe=RECIPE, dummy_samples=32)
    steps = by_step(one)
    assert sorted(steps) == [1, 2, 3, 4] and {steps[s]["stage"] for s in (2, 3, 4)} == {"grpo"}
    for s in (2, 3, 4):
        r = steps[s]
        # Draws of 2 prompts until 2 groups are mixed (at most 1 + max_resample), set-aside groups filling the rest.
        assert r["rl/drawn"] in (2, 4, 6) and r["rl/filled"] == max(0, 2 - (r["rl/drawn"] - r["rl/dropped"])), r
        assert r["rl/drawn"] == 6 or r["rl/drawn"] - r["rl/dropped"] >= 2, r
        assert r["frac_reward_zero_std"] == r["rl/filled"] / 2, r  # contains is binary: exactly the filled groups
        assert r["pass_rate/zero"] + r["pass_rate/mixed"] + r["pass_rate/all"] == pytest.approx(1.0)
    assert sum(steps[s]["rl/dropped"] for s in (2, 3, 4)) > 0  # something was dropped and drawn again
    assert abs(steps[2]["kl"]) < 1e-9 and steps[4]["kl"] > 1e-6  # the entry policy, then moved away from it
    drawn = rollouts(one)
    assert [r["step"] for r in drawn] == [2] * 4 + [3] * 4 + [4] * 4
    assert len({r["prompt"] for r in drawn}) > 2
    # The pass rates at the stage's entry (3 completions a prompt): the most solved quarter is never drawn.
    (rates,) = (one / "scores").glob("scores-*.npz")
    with np.load(rates) as kept:
        failure, done = kept["loss"] / kept["tokens"], kept["done"]
    assert done.all() and len(set(failure.tolist())) > 1
    never = set(np.flatnonzero(~kept_by_rank(failure, len(failure) // 4, 0)).tolist())
    assert len(never) == len(failure) // 4 and not never & {r["prompt"] for r in drawn}
    # The run page shows each step's groups: the prompt as the rollout fed it, its completions with their rewards.
    shown = page_data((one / "report.html").read_text())["runs"][0]["completions"]
    prompts = [q for q in shown["prompts"] if q["eval"] == "rollout grpo"]
    assert {q["row"] for q in prompts} == {r["prompt"] for r in drawn}
    assert all("<|im_start|>user" in q["prompt"] and q["reference"] for q in prompts)
    at_2 = next(f for f in shown["files"] if f["file"] == "rollouts/grpo.jsonl" and f["step"] == 2)
    assert [(row["output"], row["score"]["contains"]) for row in at_2["rows"]] == \
        [(r["completion"], r["rewards"][0]) for r in drawn if r["step"] == 2]
    meta = json.loads((one / "checkpoints" / "step-00000002" / "meta.json").read_text())
    assert sum(meta["rl_rates"]["1"]["attempts"]) == 2 * steps[2]["rl/drawn"]  # every drawn completion counted

    for strategy in ("ddp", "fsdp", "zero3"):  # FSDP2, ZeRO-3: every draw gathers the full weights, in lockstep
        two = tmp_path / strategy
        train_forked(strategy, 2, two, *CURRICULUM, "train.grad_accum=1", recipe=RECIPE, dummy_samples=32)
        assert [(r["prompt"], r["completion"], r["rewards"]) for r in rollouts(two)] == \
            [(r["prompt"], r["completion"], r["rewards"]) for r in drawn], strategy
        theirs = by_step(two)
        for s, r in steps.items():
            assert theirs[s]["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7), (strategy, s)
            for key in ("rl/drawn", "rl/dropped", "rl/filled", "pass_rate/mixed", "reward"):
                if key in r:
                    assert theirs[s][key] == pytest.approx(r[key], rel=1e-6), (strategy, s, key)
            if "kl" in r:  # the grpo stage's steps
                assert theirs[s]["kl"] == pytest.approx(r["kl"], rel=1e-3, abs=1e-9), (strategy, s)

@pytest.mark.timeout(600)
def test_the_recipe_s_launch_line_trains_both_stages(tmp_path: Path) -> None:
    """recipes/sft_then_grpo.yaml's header line as written (2 processes under DDP, only a free port added), from a
    folder holding the repository's recipes, configs and entry, as a user's would."""
    words = header_launch_line(RECIPE)
    assert words[:2] == ["accelerate", "launch"] and words[-1] == "--create_dummy_data"
    for name in ("recipes", "accelerate_configs", "ds_configs", "train_curriculum.py"):
        (tmp_path / name).symlink_to(REPO / name)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *words[2:]]
    proc = run_launch(cmd, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    steps = by_step(tmp_path / "outputs" / "sft_then_grpo")
    assert [steps[s]["stage"] for s in sorted(steps)] == ["sft"] * 4 + ["grpo"] * 3
    assert all("reward" in steps[s] for s in (5, 6, 7))
    assert len(rollouts(tmp_path / "outputs" / "sft_then_grpo")) == 3 * 8  # 2 processes x 2 x 2 completions a step


@pytest.mark.timeout(600)
def test_num_iterations_reuses_each_rollout_and_resumes_exactly_between_rollouts(tmp_path: Path) -> None:
    """rl.num_iterations 2 in a real run (one process): the grpo stage's 4 steps draw 2 rollouts (steps 2 and 4 of
    the run), each trained twice; a resume from the checkpoint after the first rollout's 2 updates gives every later
    step and the adapter to the bit, and one from inside them is refused in one line."""
    settings = ("stages.0.max_steps=1", "stages.1.max_steps=4", SETTINGS[0], "checkpoint.keep_last=10",
                "stages.1.rl={num_generations: 2, max_completion_length: 8, num_iterations: 2}")
    one = tmp_path / "one"
    train_forked("single", 1, one, *settings, recipe=RECIPE, dummy_samples=32)
    steps = by_step(one)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rollouts(one)] == [2] * 4 + [4] * 4  # a rollout every 2 steps of the stage
    logs = []
    for at in (3, 2):  # stage steps 2 (between rollouts) and 1 (inside the first rollout's updates)
        out = tmp_path / f"from-{at}"
        argv = dummy_run_args(*settings, f"output_dir={out}",
                              f"checkpoint.resume={one / 'checkpoints' / f'step-{at:08d}'}", recipe=RECIPE,
                              dummy_samples=32)
        logs.append((argv, out.with_suffix(".log")))
    codes = relaunch("single", logs, mixed_precision="no")
    assert codes[0] == 0, logs[0][1].read_text()[-4000:]
    again = by_step(tmp_path / "from-3")
    assert sorted(again) == [4, 5]
    for s in (4, 5):
        for key in (*EXACT_KEYS, *TRL_METRICS):
            assert again[s].get(key) == steps[s].get(key), (s, key)
    b, final = (load_file(run / "final" / "adapter_model.safetensors") for run in (one, tmp_path / "from-3"))
    assert all(torch.equal(final[k], b[k]) for k in b)
    assert codes[1] != 0 and ("error: stages.1 ('grpo'): the checkpoint is at step 1 of the stage, inside the 2 "
                              "updates (rl.num_iterations) of one rollout batch") in logs[1][1].read_text()


EVERY_CHECKPOINT = ("stages.0.max_steps=2", "stages.1.max_steps=3", *CURRICULUM[1:])
RL_EXACT_KEYS = (*EXACT_KEYS, "reward", "reward_std", "frac_reward_zero_std", "rewards/contains/mean", "kl",
                 "entropy", "completions/mean_length", "completions/clipped_ratio", "rl/drawn", "rl/dropped",
                 "rl/filled", "pass_rate/zero", "pass_rate/mixed", "pass_rate/all")
"""What a resumed `[sft, grpo]` run must reproduce of each later step, to the bit: the sft keys and the grpo
stage's rewards, KL to the entry policy, entropy, completion lengths, what dynamic sampling drew, dropped and
filled, and the pass-rate buckets."""


@pytest.mark.timeout(600)  # one launch and 5 resumes, forked: well under a minute and a half on a quiet machine
def test_sft_then_grpo_resumes_exactly_from_every_checkpoint(tmp_path: Path) -> None:
    """`[sft, grpo]` (2 sft steps, 3 grpo steps; a checkpoint after each) with rl.dynamic_sampling, rl.prioritize
    (failure_rate), rl.beta 0.04 and a pass-rate difficulty with a drop, resumed from each of its 5 checkpoints
    (fp32, one process; step 2's is the stage boundary, so that resume enters the grpo stage itself: its pass-rate
    pass, its frozen reference adapter): every later step's loss, lr, gradient norm, rewards, KL, draws and drops,
    every completion with its rewards (rollouts/grpo.jsonl) and the final adapter equal the uninterrupted run's, to
    the last bit. A state that a resume loses (the rollout seed, the success rates behind the prioritised draws and
    the pass-rate buckets, the reference adapter, the pass-rate cache) fails it at the steps after."""
    reference = tmp_path / "one"
    train_forked("single", 1, reference, *EVERY_CHECKPOINT, recipe=RECIPE, dummy_samples=32)
    steps = by_step(reference)
    assert [steps[s]["stage"] for s in sorted(steps)] == ["sft"] * 2 + ["grpo"] * 3
    assert sum(steps[s]["rl/dropped"] for s in (3, 4, 5)) > 0 and steps[5]["kl"] > 1e-6  # the states are in play
    argv = dummy_run_args(*EVERY_CHECKPOINT, recipe=RECIPE, dummy_samples=32)
    outs = assert_exact_from_every_checkpoint("single", reference, argv, steps=5, mixed_precision="no",
                                              keys=RL_EXACT_KEYS)
    drawn = rollouts(reference)

    def unplaced(rows: list[dict]) -> list[dict]:  # the dummy files live in each run's own folder
        return [{k: v for k, v in r.items() if k != "where"} for r in rows]

    for start, out in enumerate(outs, 1):
        again = rollouts(out) if (out / "rollouts" / "grpo.jsonl").is_file() else []
        assert unplaced(again) == unplaced([r for r in drawn if r["step"] > start]), f"resumed from step {start}"
