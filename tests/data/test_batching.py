"""Batches through the DataLoader (toolkit/data/batching.py): accelerate's sharding of the step's slots gives every
rank exactly `rank_micro_batches`, a loader started at any step continues the same sequence (resume), workers give
the same batches as the training process, and a collator's error arrives as its one line."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from accelerate.data_loader import prepare_data_loader

from toolkit.curriculum.sampling import StageSampler
from toolkit.curriculum.stages import rank_micro_batches
from toolkit.data.batching import StageBatches
from toolkit.errors import ToolkitError

WORLD, ACCUM, MICRO, STEPS = 2, 2, 3, 7


class Process:
    """accelerate's view of one of WORLD processes: what StageBatches asks of the Accelerator."""

    num_processes = WORLD

    def __init__(self, rank: int) -> None:
        self.rank = self.process_index = rank

    def prepare_data_loader(self, loader: Any, device_placement: bool | None = None) -> Any:
        assert device_placement is False  # batches stay on the host: the loop copies them (toolkit/train/loop.py)
        return prepare_data_loader(loader, num_processes=WORLD, process_index=self.rank, put_on_device=False)


def _stage(n: int = 40) -> Any:
    rows = [{"input_ids": list(range(1 + i % 5)), "labels": [-100] + [7] * (i % 5), "i": i} for i in range(n)]
    lengths = np.array([len(r["input_ids"]) for r in rows])
    sampler = StageSampler(sizes=[n], weights=None, replacement=False, order="shuffle", difficulty=None,
                           lengths=lengths, pacing=None, seed=3, stage_index=0, global_batch=WORLD * ACCUM * MICRO,
                           total_steps=STEPS)
    return SimpleNamespace(index=0, sampler=sampler, data=SimpleNamespace(samples=rows, lengths=lengths),
                           plan=SimpleNamespace(steps=STEPS, micro_batch=MICRO), resolved=SimpleNamespace(pairs=False))


def _collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if any(r["i"] == 13 for r in rows) and rows[0].get("fail"):
        raise ToolkitError("data.jsonl:14: image file a.png does not exist.")
    return {"i": [r["i"] for r in rows]}


class UlyssesProcess:
    """One of 2 * WORLD processes in Ulysses groups of 2 (`parallelism_config.sp_size`): WORLD replicas."""

    num_processes, parallelism_config = 2 * WORLD, SimpleNamespace(sp_size=2)
    device, rng_types, even_batches, non_blocking = torch.device("cpu"), [], True, False

    def __init__(self, rank: int) -> None:
        self.process_index = rank


def _batches(stage: Any, rank: int, start: int, *, workers: int = 0, group: bool = False,
             process: Any = None) -> list[list[list[int]]]:
    batches = StageBatches(process or Process(rank), _collate, grad_accum=ACCUM, group_by_length=group,
                           num_workers=workers)
    out = []
    for step in range(start, STEPS):
        taken = batches.take(stage, step)
        out.append([m.batch["i"] for m in taken])
        assert [m.lengths for m in taken] == [[1 + i % 5 for i in m.batch["i"]] for m in taken]
        assert [m.label_tokens for m in taken] == [sum(i % 5 for i in m.batch["i"]) for m in taken]
    return out


@pytest.mark.parametrize("group", [False, True])
def test_each_rank_gets_its_slots_of_every_step(group: bool) -> None:
    stage = _stage()
    for rank in range(WORLD):
        expected = []
        for step in range(STEPS):
            indices = stage.sampler.batch(step)
            if group:
                indices = sorted(indices, key=stage.data.lengths.__getitem__)
            expected.append(rank_micro_batches(indices, rank=rank, world_size=WORLD, micro_batch_size=MICRO,
                                              grad_accum=ACCUM))
        assert _batches(stage, rank, 0, group=group) == expected


def test_a_loader_started_at_a_step_continues_the_same_sequence() -> None:
    stage = _stage()
    full = _batches(stage, 1, 0)
    for start in (1, 4, STEPS - 1):
        assert _batches(stage, 1, start) == full[start:]


def test_workers_give_the_same_batches() -> None:
    stage = _stage()
    assert _batches(stage, 0, 2, workers=2) == _batches(stage, 0, 2)


def test_a_collator_error_in_a_worker_is_its_one_line() -> None:
    stage = _stage()
    for row in stage.data.samples:
        row["fail"] = True
    with pytest.raises(ToolkitError) as info:
        _batches(stage, 0, 0, workers=1) + _batches(stage, 1, 0, workers=1)
    assert str(info.value) == "data.jsonl:14: image file a.png does not exist."


