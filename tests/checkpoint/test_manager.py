"""Unit tests for toolkit/checkpoint/manager.py: atomic commit, rotation + best tracking, resume lookup, file checks.

Single process throughout (is_main=True, a no-op barrier); write_state writes small safetensors / torch files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
import random
import re
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.checkpoint.manager import BEST_FILE, META_FILE, CheckpointManager, file_digests, read_meta
from toolkit.checkpoint.resume import check_resumable, check_state, find_resume
from toolkit.checkpoint.safe_load import verify_checkpoint_files
from toolkit.config.identity import recipe_hash
from toolkit.errors import ToolkitError
from toolkit.runtime.run_dir import COMMIT_MARKER, committed_checkpoints

_STEP_NAME = re.compile(r"^step-(\d{8})$")


# --- helpers ---------------------------------------------------------------------------------------------------

def _noop() -> None:
    return None


def _manager(root: Path, *, keep_last: int = 2, best_metric: str | None = "eval_loss", best_mode: str = "min",
             is_main: bool = True, barrier: Callable[[], None] = _noop) -> CheckpointManager:
    return CheckpointManager(root, keep_last=keep_last, best_metric=best_metric, best_mode=best_mode,
                             is_main=is_main, barrier=barrier)


def _writer(step: int) -> Callable[[Path], None]:
    """A write_state whose files carry `step`, so a test can tell which save a directory came from."""

    def write_state(tmp: Path) -> None:
        save_file({"weight": torch.full((2, 3), float(step))}, str(tmp / "model.safetensors"))
        torch.save({"state": {0: {"exp_avg": torch.full((3,), float(step)), "step": torch.tensor(float(step))}},
                    "param_groups": [{"lr": 0.1, "params": [0]}]}, tmp / "optimizer.bin")

    return write_state


def _save(mgr: CheckpointManager, step: int, metrics: dict[str, Any] | None = None) -> Path:
    meta: dict[str, Any] = {"step": step, "world_size": 1, "strategy": "ddp"}
    if metrics is not None:
        meta["metrics"] = metrics
    return mgr.save(step, _writer(step), meta)


def _steps(root: Path) -> set[int]:
    """Steps of every `step-XXXXXXXX` directory (committed or not) under root."""
    return {int(m.group(1)) for p in root.iterdir() if (m := _STEP_NAME.match(p.name)) and p.is_dir()}


def _step_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step-*"))


def _written_step(ckpt: Path) -> float:
    return float(load_file(str(ckpt / "model.safetensors"))["weight"][0, 0])


def _best_record(step: int, metric: str, value: float) -> dict[str, Any]:
    return {"step": step, "metric": metric, "value": value, "path": f"step-{step:08d}"}


# --- constructor -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep_last", [0, -1])
def test_keep_last_below_one_is_refused(tmp_path: Path, keep_last: int) -> None:
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        _manager(tmp_path / "ck", keep_last=keep_last)


# --- rotation and best tracking ---------------------------------------------------------------------------------

def _loss_min_at_4(step: int) -> float:
    return 0.1 if step == 4 else 1.0 + step / 100


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_rotation_keeps_last_and_best_across_restart(tmp_path: Path, keep_last: int) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=keep_last)
    for step in range(1, 31):
        final = _save(mgr, step, {"eval_loss": _loss_min_at_4(step)})
        assert final == root / f"step-{step:08d}"
        best_step = 1 if step < 4 else 4
        expected = set(range(max(1, step - keep_last + 1), step + 1)) | {best_step}
        assert _steps(root) == expected, step
        assert len(_step_entries(root)) <= keep_last + 1
        assert [p.name for p in committed_checkpoints(root)] == [f"step-{s:08d}" for s in sorted(expected)]
        assert mgr.best == _best_record(best_step, "eval_loss", _loss_min_at_4(best_step))
    assert json.loads((root / BEST_FILE).read_text()) == _best_record(4, "eval_loss", 0.1)
    assert find_resume("auto", root) == root / "step-00000030"

    # As after a resume: a fresh manager over the same root keeps honouring best.json.
    mgr2 = _manager(root, keep_last=keep_last)
    assert mgr2.best == _best_record(4, "eval_loss", 0.1)
    for step in range(31, 36):
        _save(mgr2, step, {"eval_loss": 0.5})
        assert _steps(root) == set(range(step - keep_last + 1, step + 1)) | {4}
    best_dir = root / "step-00000004"
    assert (best_dir / COMMIT_MARKER).is_file()
    assert read_meta(best_dir)["metrics"] == {"eval_loss": 0.1}
    assert _written_step(best_dir) == 4.0
    verify_checkpoint_files(best_dir)
    assert not list(root.glob("*.tmp"))


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_best_moves_when_metric_improves_later(tmp_path: Path, keep_last: int) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=keep_last)

    def loss(step: int) -> float:
        return {4: 0.1, 12: 0.1, 20: 0.05}.get(step, 1.0 + step / 100)  # step 12 only ties

    for step in range(1, 31):
        _save(mgr, step, {"eval_loss": loss(step)})
        best_step = 1 if step < 4 else 4 if step < 20 else 20
        assert _steps(root) == set(range(max(1, step - keep_last + 1), step + 1)) | {best_step}, step
        if step == 20:
            assert not (root / "step-00000004").exists()
    assert mgr.best == _best_record(20, "eval_loss", 0.05)
    assert _steps(root) == set(range(31 - keep_last, 31)) | {20}


@pytest.mark.parametrize("keep_last", [1, 3])
def test_best_mode_max(tmp_path: Path, keep_last: int) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=keep_last, best_metric="eval_acc", best_mode="max")

    def acc(step: int) -> float:
        return {4: 0.9, 10: 0.9, 20: 0.95}.get(step, 0.5 - step / 100)  # step 10 only ties: not better

    for step in range(1, 31):
        _save(mgr, step, {"eval_acc": acc(step), "eval_loss": 100.0 - step})
        best_step = 1 if step < 4 else 4 if step < 20 else 20
        assert mgr.best == _best_record(best_step, "eval_acc", acc(best_step)), step
        assert _steps(root) == set(range(max(1, step - keep_last + 1), step + 1)) | {best_step}, step
    assert not (root / "step-00000004").exists()
    assert not (root / "step-00000010").exists()


def test_missing_or_non_finite_metric_never_becomes_best(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=2)
    _save(mgr, 1, {"eval_loss": float("nan")})
    assert mgr.best is None
    assert not (root / BEST_FILE).exists()
    _save(mgr, 2, {"train_loss": 0.3})  # best metric missing
    _save(mgr, 3)  # no metrics at all
    _save(mgr, 4, {"eval_loss": float("-inf")})  # would beat everything in min mode
    _save(mgr, 5, {"eval_loss": float("inf")})
    _save(mgr, 6, {"eval_loss": None})
    assert mgr.best is None
    assert _steps(root) == {5, 6}  # without a best only the last keep_last survive

    _save(mgr, 7, {"eval_loss": 0.5})
    assert mgr.best == _best_record(7, "eval_loss", 0.5)
    for step in (8, 9, 10):
        _save(mgr, step, {"eval_loss": float("nan")})
    _save(mgr, 11, {"other": 0.0})
    assert mgr.best == _best_record(7, "eval_loss", 0.5)
    assert _steps(root) == {7, 10, 11}


def test_max_mode_nan_never_becomes_best(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=1, best_metric="eval_acc", best_mode="max")
    _save(mgr, 1, {"eval_acc": float("nan")})
    _save(mgr, 2, {"eval_acc": float("inf")})
    assert mgr.best is None
    _save(mgr, 3, {"eval_acc": 0.2})
    _save(mgr, 4, {"eval_acc": float("nan")})
    assert mgr.best == _best_record(3, "eval_acc", 0.2)
    assert _steps(root) == {3, 4}


def test_no_best_metric_keeps_only_last(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=2, best_metric=None)
    for step in range(1, 8):
        _save(mgr, step, {"eval_loss": 1.0 / step if step != 2 else 0.0})
    assert mgr.best is None
    assert not (root / BEST_FILE).exists()
    assert _steps(root) == {6, 7}


# --- a damaged best.json ---------------------------------------------------------------------------------------

def _run_with_best_at_4(root: Path) -> None:
    """Steps 1-8 saved with keep_last 2, eval_loss lowest at step 4: on disk steps 4, 7, 8; best.json names 4."""
    mgr = _manager(root, keep_last=2)
    for step in range(1, 9):
        _save(mgr, step, {"eval_loss": _loss_min_at_4(step)})
    assert _steps(root) == {4, 7, 8}


def _uncommitted_step_5(root: Path) -> str:
    shutil.copytree(root / "step-00000007", root / "step-00000005")
    (root / "step-00000005" / COMMIT_MARKER).unlink()
    return json.dumps(_best_record(5, "eval_loss", 0.05))


DAMAGED_BEST = {
    "truncated": lambda root: json.dumps(_best_record(4, "eval_loss", 0.1))[:17],
    "invalid-json": lambda root: "best: step 4\n",
    "empty": lambda root: "",
    "not-utf8": lambda root: b"\xff\xfe{".decode("latin-1"),
    "a-list": lambda root: json.dumps([4, 0.1]),
    "missing-keys": lambda root: json.dumps({"step": 4}),
    "value-not-a-number": lambda root: json.dumps({**_best_record(4, "eval_loss", 0.1), "value": "0.1"}),
    "path-not-of-step": lambda root: json.dumps({**_best_record(4, "eval_loss", 0.1), "path": "../../somewhere"}),
    "another-metric": lambda root: json.dumps(_best_record(4, "eval_acc", 0.1)),
    "deleted-step": lambda root: json.dumps(_best_record(2, "eval_loss", 0.01)),
    "uncommitted-step": _uncommitted_step_5,
    "stale": lambda root: json.dumps(_best_record(7, "eval_loss", _loss_min_at_4(7))),  # crash before its update
    "missing": None,
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_BEST))
def test_damaged_best_record_is_rebuilt_and_rotation_keeps_the_true_best(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """best.json damaged in any way (as a crash, a full disk or a hand edit leave it): the next run warns once,
    rewrites it from the checkpoints' meta.json, deletes nothing because of it, and rotation keeps the true best."""
    root = tmp_path / "ck"
    _run_with_best_at_4(root)
    make = DAMAGED_BEST[damage]
    if make is None:
        (root / BEST_FILE).unlink()
    else:
        (root / BEST_FILE).write_bytes(make(root).encode("latin-1" if damage == "not-utf8" else "utf-8"))
    on_disk = _step_entries(root)

    with caplog.at_level("WARNING", logger="toolkit.checkpoint.manager"):
        mgr = _manager(root, keep_last=2)  # a relaunch
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "rebuilt from the committed checkpoints' meta.json" in warnings[0], warnings
    assert "step-00000004" in warnings[0] and "No checkpoint was deleted" in warnings[0]
    assert _step_entries(root) == on_disk  # nothing deleted on the record's account
    assert mgr.best == _best_record(4, "eval_loss", 0.1)
    assert json.loads((root / BEST_FILE).read_text()) == _best_record(4, "eval_loss", 0.1)

    for step in (9, 10, 11):  # rotation with the rebuilt record: the true best stays
        _save(mgr, step, {"eval_loss": 0.5})
    # An unmarked folder was never committed by this toolkit: rotation leaves it (issue 39).
    assert _steps(root) == {4, 10, 11} | ({5} if damage == "uncommitted-step" else set())
    caplog.clear()
    with caplog.at_level("WARNING", logger="toolkit.checkpoint.manager"):
        assert _manager(root, keep_last=2).best == _best_record(4, "eval_loss", 0.1)  # and the next launch
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_best_record_damaged_during_a_run_does_not_stop_it(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=1)
    for step in range(1, 7):
        _save(mgr, step, {"eval_loss": _loss_min_at_4(step)})
        (root / BEST_FILE).write_text('{"step": ')
    assert _steps(root) == {4, 6}
    assert _manager(root, keep_last=1).best == _best_record(4, "eval_loss", 0.1)


