"""Read leases on checkpoint folders: a reader (`toolkit export` of a live run) and the run's checkpoint rotation
never meet half-way, so an export reads one committed checkpoint whole, or waits for the next.

Why an flock on the folder, and not a copy of the checkpoint: a copy of a full fine-tuning checkpoint is the size of
the model with its optimizer state, and a marker file that says "being read" outlives a reader that crashes. An
advisory `flock` on the checkpoint folder itself costs nothing, needs no write access (a read-only copy of a run can
be exported), and the kernel drops it when the reader's process ends, however it ends: a crashed exporter never
pins a checkpoint.

- A reader takes a shared lock on the folder and checks that the path still names that folder (rotation may have
  deleted it, or a re-save of the same step swapped another in, while the reader looked for it).
- A deleter (rotation) only *tries* an exclusive lock and never waits: a leased folder is kept, and a later rotation
  deletes it once the reader is done. Training is never blocked by a reader.
- Where the filesystem cannot flock a folder (some network filesystems), deletion goes ahead as it always did, and
  the reader's checks (the folder still there and unchanged; every file's size and sha256 as committed) catch it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def _open_folder(path: Path) -> int | None:
    """A read-only descriptor of the folder `path`, or None when it is gone (or not a folder)."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _same_folder(path: Path, fd: int) -> bool:
    """Whether `path` still names the folder open as `fd` (not deleted, not swapped for another)."""
    try:
        now, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


class ReadLease:
    """A shared lease on a folder, held from `acquire` to `release` (or the end of the process)."""

    def __init__(self, path: Path, fd: int, *, locked: bool) -> None:
        self.path, self._fd, self.locked = path, fd, locked

    @classmethod
    def acquire(cls, path: Path) -> ReadLease | None:
        """Lease the folder `path`; None when it is gone by the time the lease is held (deleted or replaced).

        Waits only while a deleter holds the folder, that is while it is being deleted."""
        fd = _open_folder(path)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            locked = True
        except OSError:  # the filesystem cannot lock folders: the reader's own checks remain
            locked = False
        lease = cls(path, fd, locked=locked)
        if not lease.still_held():
            lease.release()
            return None
        return lease

    def still_held(self) -> bool:
        """Whether the leased folder is still the one at `path` (a reader checks again once it has read)."""
        return self._fd >= 0 and _same_folder(self.path, self._fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = -1

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[bool | None]:
    """Try, without waiting, to hold `path` exclusively: True (held), False (a reader holds a lease), None (the
    folder is gone). Where folders cannot be locked it counts as held (deletion goes ahead, as without leases)."""
    fd = _open_folder(path)
    if fd is None:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = True
    except BlockingIOError:
        held = False
    except OSError:  # this filesystem cannot lock folders
        held = True
    try:
        yield held
    finally:
        os.close(fd)


def delete_unless_leased(path: Path) -> bool:
    """Delete the folder `path` unless a reader holds a lease on it. Returns False when it was kept; a folder that
    is already gone counts as deleted. The exclusive lock is held while deleting, so a reader that asks for a lease
    meanwhile waits, then finds the folder gone."""
    with _exclusive(path) as held:
        if held is False:
            return False
        if held:
            shutil.rmtree(path, ignore_errors=True)
    return True

