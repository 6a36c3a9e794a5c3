"""Stale build locks of DeepSpeed's JIT-compiled ops, removed before DeepSpeed starts.

DeepSpeed builds its C++ ops (the CPU comm op, CPU Adam, ...) with `torch.utils.cpp_extension.load`. torch guards
each op's build folder with a lock *file*, `<build folder>/lock`: a process creates it, keeps it open, checks or
rebuilds the op and removes it, and it does so at every start-up, even when nothing needs building. A process
killed in that window (Ctrl-C during start-up, the launcher ending the other ranks when one fails, a scheduler's
kill, a test's timeout) leaves the file behind, and every later process that loads the op waits for it to go
away: forever, silently, at 0% CPU. Every later DeepSpeed launch on the machine then hangs at start-up.

A live lock holder keeps the file open. A lock file that no process on this machine has open (Linux: /proc/*/fd)
was left by a dead process when every process of the launch runs here, and is removed, with a warning naming it.
In a multi-node launch the build folder may be on a file system the other nodes share (a cluster's home), where a
holder on another node is invisible here: such a lock is removed only once it is older than any build
(`STALE_AFTER_S`), and a younger one is named in a warning. So is a lock where open files cannot be listed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

STALE_AFTER_S = 10 * 60  # no op build takes this long


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
    return sorted(p for p in candidates if p.is_file() and not p.is_symlink() and p.stat().st_size == 0)


def is_held_open(path: Path) -> bool | None:
    """Whether a process has `path` open; None where that cannot be told (no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(path)
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # the process ended, or is another user's
            for fd in (pid / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        return True
    return False


def single_node() -> bool:
    """Every process of this launch runs on this machine (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE agree)."""
    return os.environ.get("WORLD_SIZE", "1") == os.environ.get("LOCAL_WORLD_SIZE", "1")


def is_stale(lock: Path, held: bool | None) -> bool:
    """`lock` was left by a dead process, given `held` (`is_held_open(lock)`, read once by the caller).

    On one node an unheld lock is looked at once more: a holder closes the file just before removing it, and a
    file seen in that instant is gone at the second look. Elsewhere (other nodes, or no /proc) only age tells.
    """
    if held:
        return False
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if held is None or not single_node():
        return age > STALE_AFTER_S
    time.sleep(0.5)
    return lock.is_file() and is_held_open(lock) is False


def clear_stale_build_locks(root: Path | None = None) -> list[Path]:
    """Remove the build locks under `root` (default: torch's extensions folder) that no live process holds, with a
    warning for each; name the ones that may be live elsewhere; return the removed ones. Every rank may call it
    at once: a lock another rank removed first is skipped."""
    removed = []
    for lock in build_locks(root or extensions_root()):
        held = is_held_open(lock)
        if held:
            continue
        if not is_stale(lock, held):
            if lock.is_file() and os.environ.get("LOCAL_RANK", "0") == "0":  # young, holder unknown: once per node
                log.warning("%s exists (a build lock of DeepSpeed's '%s' op) and no process on this machine is "
                            "seen holding it. If this launch hangs at start-up, a process elsewhere may have been "
                            "killed while holding it: remove the file.", lock, lock.parent.name)
            continue
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            removed.append(lock)
            log.warning("Removed %s: a build lock left by a process that was killed while loading DeepSpeed's '%s' "
                        "op (no process holds it). torch waits for such a file forever, so this launch, and every "
                        "DeepSpeed launch on this machine after it, would have hung at start-up.", lock,
                        lock.parent.name)
    return removed
