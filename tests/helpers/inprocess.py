"""Running the entry points (`train_curriculum.py`, `toolkit`) the way tests of user-facing behaviour need.

`invoke` calls an entry point's `main(argv)` in the test process (the same code a user's command runs, with the
same exit code and stderr, without a fresh 10-20 s import of torch and transformers per call), or launches it
as a real process when the case asks for one.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import train_curriculum
from tests.conftest import REPO, run_env
from toolkit.commands import cli


@dataclass
class Call:
    """One command: `train_curriculum.py ARGV` or `toolkit ARGV`, run in the case's folder."""

    argv: list[str]
    watch: Path  # must not appear if absent before, and must stay exactly as it was if present
    tool: str = "train"
    env: dict[str, str] = field(default_factory=dict)
    subprocess: bool = False


def snapshot(path: Path) -> dict[str, tuple[int, int]] | None:
    """Every file under `path` (or `path` itself) with size and mtime; None when it does not exist."""
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """The training entry point installs signal handlers and a parent-death signal for its process; an
    in-process call must not leave them on the test runner."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG off


def invoke(call: Call, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    if call.subprocess:
        cmd = [sys.executable, str(REPO / "train_curriculum.py")] if call.tool == "train" else \
            [sys.executable, "-m", "toolkit.commands.cli"]
        proc = subprocess.run([*cmd, *call.argv], cwd=cwd, env=run_env() | call.env, capture_output=True,
                              text=True, timeout=300)
        return proc.returncode, proc.stderr
    monkeypatch.chdir(cwd)
    for key, value in call.env.items():
        monkeypatch.setenv(key, value)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), process_state_kept():
        rc = (train_curriculum.main if call.tool == "train" else cli.main)(call.argv)
    return rc, err.getvalue()


def toolkit_run(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`toolkit ARGV` in this process (`invoke`), its stdout and stderr apart as a subprocess's would be."""
    capsys.readouterr()
    rc, stderr = invoke(Call(list(argv), cwd, tool="toolkit"), cwd, monkeypatch)
    return subprocess.CompletedProcess(["toolkit", *argv], rc, capsys.readouterr().out, stderr)
