"""Atomic writes: a reader, or the next run after a crash, finds a file or folder whole (the old one or the new
one), never part of one. Every file and folder the toolkit publishes goes through here.

Files are written to a temporary file in the same folder, fsynced, renamed over the target (`os.replace`, atomic
on POSIX) and the folder fsynced, so the rename survives a power cut too.

Folders are built under a temporary name beside the target and renamed into place. An existing folder is swapped
with the new one in one step (`renameat2(RENAME_EXCHANGE)` on Linux): at every moment the target holds the old
folder or the new one. Where the kernel or filesystem lacks the exchange (other systems, some network
filesystems), the old folder is moved aside first and the new one renamed in: a crash between those two renames
leaves the target missing and the old folder beside it as `.<name>.old-*`. The old folder is deleted only once the
new one is in place.

A write that fails for want of space or quota (ENOSPC, EDQUOT) ends in `toolkit.errors.OutOfSpace`, one line naming
the file or folder being written (`writing`): the temporary file or folder is gone by then, so nothing
half-written is left for a later launch to use.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import platform
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from toolkit.errors import ToolkitError, out_of_space

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def fsync_dir(folder: Path) -> None:
    """Make the entries of `folder` (a rename into it, a new file) durable. A no-op where folders cannot be
    opened (not POSIX)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder; the rename itself is still atomic
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Writes to `path` (a file, or a folder being built) happen inside: a full disk or quota, however the writing
    library wraps it, ends them in one OutOfSpace line naming `path` (toolkit/errors.py)."""
    try:
        yield
    except Exception as e:
        if (full := out_of_space(e, path)) is None:
            raise
        raise full from e


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def file_mode() -> int:
    """The mode a plain open() gives a new file under this process's umask: every file the toolkit writes gets it."""
    return 0o666 & ~_umask()


def apply_umask(folder: Path) -> None:
    """Give every file under `folder` (one being built, not yet published) `file_mode()`: some writers make their
    files private to this user whatever the umask (safetensors writes 0600), where the toolkit promises the mode a
    plain open() gives."""
    mode = file_mode()
    for path in [folder, *folder.rglob("*")]:
        st = path.lstat()
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)


def open_own(path: Path, flags: int, mode: int = 0o666) -> int:
    """A file descriptor for `path`, a regular file of its own (one link), opened without following a symbolic
    link (O_NOFOLLOW) and without blocking on a FIFO; `flags` may add O_CREAT (never O_TRUNC: a file found there is
    not truncated before it is known to be one). For the files the toolkit takes from a folder others can write (a
    run lock, a store lock, a cache record): a link planted at the predictable name would make the toolkit write
    through it into someone's file. Anything else there is refused in one line naming it."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or path.is_symlink():
            raise ToolkitError(f"{path} is a symbolic link, where the toolkit keeps a file of its own: it never "
                               "writes through a link. Remove the link (and see who placed it).") from None
        if e.errno == errno.ENXIO:  # a FIFO or socket with no reader
            raise ToolkitError(f"{path} is not a regular file (a FIFO, socket or device), where the toolkit keeps "
                               "a file of its own. Remove it.") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = "not a regular file (a FIFO, socket or device)" if not stat.S_ISREG(st.st_mode) else \
            f"a file with {st.st_nlink} hard links (another name for someone's file)"
        raise ToolkitError(f"{path} is {what}, where the toolkit keeps a file of its own. Remove it.")
    os.set_blocking(fd, True)
    return fd


def read_own_text(path: Path) -> str:
    """The text of `path`, a regular file of its own (`open_own`): never read through a link, never blocking on a
    FIFO. FileNotFoundError where there is none."""
    with os.fdopen(open_own(path, os.O_RDONLY), encoding="utf-8") as f:
        return f.read()


def refuse_link(path: Path, what: str) -> None:
    """Refuse, in one line, a `path` taken from a shared folder (`what` it should be) that is a symbolic link, or a
    file that is not a regular one; a missing one, a folder or a regular file passes."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ToolkitError(f"{path} is a symbolic link, where the toolkit keeps {what} of its own: it never follows "
                           "a link in a shared folder. Remove the link (and see who placed it).")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise ToolkitError(f"{path} is not a regular file (a FIFO, socket or device), where the toolkit keeps {what} "
                           "of its own. Remove it.")


def not_ours(folder: Path, *, marker: str | None = None, ours: Callable[[Path], bool] | None = None) -> list[str]:
    """What in `folder` its writer did not write, by name (a folder's with '/'): nothing for a missing or empty
    folder, one holding `marker` (a file the writer leaves in every folder it writes), or one whose every entry
    `ours` claims. With `refuse_not_ours`, the one rule for a folder the user names as an output (export's --out,
    tiny-model's and dummy-data's --out, a run's output_dir): never written into, let alone replaced, unless it is
    new, empty or an earlier output of the same writer."""
    if not folder.is_dir() or (marker is not None and (folder / marker).is_file()):
        return []
    return sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in folder.iterdir()
                  if ours is None or not ours(p))


