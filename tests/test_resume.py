"""Kill and resume: SIGKILL a multi-stage run at a random step, relaunch it, get the uninterrupted losses.

The smoke recipe is stretched to 16 steps: stage 'short' runs 10 steps over 8 global batches per epoch (so
steps 9-10 are inside its second epoch), stage 'long' 6 steps. A checkpoint is committed after every step.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from tests.conftest import LAUNCH_TIMEOUT_S, rank_stderr, start_and_signal, toolkit_lines, train, train_cmd
from toolkit.checkpoint import committed_checkpoints, read_meta
from toolkit.metrics import read_metrics
from toolkit.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

LONGER = ("stages.0.max_steps=10", "stages.1.max_steps=6", "checkpoint.save_steps=1", "checkpoint.keep_last=2")
TOTAL_STEPS = 16


def records(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl", "train")


def assert_same_run(resumed: Path, reference: Path) -> None:
    got, ref = records(resumed), records(reference)
    assert [r["step"] for r in got] == list(range(1, TOTAL_STEPS + 1)), "steps missing or doubled"
    assert [r["stage"] for r in got] == [r["stage"] for r in ref]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in ref], rel=1e-9)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]


KILLED_RANK = {"ddp": 1, "zero3": 0}
"""Under these strategies one training process is killed (as the out-of-memory killer does) and the launcher ends
the other; under the others the whole launch is (a lost node)."""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "zero3"])
def test_sigkill_and_resume_is_exact(strategy: str, tmp_path: Path) -> None:
    reference, out, rank_logs = tmp_path / "uninterrupted", tmp_path / "killed", tmp_path / "rank-logs"
    train(strategy, 2, reference, *LONGER)
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


def test_sigterm_saves_and_exits_then_resumes_exactly(tmp_path: Path) -> None:
    """Preemption without per-step saves: SIGTERM to the launcher makes every rank finish its step, save and
    exit with PREEMPTED_EXIT_CODE within the launcher's grace period."""
    reference, out = tmp_path / "uninterrupted", tmp_path / "preempted"
    no_periodic = (*LONGER[:2], "checkpoint.save_on_stage_end=false")
    train("zero3", 2, reference, *no_periodic)
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
    train("single", 1, planned, *PATIENCE[:1], *PATIENCE[3:])  # same run without patience: 8 + 3 steps
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

    for step in (1, 2, 3):  # before the advance (patience counters saved), at it, and after (stages moved up)
        resumed = tmp_path / f"from-{step}"
        train("single", 1, resumed, *PATIENCE, f"checkpoint.resume={early / 'checkpoints' / f'step-{step:08d}'}")
        again = records(resumed)
        assert [(r["step"], r["stage"]) for r in again] == [(r["step"], r["stage"]) for r in got[step:]]
        assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in got[step:]], rel=1e-6)
        assert [r["lr"] for r in again] == pytest.approx([r["lr"] for r in got[step:]], rel=1e-9)
