"""Exact resume: from every checkpoint of the 3-stage curriculum under every strategy, after a SIGKILL at a random
step, after SIGTERM, and across an early stage advance, the resumed run equals the uninterrupted one.

For the kill tests the smoke recipe is stretched to 16 steps: stage 'short' runs 10 steps over 8 global batches per
epoch (so steps 9-10 are inside its second epoch), stage 'long' 6 steps. A checkpoint is committed after every step.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (
    BF16_BASE,
    CURRICULUM,
    CURRICULUM_STEPS,
    LAUNCH_TIMEOUT_S,
    curriculum_args,
    dummy_run_args,
    launched_once,
    rank_stderr,
    relaunch,
    start_and_signal,
    toolkit_lines,
    train,
    train_cmd,
    train_forked,
)
from toolkit.checkpoint.manager import read_meta
from toolkit.checkpoint.resume import EXACT_RESUME_TESTED
from toolkit.metrics.log import read_metrics
from toolkit.runtime.run_dir import committed_checkpoints
from toolkit.runtime.signals import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

LONGER = ("stages.0.max_steps=10", "stages.1.max_steps=6", "checkpoint.save_steps=1", "checkpoint.keep_last=2")
TOTAL_STEPS = 16


def records(out: Path, kind: str = "train") -> list[dict]:
    """The step records of a run's metrics.jsonl (none yet: a run resumed from its last step trains no step)."""
    path = out / "metrics.jsonl"
    return read_metrics(path, kind) if path.is_file() else []


def assert_same_run(resumed: Path, reference: Path) -> None:
    got, ref = records(resumed), records(reference)
    assert [r["step"] for r in got] == list(range(1, TOTAL_STEPS + 1)), "steps missing or doubled"
    assert [r["stage"] for r in got] == [r["stage"] for r in ref]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in ref], rel=1e-9)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]


# --- resume from every checkpoint -------------------------------------------------------------------------------

# What a resumed run must reproduce of each later step: everything but the clock.
EXACT_KEYS = ("step", "stage", "stage_index", "stage_step", "loss", "lr", "grad_norm", "tokens", "samples")
EXACT_EVENT_KEYS = ("step", "stage", "event", "stage_steps", "stage_samples", "stage_tokens", "trainable_params")


EXACT_RESUMES = [*((s, "no") for s in ("single", "ddp", "fsdp", "zero2", "zero3", "zero3_offload")),
                 ("single", "bf16"), ("zero3", "bf16")]
"""(shipped config, precision) pairs resumed from every checkpoint: fp32 under every strategy, and the precision
the shipped configs train in (bf16 autocast or DeepSpeed's bf16, a bf16 base) for one process and ZeRO-3, the
flagship launch. Ulysses sequence parallelism (zero3_sp2) is resumed from every checkpoint of its packed smoke run
(tests/e2e/test_strategies.py::test_sequence_parallel_resumes_exactly_from_every_checkpoint)."""


@pytest.mark.timeout(1800)  # the reference launch and 11 resumes: about 2 minutes on a quiet 2-core machine
@pytest.mark.parametrize(("strategy", "precision"), EXACT_RESUMES, ids=[f"{s}-{p}" for s, p in EXACT_RESUMES])
def test_resume_from_every_checkpoint_is_exact(strategy: str, precision: str,
                                               curriculum_runs: Callable[[str], Path],
                                               bf16_curriculum_runs: Callable[[str], Path]) -> None:
    """The uninterrupted curriculum (LoRA, then only the norm, then both; a checkpoint after every step) is
    resumed from each of its 11 checkpoints into a new output_dir: every later step's loss, applied lr, gradient
    norm, token and sample counts, the stage summaries and the final adapter equal the uninterrupted run's, to the
    last bit. A kill at one random step would miss a state that only some steps carry (stage boundaries, a frozen
    group thawing, the pacing and epoch position): this is the test that lets the log say "resumed (exact)"
    (toolkit/checkpoint.EXACT_RESUME_TESTED names what it covers). The bf16 runs are launched as users launch
    them: the config file's precision, a bf16 base."""
    name = {"fsdp": "fsdp2"}.get(strategy, strategy)
    assert (name, precision) in EXACT_RESUME_TESTED
    bf16 = precision == "bf16"
    reference = (bf16_curriculum_runs if bf16 else curriculum_runs)(strategy)
    argv = dummy_run_args(*curriculum_args(strategy), *((BF16_BASE,) if bf16 else ()), recipe=CURRICULUM)
    assert_exact_from_every_checkpoint(strategy, reference, argv, steps=CURRICULUM_STEPS,
                                       mixed_precision=None if bf16 else "no")


