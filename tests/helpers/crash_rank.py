"""`train_curriculum.py`, with one rank raising an unexpected exception at one step: a bug that strikes one rank
only (tests/e2e/test_nothing_lost.py launches it). TOOLKIT_TEST_CRASH=RANK:STEP picks the rank and the step."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import toolkit.train.loop

RANK, STEP = map(int, os.environ["TOOLKIT_TEST_CRASH"].split(":"))
real_run_step = toolkit.train.loop.run_step


def run_step(run, stage, step_in_stage, step):
    if step + 1 == STEP and run.accelerator.process_index == RANK:
        raise RuntimeError(f"injected failure on rank {RANK} at step {STEP}")
    return real_run_step(run, stage, step_in_stage, step)


toolkit.train.loop.run_step = run_step  # before train_curriculum imports it by name
sys.argv[0] = str(Path(__file__).resolve().parents[2] / "train_curriculum.py")
runpy.run_path(sys.argv[0], run_name="__main__")