@pytest.mark.parametrize("workers", [0, 1])
def test_starting_a_loader_leaves_the_global_rng_alone(workers: int) -> None:
    """A loader started at a resume must not draw from the global torch RNG (the uninterrupted run's loader drew
    at the stage's start, not there): the dropout masks after a resume would be another stream's."""
    import torch

    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    batches = StageBatches(Process(0), _collate, grad_accum=ACCUM, group_by_length=False, num_workers=workers)
    batches.take(_stage(), 2)
    assert torch.equal(torch.rand(3), expected)


TRAINER = """
import signal, sys
from tests.data.test_batching import Process, StageBatches, ACCUM, _stage

def collate(rows):  # runs in the worker: which exception hook the worker's init left there
    return {"i": [r["i"] for r in rows], "hook": sys.excepthook.__name__}

got = []
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: got.append(signum))  # as toolkit/runtime/signals.py: note it, go on
stage = _stage()
BATCHES = StageBatches(Process(0), collate, grad_accum=ACCUM, group_by_length=False, num_workers=1)
print("ready", "hook", BATCHES.take(stage, 0)[0].batch["hook"], flush=True)
sys.stdin.readline()
print("signals", sorted(got), "batches", [m.batch["i"] for m in BATCHES.take(stage, 1)], flush=True)
# exits with its loader's iterator (and worker) alive, as a preempted or failed trainer does
"""


def test_workers_leave_stop_signals_to_the_trainer() -> None:
    """The stop signals sent to a trainer's process group (a launcher's SIGTERM, a terminal's Ctrl-C) do not
    reach its workers: the trainer notes them, takes its next step's batches and exits, and the exit does not wait
    on its live loader. A worker killed by them made the trainer raise "DataLoader worker ... is killed by signal"
    (the preempted ZeRO-3 launch of tests/e2e/test_resume.py crashed); workers that ignored them instead hung every
    exit with a live loader (Python stops daemonic children at exit with SIGTERM, then joins them: CI timed out)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", TRAINER], cwd=Path(__file__).parents[2], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = proc.stdout.readline().strip()
        if ready != "ready hook _quiet_when_the_trainer_hangs_up":
            proc.kill()  # before reading its stderr to the end
            pytest.fail(f"{ready!r}\n{proc.communicate()[1][-3000:]}")
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 1 and os.getpgid(workers[0].pid) != os.getpgid(proc.pid)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.killpg(proc.pid, sig)
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    expected = sorted(int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1))
    assert out.startswith(f"signals {expected} batches "), out
    assert not psutil.pid_exists(workers[0].pid) or workers[0].status() == psutil.STATUS_ZOMBIE


HANG_UP = """
import os, socket, sys, time
import multiprocessing as mp
from multiprocessing import resource_sharer

def worker(queue, init):
    if init:
        from toolkit.data.batching import _init_loader_worker
        _init_loader_worker(0)
    read, _ = os.pipe()
    queue.put(resource_sharer.DupFd(read)._id)  # what pickling a shared tensor does: the fd waits for its taker
    time.sleep(2)
    try:
        raise ValueError("a real bug")  # still reported
    except ValueError:
        sys.excepthook(*sys.exc_info())

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    process = ctx.Process(target=worker, args=(queue, sys.argv[1] == "init"))
    process.start()
    address, _ = queue.get(timeout=60)
    taker = socket.socket(socket.AF_UNIX)
    taker.connect(address)
    taker.close()  # the trainer hangs up mid-handshake (a Ctrl-C while it unpickles a batch)
    process.join(60)
"""


@pytest.mark.parametrize("init", ["init", "none"])
def test_a_worker_says_nothing_when_the_trainer_hangs_up(init: str) -> None:
    """The worker's fd-passing thread (multiprocessing's resource sharer) failing because the trainer hung up
    mid-transfer prints nothing once the worker's init ran (CI: its EOFError or BrokenPipeError traceback followed
    Ctrl-C's one line); another exception is still printed. Without the init, the same hang-up prints the
    traceback: the script does reproduce what CI saw."""
    import subprocess
    import sys
    from pathlib import Path

    err = subprocess.run([sys.executable, "-c", HANG_UP, init], cwd=Path(__file__).parents[2], capture_output=True,
                         text=True, timeout=120).stderr
    assert "ValueError: a real bug" in err, err
    assert ("resource_sharer.py" in err) == (init == "none"), err  # its BrokenPipeError or EOFError


def test_the_processes_of_a_ulysses_group_draw_their_replicas_rows() -> None:
    """Under Ulysses the sampler is sharded over replicas, not processes: processes 2r and 2r + 1 of 4 (sp_size 2)
    take replica r's micro-batches, which are rank r's of a 2-process run."""
    stage = _stage()
    for process in range(2 * WORLD):
        assert _batches(stage, process, 0, process=UlyssesProcess(process)) == _batches(stage, process // 2, 0)