PACKED_VL = ("data.packing=true", "data.max_seq_len=184", "train.micro_batch_size=1", "stages.0.max_steps=5",
             "stages.1.max_steps=null", "stages.1.epochs=1", "stages.1.order=easy_to_hard", "checkpoint.save_steps=1",
             "checkpoint.keep_last=9")
"""The vision-language smoke curriculum packed (image rows whole, rotary ids restarting per sample): 5 steps of
stage 'align' over its 14 packed rows (3 steps an epoch: steps 4-5 are in its second epoch), then one epoch of stage
'instruct' (16 packed rows, easy_to_hard, 4 steps). max_seq_len 184 (it was 128) since the tiny Qwen2.5-VL carries
Qwen2.5-VL's stock template, whose default system prompt lengthens every row: the same packed rows as before."""


@pytest.mark.timeout(900)  # a launch and 8 resumes of the tiny Qwen2.5-VL: about a minute on a quiet 2-core machine
def test_packed_vl_resume_from_every_checkpoint_is_exact(tmp_path: Path) -> None:
    """What the strategy matrix's curriculum does not hold, from every checkpoint under DDP: packed rows, image rows
    (decoded in 2 DataLoader workers per rank), an epoch boundary inside a stage, LoRA thawed in the second stage
    beside the trained vision merger. The log says "resumed (exact)" for such runs too."""
    reference = tmp_path / "reference"
    argv = dummy_run_args(*PACKED_VL, recipe="recipes/smoke_vl.yaml", dummy_samples=48)
    proc = train("ddp", 2, reference, *PACKED_VL, recipe="recipes/smoke_vl.yaml", dummy_samples=48)
    assert "stage 'align' data: 48 rows, 48 kept" in proc.stderr and "packed into 14 rows" in proc.stderr
    assert_exact_from_every_checkpoint("ddp", reference, argv, steps=9, mixed_precision="no")


@pytest.mark.timeout(900)  # a launch and 4 resumes of the tiny Qwen2.5-VL on 16 video rows: well under a minute
def test_video_curriculum_resumes_exactly_from_every_checkpoint(tmp_path: Path) -> None:
    """A 2-stage short-to-long video curriculum (at most 4 then 8 frames a video; stage 'long' easy_to_hard by its
    rows' sampled frames) over video, image + video, frame-list and text rows, a checkpoint after each of its 4
    steps, resumed from each (fp32, one process): the later steps and the final adapter are the uninterrupted
    run's, to the last bit. A resume reads the frame store the reference prepared, and decodes nothing."""
    import yaml

    from tests.helpers.video_files import video_recipe, write_video_dataset

    recipe = video_recipe(write_video_dataset(tmp_path / "data", 16), tmp_path / "reference", steps=2)
    recipe["stages"][1].update(order="easy_to_hard", difficulty={"by": "frames"})
    recipe["checkpoint"] = {"save_steps": 1, "keep_last": 10}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    argv = ["--config", str(tmp_path / "recipe.yaml")]
    reference = tmp_path / "reference"
    assert relaunch("single", [(argv, tmp_path / "reference.log")], num_processes=1) == [0], \
        (tmp_path / "reference.log").read_text()[-4000:]
    assert "stage 'long' data:" in (tmp_path / "reference.log").read_text()
    frames = sorted((tmp_path / ".toolkit-cache" / "tokenized" / "frames").iterdir())
    assert_exact_from_every_checkpoint("single", reference, argv, steps=4, mixed_precision="no")
    assert sorted((tmp_path / ".toolkit-cache" / "tokenized" / "frames").iterdir()) == frames


