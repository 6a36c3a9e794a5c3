"""Tests for toolkit/checkpoint/lease.py and the rotation that respects it: a leased checkpoint is kept until its
reader is done, a reader that dies releases it (the kernel drops the lock), and a reader notices a folder that went or
changed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from toolkit.checkpoint.lease import ReadLease, delete_unless_leased
from toolkit.checkpoint.manager import CheckpointManager
from toolkit.runtime.run_dir import committed_checkpoints


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(b"x" * 100)
    return path


def test_a_leased_folder_is_kept_and_deleted_once_released(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "step-00000001")
    lease = ReadLease.acquire(folder)
    assert lease is not None and lease.locked and lease.still_held()
    assert delete_unless_leased(folder) is False
    assert (folder / "weights.bin").read_bytes() == b"x" * 100
    lease.release()
    assert delete_unless_leased(folder) is True and not folder.exists()
    assert delete_unless_leased(folder) is True  # already gone


def test_a_reader_that_dies_releases_its_lease(tmp_path: Path) -> None:
    """An exporter killed mid-read (SIGKILL: no cleanup runs) must not pin the checkpoint."""
    folder = _folder(tmp_path / "step-00000001")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from pathlib import Path
        from toolkit.checkpoint.lease import ReadLease
        lease = ReadLease.acquire(Path({str(folder)!r}))
        print("held", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert delete_unless_leased(folder) is False and folder.is_dir()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert delete_unless_leased(folder) is True and not folder.exists()


def test_a_lease_notices_a_folder_deleted_or_replaced(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "step-00000001")
    assert ReadLease.acquire(tmp_path / "step-00000009") is None
    with ReadLease.acquire(folder) as lease:
        folder.rename(tmp_path / "aside")
        _folder(folder)  # the same name, another folder (the same step saved again)
        assert not lease.still_held()
    with ReadLease.acquire(folder) as lease:
        assert lease.still_held()
        (tmp_path / "gone").mkdir()
        folder.rename(tmp_path / "gone" / "x")
        assert not lease.still_held()


def _writer(step: int):
    def write_state(tmp: Path) -> None:
        save_file({"weight": torch.full((2,), float(step))}, str(tmp / "model.safetensors"))
    return write_state


def _manager(root: Path, keep_last: int = 1) -> CheckpointManager:
    return CheckpointManager(root, keep_last=keep_last, best_metric=None, best_mode="min", is_main=True,
                             barrier=lambda: None)


def test_rotation_keeps_a_leased_checkpoint_until_a_later_rotation(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "checkpoints"
    mgr = _manager(root)
    mgr.save(1, _writer(1), {"step": 1})
    lease = ReadLease.acquire(root / "step-00000001")
    with caplog.at_level("INFO", logger="toolkit.checkpoint.manager"):
        mgr.save(2, _writer(2), {"step": 2})
        mgr.save(3, _writer(3), {"step": 3})
    assert [p.name for p in committed_checkpoints(root)] == ["step-00000001", "step-00000003"]
    assert "kept" in caplog.text and "step-00000001" in caplog.text
    assert lease.still_held()
    lease.release()
    mgr.save(4, _writer(4), {"step": 4})
    assert [p.name for p in committed_checkpoints(root)] == ["step-00000004"]


def test_a_step_saved_again_while_leased_keeps_the_old_folder_for_its_reader(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    mgr = _manager(root, keep_last=2)
    mgr.save(1, _writer(1), {"step": 1})
    lease = ReadLease.acquire(root / "step-00000001")
    mgr.save(1, _writer(10), {"step": 1})  # the same step again: the new folder takes the name
    assert not lease.still_held()  # the reader sees it changed and reads again
    aside = [p for p in root.iterdir() if p.name.endswith(".tmp")]
    assert len(aside) == 1 and (aside[0] / "model.safetensors").is_file()  # what the reader holds is whole
    lease.release()
    mgr.save(2, _writer(2), {"step": 2})  # a later rotation clears it
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]
    # A fresh manager (the next launch) clears such a folder too, unless it is still held.
    (root / "step-00000002.1234abcd.tmp").mkdir()
    held = ReadLease.acquire(root / "step-00000002.1234abcd.tmp")
    _manager(root)
    assert (root / "step-00000002.1234abcd.tmp").is_dir()
    held.release()
    _manager(root)
    assert not (root / "step-00000002.1234abcd.tmp").exists()
