"""`train_curriculum.py` that stops itself during a scoring pass, as a preemption would: after the first block of
the pass whose name holds STOP_IN_SCORING (e.g. "reference log-probs"), rank 0 sends itself SIGTERM once.

Launched in place of train_curriculum.py (`accelerate launch tests/helpers/stop_in_scoring.py --config ...`). The
signal lands between blocks, where the pass asks every rank whether to stop (toolkit/train/stage_scores.py
`stop_for_signal`): the finished block is kept in the scores file and the run exits preempted, for the relaunch to
go on from there.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import train_curriculum
from toolkit.evals import scoring
from toolkit.runtime import process as distributed

WANTED = os.environ.get("STOP_IN_SCORING", "")
_line = scoring.Progress.line
sent = {"done": False}


def _stopping_line(self: Any, rows: int) -> str:
    out = _line(self, rows)
    rank0 = os.environ.get("RANK", "0") == "0"
    if WANTED and WANTED in self.what and rank0 and not sent["done"] and self.done < self.total:
        sent["done"] = True
        os.kill(os.getpid(), signal.SIGTERM)
    return out


scoring.Progress.line = _stopping_line

if __name__ == "__main__":
    distributed.exit_without_teardown(train_curriculum.main(sys.argv[1:]))