def refuse_not_ours(folder: Path, found: list[str], *, label: str, what: str, then: str, fix: str) -> None:
    """One line refusing `folder` (named `label` in the command) when it holds what `not_ours` found."""
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise ToolkitError(f"{label} {folder} is a non-empty folder that is not {what} (it holds {shown}); {then}. "
                           f"{fix}")


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write `path` with `write(f)` on a temporary file beside it, fsync, rename it over `path`, fsync the folder.
    Readers see all of the new content or the old one; a failure leaves no temporary file. The file gets the
    permissions a plain open() would give it."""
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, file_mode())  # mkstemp's 0600 would make it private to this user
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """`write_atomic` for UTF-8 text."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """libc's renameat2, or the raw system call where the C library predates it; None off Linux."""
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2"):
        return libc.renameat2
    number = _SYS_RENAMEAT2.get(platform.machine())
    if number is None:
        return None
    return lambda *args: libc.syscall(number, *args)


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths `a` and `b` (both must exist) in one atomic step. False, with nothing changed, where the
    system or filesystem cannot (then the caller falls back to two renames); other failures raise OSError."""
    call = _renameat2()
    if call is None:
        return False
    if call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def swap_dir(new: Path, target: Path) -> Path | None:
    """Put the complete folder `new` at `target`. Returns where the folder that was at `target` is now (the
    caller decides whether to delete it, see `replace_dir`), or None when there was none. On failure `target` is
    as it was and `new` still exists.

    Atomic where `exchange` is supported; otherwise the old folder is moved aside first (see the module
    docstring for what a crash between the two renames leaves)."""
    if not target.exists() and not target.is_symlink():
        os.replace(new, target)  # an empty folder created meanwhile is replaced; a non-empty one makes this fail
        fsync_dir(target.parent)
        return None
    if exchange(new, target):
        fsync_dir(target.parent)
        return new
    aside = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
    os.rename(target, aside)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(aside, target)  # the old folder back in place
        raise
    fsync_dir(target.parent)
    return aside


def remove_tree(path: Path) -> None:
    """Delete a folder this module moved out of the way (or a temporary one); a file or link is unlinked."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def replace_dir(new: Path, target: Path, *, check_replaced: Callable[[Path], None] | None = None) -> None:
    """Put the complete folder `new` at `target` and delete the folder it replaces, once the new one is in.

    `check_replaced(old)` is called on the very folder swapped out, before it is deleted (it may have changed since
    the caller last looked): when it raises, that folder is put back at `target`, the new one deleted, and the
    exception propagates."""
    old = swap_dir(new, target)
    if old is None:
        return
    if check_replaced is not None:
        try:
            check_replaced(old)
        except BaseException:
            new_now = swap_dir(old, target)  # the old folder back; the new one is where the old one was
            if new_now is not None:
                remove_tree(new_now)
            raise
    remove_tree(old)


def temp_dir_beside(target: Path) -> Path:
    """An empty folder `.<name>.*.tmp` in the folder of `target` (same filesystem, so it renames into place), with
    the permissions a plain mkdir would give (mkdtemp's 0700 would make the result private to this user)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def build_dir(target: Path, build: Callable[[Path], Any], *, replace: bool = True, tmp: Path | None = None,
              check_replaced: Callable[[Path], None] | None = None) -> bool:
    """Build a folder with `build(tmp)` in a temporary folder beside `target`, then move it into place.

    `replace`: an existing `target` is swapped out and deleted (`replace_dir`, with `check_replaced`). Otherwise
    an existing one is kept and the new build discarded (several processes building the same content: the first
    one wins); returns whether the new folder went in. `tmp` names the temporary folder (a fixed name that a later
    run clears; it is deleted first), else a fresh `.<name>.*.tmp`. A failure leaves `target` as it was and no
    temporary folder; a full disk, one OutOfSpace line naming `target`."""
    with writing(target):
        if tmp is None:
            tmp = temp_dir_beside(target)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _UNFINISHED.add(tmp)
        try:
            build(tmp)
            apply_umask(tmp)
            if replace:
                replace_dir(tmp, target, check_replaced=check_replaced)
                return True
            try:
                os.rename(tmp, target)
            except OSError:  # someone else's copy is in place
                return False
            fsync_dir(target.parent)
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed into place
            _UNFINISHED.discard(tmp)


_UNFINISHED: set[Path] = set()
"""Temporary folders `build_dir` is building in this process right now."""


def discard_unfinished() -> None:
    """Delete the folders `build_dir` is building right now: called by a process that ends without unwinding (a
    stop signal's watcher, when the main thread is held in native code), so that no half-built folder is left."""
    for tmp in list(_UNFINISHED):
        shutil.rmtree(tmp, ignore_errors=True)