def assert_exact_from_every_checkpoint(strategy: str | Path, reference: Path, argv: list[str], *, steps: int,
                                       mixed_precision: str | None) -> None:
    """Resume `reference` (a run of `argv` with a checkpoint after each of its `steps` steps) from each checkpoint
    into a new output_dir: every later step's loss, applied lr, gradient norm, token and sample counts, the stage
    summaries and the final adapter must equal the uninterrupted run's, to the last bit, and the log say exact."""
    checkpoints = committed_checkpoints(reference / "checkpoints")
    assert [read_meta(c)["step"] for c in checkpoints] == list(range(1, steps + 1))
    outs = [reference.parent / f"{reference.name}-from-{read_meta(c)['step']}" for c in checkpoints]
    codes = relaunch(strategy, [([*argv, f"output_dir={out}", f"checkpoint.resume={c}"], out.with_suffix(".log"))
                                for out, c in zip(outs, checkpoints, strict=True)], mixed_precision=mixed_precision)
    expected = {r["step"]: r for r in read_metrics(reference / "metrics.jsonl", "train")}
    expected_ends = [r for r in read_metrics(reference / "metrics.jsonl") if r.get("event") == "stage_end"]
    final = load_file(reference / "final" / "adapter_model.safetensors")
    for out, ckpt, code in zip(outs, checkpoints, codes, strict=True):
        log = out.with_suffix(".log").read_text()
        assert code == 0, f"resume from {ckpt.name} failed:\n{log[-4000:]}"
        assert f"resumed (exact) from {ckpt}" in log
        start = read_meta(ckpt)["step"]
        got = records(out)
        assert [r["step"] for r in got] == list(range(start + 1, steps + 1)), f"from {ckpt.name}"
        for r in got:
            want = expected[r["step"]]
            diffs = {k: (r.get(k), want.get(k)) for k in EXACT_KEYS if r.get(k) != want.get(k)}
            assert not diffs, f"{strategy} resumed from step {start}: step {r['step']} differs (got, want): {diffs}"
        ends = [r for r in records(out, "event") if r["event"] == "stage_end"]
        assert [{k: e[k] for k in EXACT_EVENT_KEYS} for e in ends] == [
            {k: e[k] for k in EXACT_EVENT_KEYS} for e in expected_ends if e["step"] > start]
        adapter = load_file(out / "final" / "adapter_model.safetensors")
        assert adapter.keys() == final.keys()
        unequal = [k for k in final if not torch.equal(adapter[k], final[k])]
        assert not unequal, f"{strategy} resumed from step {start}: final adapter differs in {unequal[:3]}"


# --- kill and resume ------------------------------------------------------------------------------------------------

KILLED_RANK = {"ddp": 1, "zero3": 0}
"""Under these strategies one training process is killed (as the out-of-memory killer does) and the launcher ends
the other; under FSDP the whole launch is (a lost node). What a kill leaves (a half-written checkpoint, a dead
peer) is the same under every strategy; that each strategy resumes exactly from every checkpoint is
test_resume_from_every_checkpoint_is_exact's."""


@pytest.fixture(scope="module")
def longer_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`get(strategy)`: the uninterrupted 16-step run (LONGER) under `strategy`, once per module, forked from the
    session's relauncher (conftest.train_forked: the launches under test are the killed and resumed ones). Its
    checkpoint settings do not change what trains, so runs that save differently compare with it too."""
    return launched_once(tmp_path_factory, "longer", lambda strategy, out: train_forked(strategy, 2, out, *LONGER))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_sigkill_and_resume_is_exact(strategy: str, tmp_path: Path, longer_runs: Callable[[str], Path]) -> None:
    reference, out, rank_logs = longer_runs(strategy), tmp_path / "killed", tmp_path / "rank-logs"
    kill_at = random.Random(strategy).randint(9, TOTAL_STEPS - 2)  # epoch 2 of stage 1, or inside stage 2
    killed = KILLED_RANK.get(strategy)
    proc = start_and_signal(train_cmd(strategy, 2, out, *LONGER, rank_logs=rank_logs), out, kill_at,
                            signal.SIGKILL, rank=killed)
    proc.communicate(timeout=120)
    # A step is logged before its checkpoint is written: the kill may land mid-save, leaving the step before.
    last = committed_checkpoints(out / "checkpoints")[-1]
    resumed_from = read_meta(last)["step"]
    assert kill_at - 1 <= resumed_from < TOTAL_STEPS
    if killed is not None:
        assert_survivor_names_the_lost_rank(rank_stderr(rank_logs, 1 - killed), killed, 1 - killed, out, last)
    train(strategy, 2, out, *LONGER)  # same command: resume: auto
    assert_same_run(out, reference)


def assert_survivor_names_the_lost_rank(stderr: str, killed: int, survivor: int, out: Path, last: Path) -> None:
    """The surviving rank's last words: one line, no traceback on stderr, naming the rank that died, the checkpoint
    a relaunch resumes from and its own log file, which holds the collective's traceback."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in stderr and len(errors) == 1 and toolkit_lines(stderr)[-1] == errors[0], stderr[-4000:]
    log = out / "logs" / f"rank-{survivor}.log"
    assert errors[0].startswith(f"error: rank {survivor} stopped: rank {killed} (pid "), errors[0]
    assert "died (killed by a signal or the out-of-memory killer" in errors[0]
    assert f"Relaunch the same command to resume from {last}." in errors[0]
    assert errors[0].endswith(f"The traceback of rank {survivor} is in {log}.")
    assert "Traceback (most recent call last)" in log.read_text() and "gloo" in log.read_text()


