"""A rank's last words: when something unexpected stops a rank (a bug, or a peer process that died), it ends with
one line on stderr that says what happened, to which rank, and what to do; the traceback goes to its log file.

A multi-process launch ends when any of its processes ends: the others then fail inside a collective with the
backend's own error (gloo: "Connection reset by peer" and an address; NCCL: a timeout), which never says which rank
went, nor why. What can be known, and how:

* A rank that stops on an error of its own (bad input, a bug, Ctrl-C) says so before it exits, and its exit is what
  makes the others' collectives fail: it leaves a note in the launch's rendezvous store first (under `accelerate
  launch` / torchrun the store runs in the launcher's agent, so it outlives every training process), and every
  other rank reads it.
* A rank that is killed (SIGKILL, the out-of-memory killer, a native crash) leaves no note. Every rank records its
  host and pid in the store at start, so a peer on the same host whose process is gone without a note is the one
  that died. A peer on another host without a note cannot be told apart from one that is slow to notice the
  failure; the line then says "a peer process".

The line also names the last committed checkpoint, which a relaunch of the same command resumes from. The log file
(`RunLayout.rank_log`) is appended to, never replaced, so a requeued run keeps the earlier ends too.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from toolkit.atomic import open_own
from toolkit.errors import ToolkitError
from toolkit.runtime.process import process_gone, record_launch_error
from toolkit.runtime.run_dir import RunLayout, committed_checkpoints

FAILED_EXIT_CODE = 1
"""A rank that ended on an unexpected exception, its own or a lost peer's."""
_STORE_TIMEOUT = timedelta(seconds=5)
_LOST_PEER_SIGNS = ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer")
"""Texts of the collective errors that a peer's death (or hang: a timeout) causes, under gloo and NCCL."""


_AGENT_STORE: list[Any] = []
"""The launcher agent's store, once connected (one connection per process)."""
_SAME_ERROR_WAIT = timedelta(seconds=15)
"""How long a rank other than 0 waits for rank 0's own ending before it says its error itself."""


def _store() -> Any | None:
    """The launch's rendezvous store (this module's keys under their own prefix), or None in a single process.

    Under torchrun / `accelerate launch` it is the launcher agent's store (TORCHELASTIC_USE_AGENT_STORE, at
    MASTER_ADDR:MASTER_PORT), which every rank reaches before its process group exists and after it is gone, so a
    rank that stops on bad input in its first second can be heard too. Elsewhere it is the process group's own
    store: torch has no public getter for it; `_get_default_store` is what torch.distributed itself uses. Any
    failure here only costs what the store would have told."""
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_ADDR"):
            if not _AGENT_STORE:
                _AGENT_STORE.append(torch.distributed.TCPStore(
                    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=_STORE_TIMEOUT, wait_for_workers=False))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an earlier attempt's notes are not this one's
            return torch.distributed.PrefixStore(f"toolkit-last-words/{attempt}/", _AGENT_STORE[0])
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        return torch.distributed.PrefixStore("toolkit-last-words/", _get_default_store())
    except (ImportError, RuntimeError, ValueError, KeyError):
        return None


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


@dataclass
class Peer:
    """Another rank as seen by a rank that is ending."""

    rank: int
    note: dict[str, Any] | None  # its own last words, when it ended on an error of its own
    pid: int | None
    gone: bool | None  # its process has ended; None where that cannot be seen (another host, no record)

    def describe(self) -> str:
        return f"rank {self.rank}" + (f" (pid {self.pid})" if self.pid is not None else "")


def blame(exc: BaseException, peers: list[Peer]) -> tuple[str, bool] | None:
    """(why this rank stopped, whether relaunching resumes the run) when another rank is the cause; None when the
    cause is this rank's own (a bug here). A peer's own note wins; then a peer process that ended without one;
    then a collective error that only a lost peer gives."""
    for peer in peers:
        note = peer.note or {}
        if note.get("kind") == "error":  # bad input: relaunching does not help until it is fixed
            return f"{peer.describe()} stopped the run with an error: {_first_line(note['message'], 300)}", False
        if note.get("kind") == "failed":
            return (f"{peer.describe()} failed ({note['summary']}; its traceback is in {note['log']}), and this "
                    "rank stopped with it"), True
        if note.get("kind") == "interrupted":
            return f"{peer.describe()} was interrupted (Ctrl-C), and this rank stopped with it", True
        if note.get("kind") == "stopped":
            return (f"{peer.describe()} was stopped by {note['signal']} before training began, and this rank "
                    "stopped with it"), True
    dead = [p for p in peers if p.note is None and p.gone]
    if dead:
        names = ", ".join(p.describe() for p in dead)
        return (f"{names} died (killed by a signal or the out-of-memory killer, or crashed in native code: the "
                "launcher's summary shows how)"), True
    if isinstance(exc, torch.distributed.DistError) or any(sign in str(exc) for sign in _LOST_PEER_SIGNS):
        return (f"a collective failed: a peer process ended or stopped responding "
                f"({type(exc).__name__}: {_first_line(str(exc), 160)})"), True
    return None


