"""Preemption: SIGTERM / SIGUSR1 finish the current optimizer step, save a checkpoint and exit.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before killing a job. The handler only
sets a flag; the training loop checks it once per optimizer step with an all-reduce, so every rank stops after
the same step even if only one rank got the signal, saves a committed checkpoint, and exits with
PREEMPTED_EXIT_CODE. `resume: auto` then continues exactly where it stopped.

A signal sent to the launcher alone (`accelerate launch`, torchrun) must not leave the trainer running without
it: the launcher dies, and an orphaned trainer would go on writing the output dir while a requeued job starts a
second writer. Each training process therefore asks the kernel for SIGTERM when its parent dies (Linux
PR_SET_PDEATHSIG), which turns the launcher's death into the same save-and-exit.

Before the first step there is nothing to save, and what runs then (tokenising on a process pool, waiting for
another rank's token store, loading the model, a collective) may take minutes: a stop signal then ends the process
at once. The handler raises `Stopped` (a BaseException, so that no `except Exception` on the way takes it for a
failure) in the main thread, which unwinds through the atomic writers (nothing half-written is kept: every output
is built aside and renamed in), ends the tokenising pool's workers, and leaves one line and PREEMPTED_EXIT_CODE
(SIGINT: the Ctrl-C line and 130). A main thread held in native code (a collective whose peer is gone, a hung
store call) runs no Python handler; a watcher thread, woken through the signal module's wakeup fd whatever the main
thread does, ends the process with the same line once STOP_GRACE_S passed. The launcher (torchrun) forwards SIGTERM
to every rank, so each rank ends with its own line.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from toolkit.atomic import discard_unfinished

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL: 'try again later'. Training processes exit with it after a preemption save."""

INTERRUPTED_EXIT_CODE = 130
"""128 + SIGINT: the shell's code for Ctrl-C. Training processes exit with it when interrupted."""
STOP_GRACE_S = 5.0
"""How long a stop signal before the first step leaves the main thread to unwind before the watcher ends the
process (a main thread held in native code)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_PR_SET_PDEATHSIG = 1


def signal_when_parent_dies(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux PR_SET_PDEATHSIG); False where
    that is not available. Training processes ask for SIGTERM (save and exit), helper processes for SIGKILL."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Stopped(BaseException):
    """A stop signal before the first step: the run ends without saving (there is nothing to save yet)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class PreemptionFlag:
    """Set by SIGTERM or SIGUSR1 (also when the launcher that started this process dies); read by the loop once
    `training()` was called. Before that, the signal stops the process (see the module docstring); `advice` says
    what a relaunch does, for the line it ends with. Hold one per run; `ended()` when the run is over."""

    def __init__(self, advice: Callable[[], str] | None = None) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self.started = False  # the first step began: from now on a signal asks for a save and exit
        self.advice = advice or (lambda: "Relaunch the same command.")
        self._said = threading.Lock()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        _Watcher.install(self)
        if not signal_when_parent_dies(signal.SIGTERM):
            log.debug("no parent-death signal on %s: signal the training processes, not only the launcher",
                      sys.platform)

    def training(self) -> None:
        """The first step begins: a signal from now on finishes the step, saves and exits (the loop reads it)."""
        self.started = True

    def ended(self) -> None:
        """The run is over (however): the watcher no longer serves it."""
        if _Watcher.flag is self:
            _Watcher.flag = None

    def stop_line(self, signal_name: str) -> str:
        """The one line a process stopped before its first step ends with."""
        if signal_name == "SIGINT":
            return INTERRUPTED_LINE
        return f"stopped by {signal_name} before training began: nothing to save. {self.advice()}"

    def say_once(self, line: str) -> bool:
        """Print the process's last line, unless it was printed already (the main thread and the watcher race)."""
        if not self._said.acquire(blocking=False):
            return False
        print(line, file=sys.stderr, flush=True)
        return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.requested
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if not self.started and first:  # once: the unwinding itself must not be cut short by a second signal
            raise Stopped(self.signal_name)


INTERRUPTED_LINE = ("interrupted (Ctrl-C): stopped without saving; relaunch the same command to resume from the last "
                    "checkpoint.")


def exit_code(signal_name: str) -> int:
    """What a process stopped by `signal_name` exits with."""
    return INTERRUPTED_EXIT_CODE if signal_name == "SIGINT" else PREEMPTED_EXIT_CODE


class _Watcher:
    """The thread that ends a process whose main thread does not unwind after a stop signal before the first step
    (module docstring). One per process, serving the newest PreemptionFlag."""

    flag: PreemptionFlag | None = None
    _installed = False

    @classmethod
    def install(cls, flag: PreemptionFlag) -> None:
        cls.flag = flag
        if cls._installed or threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read)
            os.close(write)
            return
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:  # Python's own Ctrl-C handler: it wakes the watcher
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.register_at_fork(after_in_child=_forget_wakeup_fd)  # a forked worker's signals are not this process's
        cls._installed = True
        threading.Thread(target=cls._watch, args=(read,), name="stop-signal-watcher", daemon=True).start()

    @classmethod
    def _watch(cls, fd: int) -> None:
        while True:
            try:
                received = os.read(fd, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            names = [signal.Signals(b).name for b in received if b in (*STOP_SIGNALS, signal.SIGINT)]
            flag = cls.flag
            if not names or flag is None or flag.started:
                continue
            time.sleep(STOP_GRACE_S)
            if flag is not cls.flag or flag.started:  # the run ended, or its loop took the signal over
                continue
            name = flag.signal_name if flag.signal_name is not None else names[0]
            flag.say_once(flag.stop_line(name))  # unless the main thread said it, and then hung
            discard_unfinished()  # the main thread's `finally` will not run: no half-built store is left
            os._exit(exit_code(name))  # no logging.shutdown: the stuck main thread may hold a handler's lock


def _forget_wakeup_fd() -> None:
    with contextlib.suppress(ValueError):  # forked from another thread: that child has no wakeup fd to forget
        signal.set_wakeup_fd(-1)
