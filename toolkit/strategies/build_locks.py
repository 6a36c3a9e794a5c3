"""Stale build locks of DeepSpeed's JIT-compiled ops, removed before DeepSpeed starts.

DeepSpeed builds its C++ ops (the CPU comm op, CPU Adam, ...) with `torch.utils.cpp_extension.load`. torch guards
each op's build folder with a lock *file*, `<build folder>/lock`: a process creates it (`O_CREAT | O_EXCL`, so the
file is owned by its creator), keeps it open, checks or rebuilds the op and removes it, and it does so at every
start-up, even when nothing needs building. A process killed in that window (Ctrl-C during start-up, the launcher
ending the other ranks when one fails, a scheduler's kill, a test's timeout) leaves the file behind, and every
later process that loads the op waits for it to go away: forever, silently, at 0% CPU.

A lock is removed only when it is *known* that no process holds it, or by age; never on a guess, because removing a
live build's lock makes that build crash. It is known when all of these hold:

* the file system is local to this machine (ext4, xfs, btrfs, tmpfs, overlay, ...): on NFS, Lustre and the like
  a process on another machine (another node of this launch, another job on a shared home) may hold it unseen;
* and either `/proc` shows every process that could hold it and none has it open: this process is in the
  machine's initial PID namespace (a process inside a container is listed by its host, not the other way round),
  and every process running as the lock's owner (its creator) had its open files read;
* or the kernel says that nobody has the file open: a write lease (`F_SETLEASE`) can only be taken on a file no
  other open file description refers to, in any process, namespace or container. It can be asked by the file's
  owner (or root) only.

Open files are matched by device and inode, not by path: a holder in a container sees the folder under another
path. A lock held by a live process is kept. A lock whose holder cannot be seen (another user's process whose
open files cannot be read, a container this process cannot see into, another machine) counts as live: it is
removed only once it is older than any build (`STALE_AFTER_S`), with a warning naming it and why its holder could
not be seen; until then a launch waits for it to go (or to age), saying so, instead of hanging in torch for ever.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from toolkit.atomic import refuse_link

log = logging.getLogger(__name__)

STALE_AFTER_S = 10 * 60  # no op build takes this long
POLL_S = 2.0  # how often a launch waiting on a lock whose holder cannot be seen looks again

# File systems that only this machine's kernel serves: no process elsewhere can hold a file on them. Anything else
# (nfs, lustre, gpfs, cephfs, cifs, fuse.*, 9p, virtiofs, ...) may be shared with processes this machine cannot see.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "f2fs", "jfs", "reiserfs",
                               "nilfs2", "zfs", "tmpfs", "ramfs", "overlay"})
INITIAL_PID_NAMESPACE = "pid:[4026531836]"  # PROC_PID_INIT_INO (include/linux/proc_ns.h), fixed since Linux 3.8


def extensions_root() -> Path:
    """Where torch builds JIT extensions: $TORCH_EXTENSIONS_DIR (one folder per op) or the user cache
    (one folder per Python/accelerator pair, then one per op)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_locks(root: Path) -> list[Path]:
    """torch's build locks under `root`: empty files named `lock` in an op's build folder (torch creates them
    empty and never writes to them; one left by a killed first build may have no `build.ninja` beside it yet)."""
    candidates = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    for path in candidates:
        # torch creates its locks with O_EXCL (no link followed) and waits for any `lock` there to go: a link or
        # FIFO planted at the name would hang every launch, and this module never removes what it did not judge.
        refuse_link(path, "a build lock (torch's)")
    return sorted(p for p in candidates if p.is_file() and p.stat().st_size == 0)


@dataclass(frozen=True)
class Sight:
    """What can be told about a lock's holders: `held` True (a process has it open), False (no process anywhere
    has it open) or None (cannot be told; `unseen` says who might hold it unseen)."""

    held: bool | None
    unseen: str = ""


