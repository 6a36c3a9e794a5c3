"""A build lock left on one of DeepSpeed's JIT-compiled ops by a killed process (torch waits for it forever) is
removed before DeepSpeed starts; a lock a live process holds, or that may belong to another node, is kept."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, launch_cmd, run_env, run_launch
from toolkit.strategies import build_locks
from toolkit.strategies.build_locks import clear_stale_build_locks

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="open files are listed from /proc")


def plant_lock(root: Path, op: str = "deepspeed_shm_comm") -> Path:
    """A lock as torch leaves it when its holder is killed: an empty `lock` in the op's build folder."""
    folder = root / op
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "build.ninja").write_text("ninja_required_version = 1.3\n")
    lock = folder / "lock"
    lock.touch()
    return lock


def test_lock_nobody_holds_is_removed_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stale = plant_lock(tmp_path)
    first_build = tmp_path / "py311_cpu" / "cpu_adam" / "lock"  # killed before build.ninja was written
    first_build.parent.mkdir(parents=True)
    first_build.touch()
    with caplog.at_level(logging.WARNING):
        removed = clear_stale_build_locks(tmp_path)
    assert removed == sorted([first_build, stale])
    assert not stale.exists() and not first_build.exists()
    assert (stale.parent / "build.ninja").is_file()  # only the lock goes
    assert sum(str(stale) in r.getMessage() and "would have hung" in r.getMessage() for r in caplog.records) == 1


def test_held_lock_and_files_that_are_not_locks_are_kept(tmp_path: Path) -> None:
    held = plant_lock(tmp_path, "cpu_adam")
    not_empty = plant_lock(tmp_path, "other")
    not_empty.write_text("someone's data")
    deep = tmp_path / "a" / "b" / "c" / "lock"  # deeper than torch's op folders
    deep.parent.mkdir(parents=True)
    deep.touch()
    with open(held):  # a live builder keeps its lock open
        assert clear_stale_build_locks(tmp_path) == []
    assert held.exists() and not_empty.exists() and deep.exists()


def test_multi_node_removes_only_locks_older_than_any_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """With ranks on other machines the folder may be shared (a cluster's home): a young lock may be another
    node's live build, invisible here. It is kept and named; an old one is removed."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    young, old = plant_lock(tmp_path, "young"), plant_lock(tmp_path, "old")
    then = time.time() - build_locks.STALE_AFTER_S - 60
    os.utime(old, (then, then))
    with caplog.at_level(logging.WARNING):
        assert clear_stale_build_locks(tmp_path) == [old]
    assert young.exists()
    assert any(str(young) in r.getMessage() and "remove the file" in r.getMessage() for r in caplog.records)


def test_without_proc_only_old_locks_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Where open files cannot be listed (no /proc), a young lock may be live: kept and named; an old one goes."""
    monkeypatch.setattr(build_locks, "is_held_open", lambda path: None)
    young, old = plant_lock(tmp_path, "young"), plant_lock(tmp_path, "old")
    then = time.time() - build_locks.STALE_AFTER_S - 60
    os.utime(old, (then, then))
    with caplog.at_level(logging.WARNING):
        assert clear_stale_build_locks(tmp_path) == [old]
    assert young.exists()
    assert any(str(young) in r.getMessage() and "remove the file" in r.getMessage() for r in caplog.records)


def test_extensions_root_follows_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_locks.extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_locks.extensions_root() == Path(get_default_build_root())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="DeepSpeed is installed on Linux only")
def test_deepspeed_launch_after_a_killed_one_does_not_hang(tmp_path: Path) -> None:
    """The way users meet it: a ZeRO-3 launch killed while loading DeepSpeed's comm op left its lock; the next
    launch (the README's line, bf16 from the file, 2 processes) trains instead of waiting forever at 0% CPU.
    Without the fix this test fails at its timeout. The extensions folder is the test's own
    (TORCH_EXTENSIONS_DIR), seeded with the op already built where this machine has it, so the test never touches
    the user's cache."""
    from torch.utils.cpp_extension import get_default_build_root

    ext = tmp_path / "torch_extensions"
    built = Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    if (built / "deepspeed_shm_comm").is_dir():
        shutil.copytree(built / "deepspeed_shm_comm", ext / "deepspeed_shm_comm",
                        ignore=shutil.ignore_patterns("lock"))
    lock = plant_lock(ext)
    out = tmp_path / "run"
    cmd = [*launch_cmd("zero3", 2, mixed_precision=None), str(REPO / "train_curriculum.py"), "--config",
           "recipes/smoke.yaml", "--create_dummy_data", "--num_dummy_samples", "16", f"output_dir={out}",
           "stages.0.max_steps=1", "stages.1.max_steps=1"]  # two steps suffice: the hang is at start-up
    proc = run_launch(cmd, env=run_env() | {"TORCH_EXTENSIONS_DIR": str(ext)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count(f"Removed {lock}") == 1
    assert not lock.exists() and (out / "final").is_dir()