def test_damaged_best_record_without_any_metric_is_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=2)
    for step in (1, 2, 3):
        _save(mgr, step, {"train_loss": 1.0})
    (root / BEST_FILE).write_text(json.dumps(_best_record(1, "eval_loss", 0.1)))  # names a deleted step
    with caplog.at_level("WARNING", logger="toolkit.checkpoint.manager"):
        mgr = _manager(root, keep_last=2)
    assert "no committed checkpoint has a eval_loss value yet" in caplog.text
    assert mgr.best is None and not (root / BEST_FILE).exists()
    _save(mgr, 4, {"train_loss": 1.0})
    assert _steps(root) == {3, 4}


def test_best_record_of_a_run_without_best_metric_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _run_with_best_at_4(root)
    (root / BEST_FILE).write_text("{")
    mgr = _manager(root, keep_last=2, best_metric=None)
    assert mgr.best is None
    _save(mgr, 9)
    assert (root / BEST_FILE).read_text() == "{"
    assert _steps(root) == {8, 9}


# --- crashes and resume lookup ----------------------------------------------------------------------------------

def _crashing_writer(tmp: Path) -> None:
    save_file({"weight": torch.zeros(2, 3)}, str(tmp / "model.safetensors"))
    raise RuntimeError("simulated crash half-way through write_state")