def mount_fstype(path: str, mountinfo: str) -> str | None:
    """The type of the file system holding the absolute, resolved `path`, from the text of /proc/self/mountinfo:
    the mount with the longest mount point above it (the later one where two share a mount point)."""
    best, fstype = -1, None
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if not sep or len(parts) < 5 or not rest:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # '\040' is a space
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, fstype = len(point), rest.split()[0]
    return fstype


def filesystem_type(path: Path) -> str | None:
    """The type of the file system `path` is on, or None where it cannot be told (no /proc)."""
    try:
        return mount_fstype(os.path.realpath(path), Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None


def in_initial_pid_namespace() -> bool:
    """Whether /proc lists every process of the machine: this process is not inside a container's PID namespace."""
    try:
        return os.readlink("/proc/self/ns/pid") == INITIAL_PID_NAMESPACE
    except OSError:
        return False


def open_files(pid: str) -> list[tuple[str, str]]:
    """(fd path, target) of each open file of process `pid`. PermissionError where its open files cannot be read
    (another user's process, or one that is not dumpable); FileNotFoundError once it ended."""
    fds = Path("/proc") / pid / "fd"
    found = []
    for fd in os.listdir(fds):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            found.append((str(fds / fd), os.readlink(fds / fd)))
    return found


def process_uids(pid: str) -> set[int] | None:
    """The real, effective, saved and file-system uids of process `pid`; None where they cannot be read."""
    try:
        for line in (Path("/proc") / pid / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return {int(u) for u in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return None


def scan_proc(lock: Path, st: os.stat_result) -> Sight:
    """Who holds `lock` (whose stat is `st`), as far as /proc tells (see the module docstring)."""
    if not Path("/proc/self/fd").is_dir():
        return Sight(None, "open files cannot be listed here (no /proc)")
    if os.geteuid() not in (0, st.st_uid):
        return Sight(None, f"it belongs to another user (uid {st.st_uid}), whose processes' open files this user "
                           "cannot read")
    unseen = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            files = open_files(pid)
        except PermissionError:
            uids = process_uids(pid)
            if uids is None or st.st_uid in uids:  # it may have created the lock (its creator owns it)
                unseen.append(pid)
            continue
        except (FileNotFoundError, ProcessLookupError):  # it ended
            continue
        for fd, target in files:
            if os.path.basename(target) != "lock":  # torch's name; the folder may be mounted elsewhere for it
                continue
            with contextlib.suppress(OSError):
                opened = os.stat(fd)
                if (opened.st_dev, opened.st_ino) == (st.st_dev, st.st_ino):
                    return Sight(True)
    blind = []
    if not in_initial_pid_namespace():
        blind.append("this process runs in its own PID namespace (a container), where the processes outside it are "
                     "not listed")
    if unseen:
        more = f" and {len(unseen) - 3} more" if len(unseen) > 3 else ""
        blind.append(f"process {', '.join(unseen[:3])}{more} running as its owner (uid {st.st_uid}), whose open "
                     "files cannot be read")
    return Sight(None, "; ".join(blind)) if blind else Sight(False)


def lease_free(lock: Path, st: os.stat_result) -> bool | None:
    """Whether no open file description of `lock` exists on this machine, in any process or namespace: a write
    lease can be taken only on a file nobody else has open (fcntl(2) F_SETLEASE). None where the kernel cannot be
    asked: not the file's owner (nor root), leases unsupported or disabled, or not the main thread (another
    process opening the file breaks the lease with SIGIO, whose default action ends this process: it is ignored
    meanwhile, and only the main thread can set that). Another rank asking at the same instant makes the answer
    "open": asked a few times, at random moments."""
    setlease = getattr(fcntl, "F_SETLEASE", None)  # Linux only
    if setlease is None or threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGIO, signal.SIG_IGN)
    try:
        for attempt in range(4):
            if attempt:
                time.sleep(random.uniform(0.02, 0.2))
            try:
                fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except BlockingIOError:  # another process holds a lease on it: asking the same right now
                continue
            except OSError:
                return None
            try:
                if os.fstat(fd).st_ino != st.st_ino:  # replaced meanwhile
                    return None
                fcntl.fcntl(fd, setlease, fcntl.F_WRLCK)
                fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
                return True
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return None  # EACCES: another user's file; EINVAL: no leases on this file system
            finally:
                os.close(fd)
        return False
    finally:
        signal.signal(signal.SIGIO, previous)


def look(lock: Path, st: os.stat_result) -> Sight:
    """Who holds `lock`: /proc first (nothing is opened), then the kernel's lease test where /proc cannot tell."""
    fstype = filesystem_type(lock)
    if fstype not in LOCAL_FILESYSTEMS:
        return Sight(None, f"it is on a {fstype} file system, which processes on other machines may share" if fstype
                     else "its file system cannot be identified")
    seen = scan_proc(lock, st)
    if seen.held is not None:
        return seen
    free = lease_free(lock, st)
    return seen if free is None else Sight(not free)


def _remove(lock: Path, st: os.stat_result) -> bool:
    """Unlink `lock` if it is still the file judged (`st`); whether this process removed it."""
    try:
        if lock.stat(follow_symlinks=False).st_ino != st.st_ino:
            return False
        lock.unlink()
    except FileNotFoundError:  # another rank removed it first
        return False
    return True


def _local_main() -> bool:
    """One process per machine says what it waits for (the others wait with it)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def settle(lock: Path, *, wait: bool = False) -> bool:
    """Remove `lock` when no process holds it, or when its holder cannot be seen and it is older than any build;
    whether this process removed it. A young lock whose holder cannot be seen is kept and named; with `wait`, this
    process waits until it goes, is seen unheld, or ages."""
    announced = False
    while True:
        try:
            st = lock.stat(follow_symlinks=False)
        except FileNotFoundError:
            return False
        sight = look(lock, st)
        if sight.held:
            return False  # torch waits for the live holder
        op, age = lock.parent.name, time.time() - st.st_mtime
        if sight.held is False:
            # A holder closes the file just before removing it: a file seen in that instant is gone at a second look.
            time.sleep(0.5)
            try:
                again = lock.stat(follow_symlinks=False)
            except FileNotFoundError:
                return False
            if again.st_ino == st.st_ino and look(lock, st).held is False and _remove(lock, st):
                log.warning("Removed %s: a build lock left by a process that was killed while loading DeepSpeed's "
                            "'%s' op (no process holds it). torch waits for such a file forever, so this launch, and "
                            "every DeepSpeed launch on this machine after it, would have hung at start-up.", lock, op)
                return True
            if not wait:
                return False
            continue
        if age > STALE_AFTER_S:
            if not _remove(lock, st):
                return False
            log.warning("Removed %s: a build lock of DeepSpeed's '%s' op, %d min old (older than any build), whose "
                        "holder cannot be seen from here (%s). torch waits for such a file forever, so this launch "
                        "would have hung at start-up.", lock, op, age // 60, sight.unseen)
            return True
        if not wait:
            if _local_main():
                log.warning("%s exists (a build lock of DeepSpeed's '%s' op) and whether a live build holds it "
                            "cannot be told: %s. It is kept. If this launch hangs at start-up, a process killed while "
                            "holding it left it behind: remove the file.", lock, op, sight.unseen)
            return False
        if not announced and _local_main():
            log.warning("%s (a build lock of DeepSpeed's '%s' op) may belong to a live build that cannot be seen from "
                        "here: %s. Waiting until it goes, or until it is %d min old (older than any build, in %d s) "
                        "and is removed. If no build is running, remove the file to go on now.", lock, op,
                        sight.unseen, STALE_AFTER_S // 60, STALE_AFTER_S - age)
        announced = True
        time.sleep(max(0.05, min(POLL_S, STALE_AFTER_S - age + 0.05)))


def clear_stale_build_locks(root: Path | None = None, *, wait: bool = False) -> list[Path]:
    """Settle each build lock under `root` (default: torch's extensions folder), see `settle`; return the ones this
    process removed. Every rank may call it at once: a lock another rank removed first is skipped."""
    return [lock for lock in build_locks(root or extensions_root()) if settle(lock, wait=wait)]
