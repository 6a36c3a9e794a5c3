"""Tests for toolkit/runtime/exit_lines.py: what a rank says when something unexpected stops it, whom it blames, and
where its traceback goes. The launches that kill one rank, or make one rank fail, are in tests/e2e/test_resume.py
(`test_sigkill_and_resume_is_exact`) and tests/e2e/test_nothing_lost.py (`test_a_failure_on_one_rank_*`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import train_curriculum
from tests.conftest import CHAT, base_recipe, write_jsonl
from tests.helpers.inprocess import Call, invoke
from toolkit.runtime.exit_lines import LastWords, Peer, blame
from toolkit.runtime.run_dir import RunLayout

GLOO_RESET = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:60607: "
                          "Connection reset by peer. This is typically caused by a remote worker hanging")


# --- whom a rank blames ------------------------------------------------------------------------------------------

def test_a_peer_that_stopped_on_an_error_of_its_own_is_named_with_it() -> None:
    peers = [Peer(0, {"kind": "error", "message": "data.jsonl:3: not valid JSON"}, 11, True), Peer(2, None, 12, False)]
    cause, resumable = blame(GLOO_RESET, peers)
    assert cause == "rank 0 (pid 11) stopped the run with an error: data.jsonl:3: not valid JSON"
    assert not resumable  # relaunching does not help before the input is fixed
    failed = [Peer(1, {"kind": "failed", "summary": "ValueError: x", "log": "run/logs/rank-1.log"}, 13, True)]
    cause, resumable = blame(GLOO_RESET, failed)
    assert cause.startswith("rank 1 (pid 13) failed (ValueError: x; its traceback is in run/logs/rank-1.log)")
    assert resumable
    assert blame(GLOO_RESET, [Peer(3, {"kind": "interrupted"}, None, None)])[0].startswith(
        "rank 3 was interrupted (Ctrl-C)")


def test_a_peer_process_gone_without_a_note_is_the_one_that_died() -> None:
    # Rank 2 also ended, but said why (it is a survivor that ended first): only rank 1 died.
    peers = [Peer(0, None, 10, False), Peer(1, None, 11, True), Peer(2, {"kind": "lost"}, 12, True),
             Peer(3, {"kind": "done"}, 13, True)]  # rank 3 ended as planned
    cause, resumable = blame(GLOO_RESET, peers)
    assert cause.startswith("rank 1 (pid 11) died (killed by a signal or the out-of-memory killer") and resumable


def test_a_lost_peer_that_cannot_be_seen_is_a_peer_process() -> None:
    unseen = [Peer(1, None, None, None), Peer(2, None, 40, None)]  # no record, or on another host
    cause, resumable = blame(GLOO_RESET, unseen)
    assert cause.startswith("a collective failed: a peer process ended or stopped responding (RuntimeError: ")
    assert "Connection reset by peer" in cause and resumable
    assert blame(torch.distributed.DistNetworkError("store gone"), unseen) is not None


def test_an_error_of_this_rank_with_every_peer_alive_or_done_is_its_own() -> None:
    peers = [Peer(1, None, 10, False), Peer(2, {"kind": "lost"}, 11, False), Peer(3, {"kind": "done"}, 12, True)]
    assert blame(ValueError("shapes do not match"), peers) is None
    assert blame(TimeoutError("Read timed out (hub download)"), peers) is None


def test_peers_are_read_from_the_store_and_this_host(tmp_path: Path) -> None:
    """Real processes and a real store: a killed peer is told from a live one and from one that left a note."""
    store = torch.distributed.HashStore()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        words = LastWords()
        words.rank, words.world = 0, 5
        records = {1: alive.pid, 2: dead.pid, 3: dead.pid}
        for rank, pid in records.items():
            store.set(f"pid/{rank}", json.dumps({"host": words.host, "pid": pid}))
        store.set("pid/4", json.dumps({"host": "another-node", "pid": dead.pid}))
        store.set("end/3", json.dumps({"kind": "lost"}))
        peers = {p.rank: p for p in words._peers(store)}
    finally:
        alive.kill()
        alive.wait()
    assert sorted(peers) == [1, 2, 3, 4]
    assert (peers[1].gone, peers[2].gone, peers[3].gone, peers[4].gone) == (False, True, True, None)
    assert peers[3].note == {"kind": "lost"} and peers[2].note is None
    cause, _ = blame(GLOO_RESET, list(peers.values()))
    assert cause.startswith(f"rank 2 (pid {dead.pid}) died")


# --- a rank's ending, in a real (single-process) run --------------------------------------------------------------

def _tiny_run(tmp_path: Path, models: dict[str, str]) -> Path:
    write_jsonl(tmp_path / "data.jsonl", [CHAT] * 8)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(base_recipe(models["text"])))
    return tmp_path / "run"


def test_an_unexpected_exception_ends_with_one_line_and_its_traceback_in_the_rank_log(
        tmp_path: Path, models: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    run = _tiny_run(tmp_path, models)
    real_step = train_curriculum.run_step

    def fails_at_step_2(r, stage, step_in_stage, step):
        if step == 1:
            raise KeyError("a bug in the loop")
        return real_step(r, stage, step_in_stage, step)

    monkeypatch.setattr(train_curriculum, "run_step", fails_at_step_2)
    rc, stderr = invoke(Call(["--config", "recipe.yaml"], run), tmp_path, monkeypatch)
    assert rc == 1 and "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    log = RunLayout("run").rank_log(0, outputs_written=True)
    assert errors == [f"error: the run failed: KeyError: 'a bug in the loop' (its traceback is in {log}). Relaunch "
                      "the same command to resume from run/checkpoints/step-00000001. If it fails the same way, "
                      "report it with that traceback."]
    text = (tmp_path / log).read_text()
    assert "Traceback (most recent call last)" in text and "fails_at_step_2" in text and "rank 0 of 1" in text


def test_an_unexpected_exception_before_the_outputs_leaves_the_output_dir_alone(
        tmp_path: Path, models: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    run = _tiny_run(tmp_path, models)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the model could not be built")

    monkeypatch.setattr(train_curriculum, "build_model", broken)
    rc, stderr = invoke(Call(["--config", "recipe.yaml"], run), tmp_path, monkeypatch)
    assert rc == 1 and "Traceback" not in stderr, stderr[-3000:]
    log = RunLayout("run").rank_log(0, outputs_written=False)
    assert [line for line in stderr.splitlines() if line.startswith("error: ")] == [
        f"error: the run failed: RuntimeError: the model could not be built (its traceback is in {log}). No "
        "checkpoint was committed yet: relaunch the same command to start again. If it fails the same way, report "
        "it with that traceback."]
    assert str(log).startswith(".toolkit-cache/logs/run/") and "the model could not be built" in (tmp_path / log
                                                                                                   ).read_text()
    assert not run.exists()