class LastWords:
    """What a rank says when it ends on an exception (see the module docstring). One per process."""

    def __init__(self) -> None:
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.layout: RunLayout | None = None
        self.outputs_written = False
        self.stopped_with_a_peer = False  # the last `unexpected` blamed a peer stopped by a signal

    def watch(self, layout: RunLayout) -> None:
        """The run's folder, and this rank's host and pid in the store (collectives are up)."""
        self.layout = layout
        self._store_set(f"pid/{self.rank}", {"host": self.host, "pid": self.pid})

    def run_folder_ready(self) -> None:
        """The run's outputs are being written: the log goes into its folder from now on."""
        self.outputs_written = True

    def stopped_on_error(self, message: str) -> str | None:
        """This rank ends with a one-line error (bad input): the others may name it. Returns the line to print, or
        None when rank 0 says it (`said_by_rank_0`): a launch prints one `error:` line in all (issue 38). The
        launcher's failure summary lists every rank's record: the line once, the other ranks pointing at it; rank 0
        records it before its note, so it is the summary's first observed failure (its 'Root Cause')."""
        line = f"error: {message}"
        if self.rank == 0:
            record_launch_error(line)
        self._store_set(f"end/{self.rank}", {"kind": "error", "message": message})
        if self.rank == 0:
            return line
        quiet = self.said_by_rank_0(message)
        record_launch_error(f"the same error as rank 0 (rank {self.rank} stopped on it too)" if quiet else line)
        return None if quiet else line

    def said_by_rank_0(self, message: str) -> bool:
        """Whether rank 0 ends with this same error, and so says it for the launch (issue 38: one `error:` line in
        all): a rank other than 0 that stops on bad input waits for rank 0's note (up to `_SAME_ERROR_WAIT`: every
        rank reads the same recipe and data, so they fail alike and at about the same time). A rank whose error
        is its own (another message, or rank 0 silent: another host's missing file) says it itself."""
        if self.rank == 0 or self.world == 1 or (store := _store()) is None:
            return False
        try:
            store.set_timeout(_SAME_ERROR_WAIT)
            store.wait(["end/0"])
            note = _store_get(store, "end/0")
        except (RuntimeError, ValueError):  # no word from rank 0 in time, or the store is gone
            return False
        return note == {"kind": "error", "message": message}

    def interrupted(self) -> None:
        self._store_set(f"end/{self.rank}", {"kind": "interrupted"})

    def stopped(self, signal_name: str) -> None:
        """This rank ends on a stop signal that came before the first step: the others may name it."""
        self._store_set(f"end/{self.rank}", {"kind": "stopped", "signal": signal_name})

    def finished(self) -> None:
        """This rank ended as planned (done, or preempted): a peer that fails later does not blame it."""
        self._store_set(f"end/{self.rank}", {"kind": "done"})

    def unexpected(self, exc: BaseException) -> str:
        """The one line for an unexpected exception; the traceback is written to this rank's log first."""
        log = self._write_traceback(exc)
        where = f"its traceback is in {log}" if log is not None else "its traceback is above"
        peers = self._peers(_store()) if self.world > 1 else []
        who = f"rank {self.rank}" if self.world > 1 else "the run"
        blamed = blame(exc, peers)
        if blamed is None:
            summary = f"{type(exc).__name__}: {_first_line(str(exc))}"
            self._store_set(f"end/{self.rank}", {"kind": "failed", "summary": summary, "log": str(log)})
            return (f"error: {who} failed: {summary} ({where}). {self.relaunch_advice()} If it fails the same way, "
                    "report it with that traceback.")
        self._store_set(f"end/{self.rank}", {"kind": "lost"})
        cause, resumable = blamed
        self.stopped_with_a_peer = any((p.note or {}).get("kind") == "stopped" for p in peers)
        advice = f" {self.relaunch_advice()}" if resumable else ""
        return f"error: {who} stopped: {cause}.{advice} The traceback of {who} is {f'in {log}' if log else 'above'}."

    def relaunch_advice(self) -> str:
        """What relaunching the same command does: resume from the last committed checkpoint, or start again."""
        found = committed_checkpoints(self.layout.checkpoints) if self.layout is not None else []
        if found:
            return f"Relaunch the same command to resume from {found[-1]}."
        return "No checkpoint was committed yet: relaunch the same command to start again."

    def _write_traceback(self, exc: BaseException) -> Path | None:
        """Append the traceback to this rank's log; None (and the traceback on stderr) when it cannot be written,
        so that it is never lost."""
        path = (self.layout.rank_log(self.rank, outputs_written=self.outputs_written) if self.layout is not None
                else Path(tempfile.gettempdir()) / f"toolkit-rank-{self.rank}-{self.pid}.log")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # The log may sit in a shared cache (a run stopped before its outputs): never written through a link.
            with os.fdopen(open_own(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a", encoding="utf-8") as f:
                f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: rank {self.rank} of {self.world}, pid "
                        f"{self.pid} on {self.host}\n{''.join(traceback.format_exception(exc))}")
        except (OSError, ToolkitError) as e:
            if isinstance(e, ToolkitError):
                print(f"error: rank log not written: {e}", file=sys.stderr)
            traceback.print_exception(exc, file=sys.stderr)
            return None
        return path

    def _peers(self, store: Any | None) -> list[Peer]:
        """Every other rank: its note in `store` and, on this host, whether its process has ended."""
        if store is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                store.set_timeout(_STORE_TIMEOUT)  # a store that went away must not hold up the ending
        peers = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                note, where = _store_get(store, f"end/{rank}"), _store_get(store, f"pid/{rank}")
            except (RuntimeError, ValueError):  # the store is gone (its host died): nothing more to learn there
                store, note, where = None, None, None
            pid = where["pid"] if where else None
            gone = process_gone(pid) if where and where["host"] == self.host else None
            peers.append(Peer(rank, note, pid, gone))
        return peers

    def _store_set(self, key: str, value: dict[str, Any]) -> None:
        store = _store()
        if store is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                store.set(key, json.dumps(value))


def _store_get(store: Any | None, key: str) -> dict[str, Any] | None:
    return json.loads(store.get(key)) if store is not None and store.check([key]) else None