def test_crash_during_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=2)
    for step in (1, 2, 3):
        _save(mgr, step, {"eval_loss": 1.0 - step / 10})
    best_before = mgr.best
    assert best_before == _best_record(3, "eval_loss", 0.7)

    with pytest.raises(RuntimeError, match="simulated crash half-way"):
        mgr.save(4, _crashing_writer, {"step": 4, "metrics": {"eval_loss": 0.0}})
    assert not (root / "step-00000004").exists()
    assert (root / "step-00000004.tmp").is_dir()  # the half-written state is left behind...
    assert not (root / "step-00000004.tmp" / COMMIT_MARKER).exists()
    assert not (root / "step-00000004.tmp" / META_FILE).exists()
    assert committed_checkpoints(root) == [root / "step-00000002", root / "step-00000003"]
    assert find_resume("auto", root) == root / "step-00000003"
    assert mgr.best == best_before  # the crashed step's metric was never recorded

    # ... until the next successful save (after a restart: a new manager) rotates it away.
    mgr2 = _manager(root, keep_last=2)
    _save(mgr2, 5, {"eval_loss": 0.9})
    assert not (root / "step-00000004.tmp").exists()
    assert _step_entries(root) == ["step-00000003", "step-00000005"]
    assert find_resume("auto", root) == root / "step-00000005"


def test_crash_then_same_step_saved_again(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=2, best_metric=None)
    _save(mgr, 1)
    with pytest.raises(RuntimeError):
        mgr.save(2, _crashing_writer, {"step": 2})
    _save(mgr, 2)
    assert _step_entries(root) == ["step-00000001", "step-00000002"]
    assert sorted(p.name for p in (root / "step-00000002").iterdir()) == sorted(
        [COMMIT_MARKER, META_FILE, "model.safetensors", "optimizer.bin"])
    assert _written_step(root / "step-00000002") == 2.0


def test_failing_barrier_after_write_commits_nothing(tmp_path: Path) -> None:
    """Another rank dying while writing its shards (the barrier raises) must not commit the step."""
    root = tmp_path / "ck"
    _save(_manager(root), 1)
    calls = []

    def barrier() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("peer died")

    with pytest.raises(RuntimeError, match="peer died"):
        _save(_manager(root, barrier=barrier), 2)
    assert committed_checkpoints(root) == [root / "step-00000001"]
    assert find_resume("auto", root) == root / "step-00000001"


def test_unmarked_step_directory_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=3, best_metric=None)
    for step in (1, 2, 3):
        _save(mgr, step)
    fake = root / "step-00000009"
    shutil.copytree(root / "step-00000003", fake)
    (fake / COMMIT_MARKER).unlink()

    assert committed_checkpoints(root) == [root / f"step-0000000{s}" for s in (1, 2, 3)]
    assert find_resume("auto", root) == root / "step-00000003"
    with pytest.raises(ToolkitError, match="interrupted") as err:
        find_resume(str(fake), root)
    assert str(fake) in str(err.value)
    assert COMMIT_MARKER in str(err.value)

    _save(mgr, 4)  # rotation leaves the unmarked directory: this toolkit never committed it (issue 39)
    assert _step_entries(root) == ["step-00000002", "step-00000003", "step-00000004", "step-00000009"]


def test_find_resume_explicit_paths(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    ckpt = _save(_manager(root), 1)
    assert find_resume(str(ckpt), root) == ckpt

    missing = tmp_path / "nowhere" / "step-00000100"
    with pytest.raises(ToolkitError, match="does not exist") as err:
        find_resume(str(missing), root)
    assert f"'{missing}'" in str(err.value)

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ToolkitError, match=re.escape(f"'{not_a_dir}' does not exist")):
        find_resume(str(not_a_dir), root)


