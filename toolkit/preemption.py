"""Preemption: SIGTERM / SIGUSR1 finish the current optimizer step, save a checkpoint and exit.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before killing a job. The handler only
sets a flag; the training loop checks it once per optimizer step with an all-reduce, so every rank stops after
the same step even if only one rank got the signal, saves a committed checkpoint, and exits with
PREEMPTED_EXIT_CODE. `resume: auto` then continues exactly where it stopped.

A signal sent to the launcher alone (`accelerate launch`, torchrun) must not leave the trainer running without
it: the launcher dies, and an orphaned trainer would go on writing the output dir while a requeued job starts a
second writer. Each training process therefore asks the kernel for SIGTERM when its parent dies (Linux
PR_SET_PDEATHSIG), which turns the launcher's death into the same save-and-exit.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
from types import FrameType

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL: 'try again later'. Training processes exit with it after a preemption save."""

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


class PreemptionFlag:
    """Set by SIGTERM or SIGUSR1 (also when the launcher that started this process dies); read by the loop."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)
        if not signal_when_parent_dies(signal.SIGTERM):
            log.debug("no parent-death signal on %s: signal the training processes, not only the launcher",
                      sys.platform)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
