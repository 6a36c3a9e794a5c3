"""Preemption: SIGTERM / SIGUSR1 finish the current optimizer step, save a checkpoint and exit.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before killing a job. The handler only
sets a flag; the training loop checks it once per optimizer step with an all-reduce, so every rank stops after
the same step even if only one rank got the signal, saves a committed checkpoint, and exits with
PREEMPTED_EXIT_CODE. `resume: auto` then continues exactly where it stopped.
"""

from __future__ import annotations

import signal
from types import FrameType

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL: 'try again later'. Training processes exit with it after a preemption save."""


class PreemptionFlag:
    """Set by SIGTERM or SIGUSR1; read by the loop."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