def test_find_resume_none_and_empty(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    assert find_resume("auto", root) is None  # missing root
    assert committed_checkpoints(root) == []
    root.mkdir()
    assert find_resume("auto", root) is None  # empty root
    (root / "step-00000001.tmp").mkdir()
    (root / "step-00000002").mkdir()  # unmarked
    (root / "notes.txt").write_text("x")
    assert find_resume("auto", root) is None
    _save(_manager(root), 3)
    assert find_resume("none", root) is None  # even with committed checkpoints present
    assert find_resume("auto", root) == root / "step-00000003"


def test_same_step_saved_twice_is_replaced(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, keep_last=2, best_metric=None)
    _save(mgr, 4)
    mgr.save(5, _writer(5), {"step": 5, "pass": 1})
    mgr.save(5, _writer(50), {"step": 5, "pass": 2})
    assert _step_entries(root) == ["step-00000004", "step-00000005"]
    final = root / "step-00000005"
    assert committed_checkpoints(root) == [root / "step-00000004", final]
    assert read_meta(final) == {"step": 5, "pass": 2, "files": file_digests(final)}
    assert _written_step(final) == 50.0


# --- atomicity details ------------------------------------------------------------------------------------------

def test_save_commit_protocol(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    meta = {"step": 7, "world_size": 2, "strategy": "zero2", "recipe_hash": recipe_hash({"lr": 1e-4}),
            "effective_batch": 16, "stage": "short", "metrics": {"eval_loss": 0.25, "eval_acc": 0.5},
            "nested": [1, 2.5, {"a": None, "b": [True, False]}], "text": "ünïcode"}
    seen: list[tuple[Path, list[str]]] = []

    def write_state(tmp: Path) -> None:
        seen.append((tmp, sorted(p.name for p in tmp.iterdir())))
        _writer(7)(tmp)
        (tmp / "portable").mkdir()
        save_file({"param/x": torch.ones(2)}, str(tmp / "portable" / "lora_state.safetensors"))

    (root / "step-00000007.tmp").mkdir(parents=True)  # stale content from an earlier crash
    (root / "step-00000007.tmp" / "junk.bin").write_bytes(b"junk")
    before = time.time()
    final = _manager(root).save(7, write_state, meta)
    after = time.time()

    assert final == root / "step-00000007"
    assert seen == [(root / "step-00000007.tmp", [])]  # write_state got a fresh, empty temp dir
    # meta.json holds the given meta plus the size and sha256 of every other file, checked on resume
    files = {rel: {"bytes": (final / rel).stat().st_size, "sha256": hashlib.sha256((final / rel).read_bytes())
                   .hexdigest()} for rel in ("model.safetensors", "optimizer.bin", "portable/lora_state.safetensors")}
    assert read_meta(final) == meta | {"files": files}
    assert json.loads((final / META_FILE).read_text()) == meta | {"files": files}
    assert (final / COMMIT_MARKER).is_file()
    assert before <= float((final / COMMIT_MARKER).read_text()) <= after
    assert sorted(p.relative_to(final).as_posix() for p in final.rglob("*")) == [
        COMMIT_MARKER, META_FILE, "model.safetensors", "optimizer.bin", "portable",
        "portable/lora_state.safetensors"]
    assert sorted(p.name for p in root.iterdir()) == [BEST_FILE, "step-00000007"]
    assert not list(root.rglob("*.tmp"))
    verify_checkpoint_files(final)


def test_meta_with_nan_metric_round_trips(tmp_path: Path) -> None:
    final = _save(_manager(tmp_path / "ck"), 1, {"eval_loss": float("nan"), "eval_acc": 0.5})
    metrics = read_meta(final)["metrics"]
    assert math.isnan(metrics["eval_loss"])
    assert metrics["eval_acc"] == 0.5


def test_barrier_calls_and_non_main_rank(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    calls: list[str] = []
    mgr = _manager(root, barrier=lambda: calls.append("barrier"))
    mgr.save(1, lambda tmp: calls.append(f"write {tmp.name}"), {"step": 1})
    assert calls == ["barrier", "write step-00000001.tmp", "barrier", "barrier"]

    # A non-main rank only writes its own files into the temp dir (rank 0 created it) and commits nothing.
    calls.clear()
    (root / "step-00000002.tmp").mkdir()
    other = _manager(root, is_main=False, barrier=lambda: calls.append("barrier"))
    final = other.save(2, lambda tmp: (tmp / "rank1.bin").write_bytes(b""), {"step": 2})
    assert final == root / "step-00000002"
    assert calls == ["barrier", "barrier", "barrier"]
    assert sorted(p.name for p in (root / "step-00000002.tmp").iterdir()) == ["rank1.bin"]
    assert not final.exists()
    assert committed_checkpoints(root) == [root / "step-00000001"]


# --- verify_checkpoint_files ------------------------------------------------------------------------------------

class _Shell:
    """Unpickling this runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def _touch(path: Path) -> _Shell:
    return _Shell(f"touch {shlex.quote(str(path))}")


def _good_checkpoint(ckpt: Path) -> None:
    ckpt.mkdir(parents=True)
    save_file({"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
              str(ckpt / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.ones(3), "step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]}, ckpt / "optimizer.bin")
    torch.save({"base_lrs": [0.1], "last_epoch": 3, "_step_count": 4, "lr_lambdas": [None]},
               ckpt / "custom_checkpoint_0.pkl")
    torch.save({"step": 0, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, ckpt / "random_states_0.pkl")
    (ckpt / META_FILE).write_text("{}")
    (ckpt / COMMIT_MARKER).write_text("1\n")


def test_verify_accepts_accelerate_style_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    verify_checkpoint_files(ckpt)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_accepts_real_dcp_checkpoint(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    state = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
             "optim": {"step": 3, "lr": 0.1, "groups": [{"params": ["w"], "betas": (0.9, 0.99)}]}}
    dcp.save(state, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    assert (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file()
    verify_checkpoint_files(ckpt)


def test_verify_refuses_torch_saved_code(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    pwned = tmp_path / "pwned"
    torch.save({"base_lrs": [0.1], "hook": _touch(pwned)}, ckpt / "scheduler.bin")
    with pytest.raises(ToolkitError, match="Refusing to load checkpoint") as err:
        verify_checkpoint_files(ckpt)
    assert "scheduler.bin" in str(err.value)
    assert str(ckpt) in str(err.value)
    assert "system" in str(err.value)  # names the offending global
    assert not pwned.exists()


def test_verify_refuses_plain_pickle(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    pwned = tmp_path / "pwned"
    with (ckpt / "random_states_1.pkl").open("wb") as f:
        pickle.dump({"step": 0, "random_state": _touch(pwned)}, f)
    with pytest.raises(ToolkitError) as err:
        verify_checkpoint_files(ckpt)
    assert "random_states_1.pkl" in str(err.value)
    assert "pickle opcode" in str(err.value) and "weights_only" not in str(err.value)  # never torch's advice
    assert not pwned.exists()


def test_verify_refuses_malicious_dcp_metadata(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    (ckpt / "pytorch_model_fsdp_0").mkdir()
    pwned = tmp_path / "pwned"
    (ckpt / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps({"planner": _touch(pwned)}))
    with pytest.raises(ToolkitError, match="Refusing to load checkpoint") as err:
        verify_checkpoint_files(ckpt)
    assert ".metadata contains pickled objects" in str(err.value)
    assert "system is not allowed" in str(err.value)
    assert not pwned.exists()


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def test_verify_reports_truncated_safetensors(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    (ckpt / "portable").mkdir()
    target = ckpt / "portable" / "lora_state.safetensors"
    save_file({"param/x": torch.arange(1000.0)}, str(target))
    _truncate(target)
    with pytest.raises(ToolkitError, match="is damaged") as err:
        verify_checkpoint_files(ckpt)
    assert "portable/lora_state.safetensors cannot be read" in str(err.value)
    assert f"Checkpoint {ckpt} is damaged" in str(err.value)


@pytest.mark.parametrize("keep", [None, 100, 0])
def test_verify_reports_truncated_torch_file(tmp_path: Path, keep: int | None) -> None:
    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    _truncate(ckpt / "optimizer.bin", keep)
    with pytest.raises(ToolkitError, match=re.escape("is damaged: optimizer.bin cannot be read")):
        verify_checkpoint_files(ckpt)


def _stack_global_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol-4 pickle calling `module`.`name`(arg); `name` may be dotted (resolved attribute by attribute)."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw

    return (pickle.PROTO + b"\x04" + text(module) + text(name) + pickle.STACK_GLOBAL + text(arg)
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


def test_verify_refuses_dotted_global_bypass_in_dcp_metadata(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    (ckpt / "pytorch_model_fsdp_0").mkdir()
    pwned = tmp_path / "pwned"
    (ckpt / "pytorch_model_fsdp_0" / ".metadata").write_bytes(
        _stack_global_pickle("torch.distributed.checkpoint.filesystem", "os.mkdir", str(pwned)))
    try:
        with pytest.raises(ToolkitError, match=r"\.metadata"):
            verify_checkpoint_files(ckpt)
    finally:
        assert not pwned.exists(), "verify_checkpoint_files executed code from .metadata"


class _Mkdir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_refuses_code_in_distcp_bytes_entry(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "step-00000001"
    _good_checkpoint(ckpt)
    pwned = tmp_path / "pwned"
    dcp.save({"w": torch.zeros(3), "extra": _Mkdir(str(pwned))}, checkpoint_id=str(ckpt / "optimizer_0"))
    assert not pwned.exists()  # saving does not run it; loading with dcp.load would
    with pytest.raises(ToolkitError, match=r"__0_0\.distcp"):
        verify_checkpoint_files(ckpt)


# --- check_resumable / recipe_hash ------------------------------------------------------------------------------

def _meta(hash_: str, batch: int, strategy: str = "ddp", world_size: int = 2) -> dict[str, Any]:
    return {"recipe_hash": hash_, "effective_batch": batch, "step": 10, "strategy": strategy,
            "world_size": world_size}


def _check(meta: dict[str, Any], ckpt: Path, *, invariants_hash: str, effective_batch: int, force: bool = False,
           strategy: str = "ddp", world_size: int = 2, stage_batches: list[int] | None = None,
           invariants: dict[str, Any] | None = None, data_files: dict[str, str] | None = None) -> list[str]:
    return check_resumable(meta, ckpt, invariants_hash=invariants_hash, effective_batch=effective_batch,
                           strategy=strategy, world_size=world_size, force=force, stage_batches=stage_batches,
                           invariants=invariants, data_files=data_files)


def test_check_resumable_accepts_matching(tmp_path: Path) -> None:
    h = recipe_hash({"lr": 1e-4})
    assert _check(_meta(h, 8), tmp_path, invariants_hash=h, effective_batch=8) == []


def test_check_resumable_refuses_other_recipe(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000010"
    with pytest.raises(ToolkitError, match="resume_force") as err:
        _check(_meta("a" * 16, 8), ckpt, invariants_hash="b" * 16, effective_batch=8)
    assert f"Checkpoint {ckpt} was written with different training settings" in str(err.value)
    # both problems at once: the recipe is reported first
    with pytest.raises(ToolkitError, match="resume_force"):
        _check(_meta("a" * 16, 8), ckpt, invariants_hash="b" * 16, effective_batch=4)


def test_check_resumable_refuses_other_batch(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000010"
    with pytest.raises(ToolkitError, match=r"effective batch of 16, this run has 8 ") as err:
        _check(_meta("h", 16), ckpt, invariants_hash="h", effective_batch=8)
    assert "resume_force" not in str(err.value)
    assert str(ckpt) in str(err.value)


def test_check_resumable_force_skips_only_hash(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000010"
    assert _check(_meta("a", 8), ckpt, invariants_hash="b", effective_batch=8, force=True) != []
    with pytest.raises(ToolkitError, match=r"effective batch of 8, this run has 32 "):
        _check(_meta("a", 8), ckpt, invariants_hash="b", effective_batch=32, force=True)
    with pytest.raises(ToolkitError, match=r"effective batch of 8, this run has 32 "):
        _check(_meta("a", 8), ckpt, invariants_hash="a", effective_batch=32, force=True)


def test_force_cannot_carry_a_resume_past_what_the_state_holds(tmp_path: Path) -> None:
    """What resume_force may override follows from the checkpoint's state (it used to be a hand-kept list of lora
    keys, and a changed model or trainable set ended in a raw load_state_dict RuntimeError and "report it"): the
    model it trained (its state holds every weight) is refused before the model is built; a change of the
    parameters' set or shapes is refused once the model is built, by its state signature, before the weights load,
    naming the keys with both values; what shapes nothing (lora.alpha, the lr) stays forcible."""
    ckpt = tmp_path / "step-00000010"
    saved = {"model": {"name_or_path": "org/a"}, "lora": {"r": 8, "alpha": 16}, "optimizer": {"lr": 1e-3}}
    meta = {**_meta(recipe_hash(saved), 8), "invariants": saved}

    def check(now: dict[str, Any]) -> list[str]:
        return _check(meta, ckpt, invariants_hash=recipe_hash(now), effective_batch=8, force=True, invariants=now)

    with pytest.raises(ToolkitError, match=r'even with checkpoint.resume_force: model\.name_or_path \("org/a" -> '
                                           r'"org/b"\) changed, and its state holds the weights of the model it'):
        check({**saved, "model": {"name_or_path": "org/b"}})
    rank = {**saved, "lora": {"r": 16, "alpha": 16}}
    assert check(rank) == ["changed settings: lora.r"]  # the settings alone do not tell: the built model does
    state = {"parameters": "p1", "optimizer": "o1"}
    with pytest.raises(ToolkitError, match=r"lora\.r \(8 -> 16\) changed, and its weights and its Adam state do not "
                                           r"fit the parameters this recipe trains"):
        check_state({**meta, "state": state}, ckpt, {"parameters": "p2", "optimizer": "o2"}, rank)
    trainable = {**saved, "trainable": ["lora", "model.norm"]}
    with pytest.raises(ToolkitError, match=r'trainable \(null -> \["lora", "model.norm"\]\) changed, and its Adam '
                                           r"state do not fit"):
        check_state({**meta, "state": state}, ckpt, {"parameters": "p1", "optimizer": "o2"}, trainable)
    alpha = {**saved, "lora": {"r": 8, "alpha": 32}}
    assert check(alpha) == ["changed settings: lora.alpha"]
    check_state({**meta, "state": state}, ckpt, state, alpha)  # the same parameters: forcible
    check_state(meta, ckpt, state, rank)  # a checkpoint of an earlier version: its load says it (restore)


@pytest.mark.parametrize(("strategy", "world_size"), [("fsdp", 2), ("ddp", 4), ("zero3", 1)])
def test_check_resumable_other_layout_needs_portable_state(tmp_path: Path, strategy: str, world_size: int) -> None:
    ckpt = tmp_path / "step-00000010"
    ckpt.mkdir()
    with pytest.raises(ToolkitError, match=re.escape(f"written by ddp x 2; this run is {strategy} x {world_size}")):
        _check(_meta("h", 8), ckpt, invariants_hash="h", effective_batch=8, strategy=strategy,
               world_size=world_size, force=True)  # force does not make shards loadable
    (ckpt / "portable").mkdir()
    save_file({"param/x": torch.ones(2)}, str(ckpt / "portable" / "lora_state.safetensors"))
    assert _check(_meta("h", 8), ckpt, invariants_hash="h", effective_batch=8, strategy=strategy,
                  world_size=world_size) == []
    with pytest.raises(ToolkitError, match="resume_force"):  # the other checks still apply
        _check(_meta("h", 8), ckpt, invariants_hash="x", effective_batch=8, strategy=strategy,
               world_size=world_size)


def test_recipe_hash() -> None:
    a = {"model": "tiny", "lora": {"r": 8, "alpha": 16}, "seed": 1}
    b = {"seed": 1, "lora": {"alpha": 16, "r": 8}, "model": "tiny"}
    h = recipe_hash(a)
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    assert recipe_hash(b) == h  # key order does not matter, nested included
    assert recipe_hash({**a, "seed": 2}) != h
    assert recipe_hash({**a, "lora": {"r": 16, "alpha": 16}}) != h
    assert recipe_hash({}) == "44136fa355b3678a"  # sha256("{}")[:16]


def test_check_resumable_compares_each_stage_global_batch(tmp_path: Path) -> None:
    meta = _meta("h", 8) | {"stage_batches": [8, 8, 4]}
    _check(meta, tmp_path, invariants_hash="h", effective_batch=8, stage_batches=[8, 8, 4])
    with pytest.raises(ToolkitError, match=r"trained stage 2 with a global batch of 4, this run has 8 "
                                           r"\(stages\.2\.micro_batch_size x grad_accum x processes\)"):
        _check(meta, tmp_path, invariants_hash="h", effective_batch=8, stage_batches=[8, 8, 8])
    _check(_meta("h", 8), tmp_path, invariants_hash="h", effective_batch=8, stage_batches=[8, 8, 8])  # older meta


def test_check_resumable_keeps_the_length_of_begun_stages(tmp_path: Path) -> None:
    """Stages up to the checkpoint's own keep their planned length (even forced); later ones may change."""
    meta = _meta("h", 8) | {"stage_plan_steps": [4, 3, 4], "stage_index": 1}
    assert check_resumable(meta, tmp_path, invariants_hash="h", effective_batch=8, strategy="ddp", world_size=2,
                           force=True, stage_steps=[4, 3, 9]) == []  # a later stage: this run's plan
    for changed, stage in (([5, 3, 4], 0), ([4, 2, 4], 1), ([4], 1)):
        with pytest.raises(ToolkitError, match=rf"stage {stage} was planned for .* even with checkpoint.resume_force"):
            check_resumable(meta, tmp_path, invariants_hash="h", effective_batch=8, strategy="ddp", world_size=2,
                            force=True, stage_steps=changed)
    check_resumable(_meta("h", 8), tmp_path, invariants_hash="h", effective_batch=8, strategy="ddp", world_size=2,
                    force=False, stage_steps=[9, 9, 9])  # checkpoints of earlier versions recorded no plan


def test_check_resumable_names_changed_keys_and_data_files(tmp_path: Path) -> None:
    old = {"optimizer": {"lr": 1e-4, "eps": 1e-8}, "stages": [{"name": "a", "lr": None}, {"name": "b", "lr": 2.0}]}
    new = {"optimizer": {"lr": 3e-4, "eps": 1e-8}, "stages": [{"name": "a", "lr": None}, {"name": "b", "lr": 1.0}]}
    meta = _meta(recipe_hash(old), 8) | {"invariants": old, "data_files": {"a.jsonl": "1" * 64, "b.jsonl": "2" * 64}}
    kw = {"invariants_hash": recipe_hash(new), "effective_batch": 8, "invariants": new}
    with pytest.raises(ToolkitError, match=r"changed settings: optimizer\.lr, stages\.1\.lr\)"):
        _check(meta, tmp_path, **kw)
    # the same settings, one data file's content changed (a path only in one of them is a recipe change)
    same = {"invariants_hash": recipe_hash(old), "effective_batch": 8, "invariants": old}
    files = {"a.jsonl": "1" * 64, "b.jsonl": "3" * 64, "c.jsonl": "4" * 64}
    with pytest.raises(ToolkitError, match=r"data files whose content changed since the checkpoint: b\.jsonl\)"):
        _check(meta, tmp_path, **same, data_files=files)
    assert _check(meta, tmp_path, **same, data_files={"a.jsonl": "1" * 64}) == []
    # forced: accepted, and what differs is returned for the log
    forced = _check(meta, tmp_path, **kw, data_files=files, force=True)
    assert forced == ["changed settings: optimizer.lr, stages.1.lr",
                      "data files whose content changed since the checkpoint: b.jsonl"]


def test_check_resumable_compares_token_store_checksums(tmp_path: Path) -> None:
    """Issue 31: the checkpoint fingerprinted only the data files, so a resume over other tokens (a store that was
    damaged, or prepared differently) said "resumed (exact)". The stores' checksums are compared too; a checkpoint
    of an earlier version (no store checksums) still resumes."""
    h = recipe_hash({"lr": 1e-4})
    files = {"a.jsonl": "1" * 64}
    meta = _meta(h, 8) | {"data_files": files, "data_stores": {"a.jsonl": "5" * 64}}
    kw: dict[str, Any] = {"invariants_hash": h, "effective_batch": 8, "strategy": "ddp", "world_size": 2,
                          "data_files": files}
    assert check_resumable(meta, tmp_path, **kw, force=False, data_stores={"a.jsonl": "5" * 64}) == []
    with pytest.raises(ToolkitError, match=r"token stores whose tokens differ from the checkpoint's .*: a\.jsonl\)"):
        check_resumable(meta, tmp_path, **kw, force=False, data_stores={"a.jsonl": "6" * 64})
    forced = check_resumable(meta, tmp_path, **kw, force=True, data_stores={"a.jsonl": "6" * 64})
    assert len(forced) == 1 and forced[0].startswith("token stores whose tokens differ")
    older = {k: v for k, v in meta.items() if k != "data_stores"}
    assert check_resumable(older, tmp_path, **kw, force=False, data_stores={"a.jsonl": "6" * 64}) == []


def test_committed_files_are_checked_on_resume(tmp_path: Path) -> None:
    from toolkit.checkpoint.manager import changed_files

    root = tmp_path / "ck"
    mgr = _manager(root, best_metric=None)
    first, second = _save(mgr, 1), _save(mgr, 2)
    assert changed_files(second, read_meta(second)) is None
    legacy = {k: v for k, v in read_meta(second).items() if k != "files"}
    assert changed_files(second, legacy) is None  # checkpoints of earlier versions recorded no digests

    shutil.copy(first / "model.safetensors", second / "model.safetensors")  # same size, other run's weights
    assert changed_files(second, read_meta(second)) == ("model.safetensors is not the file committed with it "
                                                       "(its sha256 differs)")
    (second / "optimizer.bin").unlink()
    assert changed_files(second, read_meta(second)) == "optimizer.bin is missing"
    (second / "optimizer.bin").write_bytes(b"short")
    assert changed_files(second, read_meta(second)).startswith("optimizer.bin has 5 bytes")


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", '{"no_step": 1}'])
def test_damaged_meta_names_the_checkpoint(tmp_path: Path, content: str) -> None:
    ckpt = _save(_manager(tmp_path / "ck"), 3)
    (ckpt / META_FILE).write_text(content)
    with pytest.raises(ToolkitError, match=re.escape(f"Checkpoint {ckpt}")):
        read_meta(ckpt)
    (ckpt / META_FILE).unlink()
    with pytest.raises(ToolkitError, match=r"has no meta\.json"):
        read_meta(ckpt)


def test_disk_full_during_save_removes_the_partial_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = _manager(root, best_metric=None)
    _save(mgr, 1)

    def full_disk(tmp: Path) -> None:
        _writer(2)(tmp)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "optimizer.bin"))

    with pytest.raises(ToolkitError, match=r"Could not write checkpoint .*step-00000002: No space left on device"):
        mgr.save(2, full_disk, {"step": 2})
    assert _step_entries(root) == ["step-00000001"] and not list(root.glob("*.tmp"))
    assert find_resume("auto", root) == root / "step-00000001"


