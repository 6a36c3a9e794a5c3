"""A build lock left on one of DeepSpeed's JIT-compiled ops by a killed process (torch waits for it forever) is
removed before DeepSpeed starts; a lock a live process holds is kept, and one whose holder cannot be seen (another
machine, another user, a container) is removed only by age."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, launch_cmd, run_env, run_launch, signal_tree
from toolkit.errors import ToolkitError
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


def test_proc_alone_proves_a_lock_unheld(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the kernel's lease test, /proc proves it when it lists every process (the initial PID namespace)
    and could read the open files of every process running as the lock's owner (here: the others are made to run
    as another user). One of them holding it is seen, by inode."""
    if not build_locks.in_initial_pid_namespace():
        pytest.skip("this test runs inside a container: /proc does not list the machine's processes")
    monkeypatch.setattr(build_locks, "lease_free", lambda lock, st: None)
    monkeypatch.setattr(build_locks, "process_uids", lambda pid: {os.geteuid() + 1})
    lock = plant_lock(tmp_path)
    with lock.open("rb"):
        assert clear_stale_build_locks(tmp_path) == []
    assert clear_stale_build_locks(tmp_path) == [lock]


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


def age(lock: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(lock, (then, then))
    return lock


def named(caplog: pytest.LogCaptureFixture, *words: str) -> bool:
    return any(all(w in r.getMessage() for w in words) for r in caplog.records)


@pytest.mark.parametrize("unseen", ["network file system", "no /proc"])
def test_lock_whose_holder_cannot_be_seen_goes_only_by_age(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture, unseen: str) -> None:
    """On a file system other machines may share (a cluster's home: another node of the launch, or another job,
    may be building there), or where open files cannot be listed, a young lock may be live: kept and named; one
    older than any build is removed, saying why its holder could not be seen."""
    if unseen == "network file system":
        monkeypatch.setattr(build_locks, "filesystem_type", lambda path: "nfs4")
        why = "on a nfs4 file system"
    else:
        monkeypatch.setattr(build_locks, "scan_proc", lambda lock, st: build_locks.Sight(None, "no /proc here"))
        monkeypatch.setattr(build_locks, "lease_free", lambda lock, st: None)
        why = "no /proc here"
    young, old = plant_lock(tmp_path, "young"), age(plant_lock(tmp_path, "old"), build_locks.STALE_AFTER_S + 60)
    with caplog.at_level(logging.WARNING):
        assert clear_stale_build_locks(tmp_path) == [old]
    assert young.exists()
    assert named(caplog, str(young), why, "remove the file")
    assert named(caplog, f"Removed {old}", "older than any build", why)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen]]:
    """A lock and a live process of this user holding it open, as torch's builder does."""
    lock = plant_lock(tmp_path)
    with lock.open("rb") as f:
        proc = subprocess.Popen(["sleep", "120"], stdin=f)
    try:
        yield lock, proc
    finally:
        proc.kill()
        proc.wait()


def hide(monkeypatch: pytest.MonkeyPatch, pid: int, error: type[OSError]) -> None:
    """/proc/<pid>/fd of the holder reads as `error`: PermissionError as for another user's or a non-dumpable
    process, FileNotFoundError as for a process that /proc does not list (another PID namespace)."""
    read = build_locks.open_files

    def open_files(p: str) -> list[tuple[str, str]]:
        if p == str(pid):
            raise error(errno.EACCES if error is PermissionError else errno.ENOENT, os.strerror(errno.EACCES))
        return read(p)

    monkeypatch.setattr(build_locks, "open_files", open_files)