def test_sigterm_saves_and_exits_then_resumes_exactly(tmp_path: Path, longer_runs: Callable[[str], Path]) -> None:
    """Preemption without per-step saves: SIGTERM to the launcher makes every rank finish its step, save and
    exit with PREEMPTED_EXIT_CODE within the launcher's grace period."""
    reference, out = longer_runs("zero3"), tmp_path / "preempted"
    no_periodic = (*LONGER[:2], "checkpoint.save_on_stage_end=false")
    proc = start_and_signal(train_cmd("zero3", 2, out, *no_periodic), out, 5, signal.SIGTERM)
    output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert f"exitcode: {PREEMPTED_EXIT_CODE}" in output or "preempted" in output, output[-3000:]
    saved = committed_checkpoints(out / "checkpoints")
    assert len(saved) == 1 and 5 <= read_meta(saved[0])["step"] < TOTAL_STEPS
    train("zero3", 2, out, *no_periodic)
    assert_same_run(out, reference)


# --- early stage advance on eval patience, and resuming across it ---------------------------------------------------

# Stage 'short' may run 8 steps but evaluates every step; patience 1 with a min_delta no loss can beat ends it at
# the second evaluation (step 2). Stage 'long' then runs its 3 steps as steps 3-5.
PATIENCE = ("stages.0.max_steps=8", "stages.0.patience=1", "stages.0.patience_min_delta=100",
            "eval.data=[dummy:stage2]", "eval.every_steps=1", "checkpoint.save_steps=1", "checkpoint.keep_last=10")


def test_eval_patience_ends_the_stage_early_and_resume_replays_it(tmp_path: Path) -> None:
    early, planned = tmp_path / "early", tmp_path / "planned"
    train("single", 1, early, *PATIENCE)
    train_forked("single", 1, planned, *PATIENCE[:1], *PATIENCE[3:])  # same run without patience: 8 + 3 steps
    got = records(early)
    assert [(r["step"], r["stage"]) for r in got] == [(1, "short"), (2, "short"), (3, "long"), (4, "long"),
                                                      (5, "long")]
    events = [r for r in read_metrics(early / "metrics.jsonl") if r.get("event")]
    assert [(e["event"], e["stage"], e["step"]) for e in events] == [
        ("early_advance", "short", 2), ("stage_end", "short", 2), ("stage_end", "long", 5)]
    assert events[1]["stage_steps"] == 2 and events[1]["stage_samples"] == 2 * 4  # global batch 2 x 2 x 1
    full = records(planned)
    assert [r["loss"] for r in got[:2]] == pytest.approx([r["loss"] for r in full[:2]], rel=1e-6)
    # the next stage starts at once, with its own schedule from its first step: the lr the optimizer applied
    assert [r["lr"] for r in got[2:]] == pytest.approx([r["lr"] for r in full[8:]], rel=1e-9)
    assert (early / "final" / "adapter_model.safetensors").is_file()

    # Resumed before the advance (patience counters saved), at it, and after (stages moved up); forked from one
    # warm parent, as the every-checkpoint test's resumes are (the launch of `early` above is the one users make;
    # `planned`, only compared with, is forked too).
    steps = (1, 2, 3)
    argv = dummy_run_args(*PATIENCE)
    codes = relaunch("single", [([*argv, f"output_dir={tmp_path / f'from-{step}'}",
                                  f"checkpoint.resume={early / 'checkpoints' / f'step-{step:08d}'}"],
                                 tmp_path / f"from-{step}.log") for step in steps])
    for step, code in zip(steps, codes, strict=True):
        log = (tmp_path / f"from-{step}.log").read_text()
        assert code == 0 and f"resumed (exact) from {early / 'checkpoints'}" in log, log[-4000:]
        again = records(tmp_path / f"from-{step}")
        assert [(r["step"], r["stage"]) for r in again] == [(r["step"], r["stage"]) for r in got[step:]]
        assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in got[step:]], rel=1e-6)
        assert [r["lr"] for r in again] == pytest.approx([r["lr"] for r in got[step:]], rel=1e-9)