def _safetensors_into_a_missing_folder(tmp: Path) -> None:
    save_file({"w": torch.zeros(4)}, str(tmp / "gone" / "model.safetensors"))  # SafetensorError, not an OSError


def _torch_save_onto_a_full_device(tmp: Path) -> None:
    (tmp / "optimizer.bin").symlink_to("/dev/full")  # every write fails with ENOSPC
    torch.save({"exp_avg": torch.zeros(100_000)}, tmp / "optimizer.bin")  # RuntimeError from torch's writer


@pytest.mark.parametrize("writer", [_safetensors_into_a_missing_folder, _torch_save_onto_a_full_device])
def test_a_failed_library_write_is_a_failed_save(tmp_path: Path, writer: Callable[[Path], None]) -> None:
    """The checkpoint writers (accelerate's safetensors and torch.save) wrap a full disk in their own exception
    types, not OSError: the hostile pass's full tmpfs ended in a raw SafetensorError with the `.tmp` folder left.
    They are a failed save like any OSError: partial folder removed, one line naming the checkpoint."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    root = tmp_path / "ck"
    mgr = _manager(root, best_metric=None)
    _save(mgr, 1)
    with pytest.raises(ToolkitError, match=r"Could not write checkpoint .*step-00000002: .*the last committed one, "
                                           r".*step-00000001, is intact"):
        mgr.save(2, writer, {"step": 2})
    assert _step_entries(root) == ["step-00000001"] and not list(root.glob("*.tmp"))


def test_a_failed_first_save_does_not_speak_of_a_previous_checkpoint(tmp_path: Path) -> None:
    """The hostile pass filled the disk at the first save: the line said "the previous one is intact" with no
    checkpoint at all. It now says none was committed and that a relaunch starts again."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    root = tmp_path / "ck"
    with pytest.raises(ToolkitError) as info:
        _manager(root, best_metric=None).save(1, _torch_save_onto_a_full_device, {"step": 1})
    assert "intact" not in str(info.value) and "previous" not in str(info.value)
    assert "no checkpoint was committed before it" in str(info.value)
    assert "starts again from the first step" in str(info.value)
    assert not list(root.glob("*.tmp"))