def test_lock_held_by_a_process_whose_open_files_cannot_be_read(holder: tuple[Path, subprocess.Popen],
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The holder runs as the lock's owner but its open files cannot be read. It used to count as no holder and
    the live lock was deleted. Where the kernel can be asked (the lease test) it says the file is open: kept, even
    when old. Where it cannot (another user's file), the holder counts as alive: kept while young and named, removed
    by age with a warning."""
    lock, proc = holder
    hide(monkeypatch, proc.pid, PermissionError)
    assert clear_stale_build_locks(lock.parent.parent) == [] and lock.exists()
    age(lock, build_locks.STALE_AFTER_S + 60)
    assert clear_stale_build_locks(lock.parent.parent) == [] and lock.exists()  # the kernel says it is open

    monkeypatch.setattr(build_locks, "lease_free", lambda lock, st: None)
    age(lock, 5)
    with caplog.at_level(logging.WARNING):
        assert clear_stale_build_locks(lock.parent.parent) == [] and lock.exists()
        assert named(caplog, str(lock), str(proc.pid), "open files cannot be read", "It is kept")
        age(lock, build_locks.STALE_AFTER_S + 60)
        assert clear_stale_build_locks(lock.parent.parent) == [lock] and not lock.exists()
        assert named(caplog, f"Removed {lock}", "older than any build", str(proc.pid))


def test_container_style_holder_outside_the_pid_namespace(holder: tuple[Path, subprocess.Popen],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """This process in a container (its own PID namespace), the holder outside it: /proc does not list the holder.
    The kernel's lease test sees the open file through any namespace: kept. A lock nobody holds is still removed at
    once (the killed start-up inside the container); where the kernel cannot be asked, age decides."""
    lock, proc = holder
    monkeypatch.setattr(build_locks, "in_initial_pid_namespace", lambda: False)
    hide(monkeypatch, proc.pid, FileNotFoundError)
    age(lock, build_locks.STALE_AFTER_S + 60)
    assert clear_stale_build_locks(lock.parent.parent) == [] and lock.exists()
    proc.kill()
    proc.wait()
    assert clear_stale_build_locks(lock.parent.parent) == [lock]  # nobody has it open: the kernel says so

    monkeypatch.setattr(build_locks, "lease_free", lambda lock, st: None)
    lock.touch()
    with caplog.at_level(logging.WARNING):
        assert clear_stale_build_locks(lock.parent.parent) == [] and lock.exists()
    assert named(caplog, str(lock), "its own PID namespace", "It is kept")


def unshare_works() -> bool:
    return shutil.which("unshare") is not None and os.geteuid() == 0 and subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"], capture_output=True).returncode == 0


CLEANER = """
import sys
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]).parent))  # the module alone: the package would import torch
import build_locks
print(build_locks.in_initial_pid_namespace(), [str(p) for p in build_locks.clear_stale_build_locks(Path(sys.argv[2]))])
"""


@pytest.mark.skipif(not unshare_works(), reason="needs root and unshare(1) to make PID and mount namespaces")
def test_real_namespaces(tmp_path: Path) -> None:
    """Real namespaces, both ways. (1) The holder in a container: its own PID and mount namespaces, the build
    folder mounted at another path there; this process, on the host, must match its open file by inode, not path.
    (2) The cleaner in a container, the holder (this test) outside, unlisted in the container's /proc: kept; with
    no holder, removed at once."""
    ext = tmp_path / "ext"
    lock = plant_lock(ext)
    view = tmp_path / "container_view"
    view.mkdir()
    script = 'mount --bind "$1" "$2" && exec sleep 120 < "$2/deepspeed_shm_comm/lock"'
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "sh", "-c", script, "sh",
                             str(ext), str(view)])
    try:
        deadline = time.monotonic() + 10
        while not any(target.endswith("/container_view/deepspeed_shm_comm/lock") for p in
                      psutil.Process(proc.pid).children(recursive=True) for _, target in
                      build_locks.open_files(str(p.pid))):
            assert time.monotonic() < deadline, "the holder did not open the lock"
            time.sleep(0.05)
        assert clear_stale_build_locks(ext) == [] and lock.exists()
    finally:
        signal_tree(proc.pid, signal.SIGKILL)
        proc.wait()

    inside = ["unshare", "--pid", "--fork", "--mount", "--mount-proc", sys.executable, "-c", CLEANER,
              build_locks.__file__, str(ext)]
    with lock.open("rb"):  # the holder, outside the cleaner's container
        out = subprocess.run(inside, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split(" ", 1) == ["False", "[]\n"], out.stdout + out.stderr
    assert lock.exists()
    out = subprocess.run(inside, capture_output=True, text=True, timeout=60)
    assert out.stdout.split(" ", 1) == ["False", f"['{lock}']\n"], out.stdout + out.stderr


def test_lease_test_survives_other_processes_opening_the_file(tmp_path: Path) -> None:
    """A process that opens the file while this one holds its brief lease breaks the lease with SIGIO, whose
    default action would end this process (another rank asking at the same instant does exactly that)."""
    lock = plant_lock(tmp_path)
    opener = subprocess.Popen([sys.executable, "-c", "import os, sys\nwhile True:\n    try: os.close(os.open("
                               "sys.argv[1], os.O_RDONLY | os.O_NONBLOCK))\n    except OSError: pass", str(lock)])
    try:
        st = lock.stat()
        answers = {build_locks.lease_free(lock, st) for _ in range(200)}
    finally:
        opener.kill()
        opener.wait()
    assert answers <= {True, False} and answers


def test_waiting_launch_goes_on_when_the_lock_goes_or_ages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A launch does not hang in torch on a lock whose holder cannot be seen: it waits, saying so, until the lock
    goes (the live build ended) or is older than any build (then removed)."""
    monkeypatch.setattr(build_locks, "filesystem_type", lambda path: "lustre")
    monkeypatch.setattr(build_locks, "STALE_AFTER_S", 1.5)
    monkeypatch.setattr(build_locks, "POLL_S", 0.1)
    lock = plant_lock(tmp_path)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert clear_stale_build_locks(tmp_path, wait=True) == [lock]
    assert 1.0 < time.monotonic() - start < 10
    assert named(caplog, str(lock), "Waiting until it goes") and named(caplog, f"Removed {lock}")

    lock = plant_lock(tmp_path)
    threading.Timer(0.3, lock.unlink).start()  # the live build ends
    assert clear_stale_build_locks(tmp_path, wait=True) == []


