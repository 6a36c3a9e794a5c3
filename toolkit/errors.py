"""The one exception type users see: a clear, one-paragraph message about their input (or their disk)."""

from __future__ import annotations

import errno
from pathlib import Path


class ToolkitError(Exception):
    """Bad input (recipe, data, paths, environment). Raised before anything heavy starts.

    The message names the file, line or key and says what to do; the CLI prints it without a traceback.
    """


NO_SPACE = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}
"""The write failures that free space (or a larger quota) fixes, and their strerror texts: libraries that wrap
the OSError (safetensors' Rust writer, pyarrow) keep only the text."""


class OutOfSpace(ToolkitError):
    """A write failed for want of space or quota (ENOSPC, EDQUOT). Everything that writes the toolkit's files
    leaves nothing half-written that a later launch would use (toolkit/atomic.py), so the line says to free space
    and relaunch."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{reason} writing {path}. Free space (or raise the quota) and relaunch the same command: "
                         "nothing half-written was kept, and a run resumes from its last checkpoint.")


def out_of_space(exc: BaseException, path: Path | str | None = None) -> OutOfSpace | None:
    """The one-line error for `exc` when it, or an exception it was raised from, is a write that failed for want
    of space or quota; None otherwise. It names the path the innermost writer named, else `path` (the file or
    folder being written), else the path the OSError names. This is the one place a full disk becomes an error
    line: the writers in toolkit/atomic.py call it with their path, the entry points for whatever reaches them
    unnamed."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OutOfSpace):
            return cause
        if isinstance(cause, OSError) and cause.errno in NO_SPACE:
            named = path or cause.filename or "a file of the run"
            return OutOfSpace(named, NO_SPACE[cause.errno])
        reason = next((text for text in NO_SPACE.values() if text in str(cause)), None)
        if reason is not None:
            return OutOfSpace(path or "a file of the run", reason)
        cause = cause.__cause__ or cause.__context__
    return None


def as_terminal_text(text: str) -> str:
    """`text` safe to print on a terminal, as `cat -v` shows it: C0 control characters but newline and tab as
    `^X` (ESC is `^[`, CR `^M`), DEL as `^?`, C1 controls as `M-^X`. Row text from a data file then cannot set a
    window title, write the clipboard (OSC 52), hide text or move the cursor. The page does the same for HTML."""
    out = []
    for ch in text:
        code = ord(ch)
        if code < 0x20 and ch not in "\n\t":
            out.append("^" + chr(code + 0x40))
        elif code == 0x7F:
            out.append("^?")
        elif 0x80 <= code < 0xA0:
            out.append("M-^" + chr(code - 0x40))
        else:
            out.append(ch)
    return "".join(out)