def test_partial_saves_of_a_dead_run_are_cleared_when_the_next_run_starts(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _save(_manager(root), 1)
    (root / "step-00000002.tmp").mkdir()
    (root / "step-00000002.tmp" / "optimizer.bin").write_bytes(b"half")
    _manager(root, is_main=False)
    assert (root / "step-00000002.tmp").exists()  # only rank 0 touches the folder
    _manager(root)
    assert _step_entries(root) == ["step-00000001"]


# --- only what this toolkit committed or named is deleted (issue 39) ---------------------------------------------

def test_rotation_and_clearing_leave_the_users_folders(tmp_path: Path) -> None:
    """A `step-N/` without the commit marker and a `backup.tmp/` are not this toolkit's: rotation and stale
    clearing never delete them (the hostile pass lost both); a stale `step-N.tmp` of ours goes."""
    root = tmp_path / "ck"
    (root / "step-00000099").mkdir(parents=True)
    (root / "step-00000099" / "notes.txt").write_text("mine")
    (root / "backup.tmp").mkdir()
    (root / "backup.tmp" / "weights.bin").write_bytes(b"mine")
    (root / "step-00000003.tmp").mkdir()  # a save of ours that died
    mgr = _manager(root, keep_last=1, best_metric=None)
    assert not (root / "step-00000003.tmp").exists()
    for step in (1, 2, 3):
        _save(mgr, step)
    assert sorted(p.name for p in root.iterdir()) == ["backup.tmp", "step-00000003", "step-00000099"]
    assert (root / "step-00000099" / "notes.txt").read_text() == "mine"
    assert (root / "backup.tmp" / "weights.bin").read_bytes() == b"mine"


def test_checkpoint_files_get_the_umask_mode(tmp_path: Path) -> None:
    """Under umask 002 every file of a checkpoint is 0664: accelerate's and the portable state's safetensors
    (written 0600 by safetensors), torch's files, meta.json and the marker (issue 39)."""
    old = os.umask(0o002)
    try:
        ckpt = _save(_manager(tmp_path / "ck"), 1)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in ckpt.iterdir()}
    assert modes == dict.fromkeys(["model.safetensors", "optimizer.bin", META_FILE, COMMIT_MARKER], "0o664")