def test_file_system_of_a_path() -> None:
    mountinfo = "\n".join([
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        "30 22 0:40 / /home rw shared:2 - nfs4 server:/home rw",
        "31 30 0:41 / /home/me/my\\040cache rw - tmpfs tmpfs rw",
        "32 22 0:42 / /scratch rw - xfs /dev/sdb rw",
        "33 22 0:43 / /scratch rw - lustre 10.0.0.1@tcp:/fs rw",  # mounted over the one before
    ])
    fs = build_locks.mount_fstype
    assert fs("/usr/lib", mountinfo) == "ext4" and fs("/home2/x", mountinfo) == "ext4"
    assert fs("/home/me/.cache/torch_extensions", mountinfo) == "nfs4"
    assert fs("/home/me/my cache/op/lock", mountinfo) == "tmpfs"
    assert fs("/scratch/op/lock", mountinfo) == "lustre"


def test_extensions_root_follows_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_locks.extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_locks.extensions_root() == Path(get_default_build_root())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="DeepSpeed is installed on Linux only")
def test_deepspeed_launch_after_a_killed_one_does_not_hang(tmp_path: Path, deepspeed_comm_op: Path) -> None:
    """The way users meet it: a ZeRO-3 launch killed while loading DeepSpeed's comm op left its lock; the next
    launch (the README's line, bf16 from the file, 2 processes) trains instead of waiting forever at 0% CPU.
    Without the fix this test fails at its timeout. The extensions folder is the test's own
    (TORCH_EXTENSIONS_DIR), seeded with the op as built in the default folder (by the fixture, as any DeepSpeed
    launch of the suite would), so the test never touches that folder and builds nothing twice."""
    ext = tmp_path / "torch_extensions"
    shutil.copytree(deepspeed_comm_op, ext / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    lock = plant_lock(ext)
    out = tmp_path / "run"
    cmd = [*launch_cmd("zero3", 2, mixed_precision=None), str(REPO / "train_curriculum.py"), "--config",
           "recipes/smoke.yaml", "--create_dummy_data", "--num_dummy_samples", "16", f"output_dir={out}",
           "stages.0.max_steps=1", "stages.1.max_steps=1"]  # two steps suffice: the hang is at start-up
    proc = run_launch(cmd, env=run_env() | {"TORCH_EXTENSIONS_DIR": str(ext)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count(f"Removed {lock}") == 1
    assert not lock.exists() and (out / "final").is_dir()


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_link_or_fifo_at_a_build_lock_is_refused_in_one_line(tmp_path: Path, planted: str) -> None:
    """torch waits for anything at `<op>/lock` to go: a planted link or FIFO would hang every launch (issue 39)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    lock = tmp_path / "exts" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victim) if planted == "symlink" else os.mkfifo(lock)
    with pytest.raises(ToolkitError, match="symbolic link" if planted == "symlink" else "not a regular file") as e:
        clear_stale_build_locks(tmp_path / "exts")
    assert str(lock) in str(e.value) and "\n" not in str(e.value)
    assert victim.read_text() == "the user's own file\n" and (lock.is_symlink() or lock.exists())
