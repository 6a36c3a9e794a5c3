"""Batches: a stage's micro-batches through a `torch.utils.data.DataLoader`, prepared by accelerate, built by worker
processes with prefetch (and pinned memory on CUDA, left on the host for the loop's own copies), while which samples
a step sees stays a pure function of the step.

`StepBatchSampler` yields, for every step of a stage from a given step on, the step's global batch
(`StageSampler.batch`, sorted by length with `data.group_by_length`) cut into `world x grad_accum` micro-batches in
slot order; accelerate's `BatchSamplerShard` gives process r the slots r, r + world, ..., which is micro-step j of
rank r taking slot j * world + r (`toolkit.curriculum.stages.rank_micro_batches`). A resume, or an early stage advance,
starts a new loader at its step: nothing to fast-forward, nothing in a checkpoint.

Worker processes read the rows (from the memory-mapped stores) and collate them, images decoded and resized there
(`toolkit.data.collate.VLCollator`); each batch comes with its samples' token lengths (FLOPs). A collator's error
(an image gone missing) reaches the training process as the same one-line error, not a worker traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, Dataset

from toolkit.data.collate import pair_collator
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.errors import ToolkitError
from toolkit.metrics.log import sample_lengths
from toolkit.runtime.signals import signal_when_parent_dies
from toolkit.strategies import sequence_parallel


class StepBatchSampler:
    """The micro-batches (lists of sample indices) of steps [start, end) of a stage, in global slot order."""

    def __init__(self, batch: Callable[[int], list[int]], lengths: Sequence[int], *, start: int, end: int,
                 micro_batch_size: int, world_size: int, grad_accum: int, group_by_length: bool) -> None:
        self.batch, self.lengths = batch, lengths
        self.start, self.end = start, end
        self.micro, self.world, self.accum = micro_batch_size, world_size, grad_accum
        self.group_by_length = group_by_length

    def __len__(self) -> int:
        return (self.end - self.start) * self.world * self.accum

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.end):
            indices = self.batch(step)
            if self.group_by_length:  # same samples, fewer pad tokens: loss is normalised over the global batch
                indices = sorted(indices, key=self.lengths.__getitem__)
            m = self.micro
            for slot in range(self.world * self.accum):
                yield indices[slot * m:(slot + 1) * m]


class Rows(Dataset):
    """A stage's rows as a map-style dataset (the DataLoader's workers index it)."""

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


@dataclass
class Failed:
    """A collator's one-line error, carried out of a worker process as data (a raised one would arrive wrapped in
    the worker's traceback)."""

    message: str


class MicroBatch(NamedTuple):
    """A collated micro-batch and what the loop counts of it, taken from the rows on the host (the batch itself
    arrives on the device, where reading a count back would be a sync)."""

    batch: dict[str, Any]
    lengths: list[int]  # token length of every sample (a packed row counts each of its samples)
    label_tokens: int  # tokens that carry a loss: the logits the chunked and Liger heads compute


class Collate:
    """The run's collator on a micro-batch, with the counts of `MicroBatch`; a ToolkitError becomes `Failed`."""

    def __init__(self, collate: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.collate = collate

    def __call__(self, rows: list[dict[str, Any]]) -> MicroBatch | Failed:
        try:
            return MicroBatch(self.collate(rows), [n for row in rows for n in sample_lengths(row)],
                              sum(int(np.count_nonzero(np.asarray(row["labels"]) != IGNORE_INDEX)) for row in rows))
        except ToolkitError as e:
            return Failed(str(e))


def _init_loader_worker(_worker_id: int) -> None:
    """A DataLoader worker leaves its trainer's process group, dies with its trainer, and keeps quiet when the
    trainer hangs up on it (`_quiet_when_the_trainer_hangs_up`).

    The signals that stop a run go to a whole process group: a launcher signals each rank's group, a terminal's
    Ctrl-C the foreground one. A worker they killed made its trainer raise "DataLoader worker ... is killed by
    signal" in its next collective, so a preempted run crashed instead of finishing its step and saving
    (toolkit/runtime/signals.py). In a group of its own the worker does not receive them: the trainer decides.

    Ignoring those signals instead (SIG_IGN) deadlocked every exit with a live loader: Python's multiprocessing
    stops daemonic children at exit with SIGTERM, then waits for them. A signal sent to the worker itself (that
    one, or the loader's own shutdown) still ends it, and the kernel kills it when its trainer dies (Linux), so a
    SIGKILLed trainer leaves no worker holding its files and pipes."""
    os.setpgid(0, 0)
    signal_when_parent_dies(signal.SIGKILL)
    sys.excepthook = _quiet_when_the_trainer_hangs_up


def _quiet_when_the_trainer_hangs_up(exc_type: type[BaseException], exc: BaseException,
                                     tb: TracebackType | None) -> None:
    """A worker's unhandled exception, printed unless it is the trainer hanging up. A worker hands each batch's
    tensors over by passing file descriptors from a thread of its own (multiprocessing's resource sharer). When the
    trainer stops mid-transfer (Ctrl-C, an error), that thread's handshake or send fails with a connection error,
    and it reports the failure itself through `sys.excepthook` (not `threading.excepthook`: it catches everything
    it raises). Its traceback on the stderr the worker shares with the trainer would follow the trainer's one last
    line (seen in CI after a Ctrl-C). The trainer sees its own side of a failed transfer and reports it; this one
    says nothing."""
    if issubclass(exc_type, (ConnectionError, EOFError)):
        return
    sys.__excepthook__(exc_type, exc, tb)


def stage_loader(accelerator: Any, rows: Sequence[dict[str, Any]], sampler: StepBatchSampler,
                 collate: Callable[[list[dict[str, Any]]], dict[str, Any]], *, num_workers: int, seed: int,
                 place: sequence_parallel.Layout | None = None) -> Any:
    """A DataLoader over the stage's rows, prepared by accelerate (its batch sampler sharded over processes).
    Batches stay on the host, pinned on CUDA: the training loop copies each to the device itself, without blocking,
    while the micro-batch before it computes (`toolkit.train.loop.prefetched`); accelerate's placement would copy a
    step's micro-batches at once, each copy waiting for the device's queue to drain. Its own generator (seeded by
    `seed`) gives the workers' base seed: without one, each new iterator draws it from the global torch RNG, so a
    loader started at a resume would shift the stream (dropout masks) against the uninterrupted run, whose loader
    started at the stage's first step.

    Under Ulysses (`place` with sp_size > 1) the sampler is sharded over data-parallel replicas: the processes of
    a sequence-parallel group get the same micro-batches, and each trains its slice of their tokens."""
    loader = DataLoader(Rows(rows), batch_sampler=sampler, collate_fn=Collate(collate), num_workers=num_workers,
                        prefetch_factor=2 if num_workers else None, pin_memory=torch.cuda.is_available(),
                        generator=torch.Generator().manual_seed(seed),
                        worker_init_fn=_init_loader_worker if num_workers else None)
    if place is None or not place.sequence_parallel:
        return accelerator.prepare_data_loader(loader, device_placement=False)
    # accelerate shards over every process (DeepSpeed's Ulysses builds no device mesh it could read replicas from)
    return prepare_data_loader(loader, accelerator.device, num_processes=place.dp_size, process_index=place.dp_rank,
                               put_on_device=False, rng_types=accelerator.rng_types.copy(),
                               even_batches=accelerator.even_batches, non_blocking=accelerator.non_blocking)


class StageBatches:
    """This rank's micro-batches, step after step, from one stage's loader at a time: `take(stage, step)` gives
    the grad_accum micro-batches (`MicroBatch`) of that step, starting a loader at that step whenever the
    stage or the position changes (a stage's start, a resume, an early advance). A preference stage's rows are
    pairs, collated by `toolkit.data.collate.pair_collator` over the run's collator (a micro-batch of m pairs is
    2m sequences, with `pair_index`)."""

    def __init__(self, accelerator: Any, collate: Callable[[list[dict[str, Any]]], dict[str, Any]], *,
                 grad_accum: int, group_by_length: bool, num_workers: int) -> None:
        self.accelerator, self.collate = accelerator, collate
        self.accum, self.group_by_length, self.num_workers = grad_accum, group_by_length, num_workers
        self.place = sequence_parallel.layout(accelerator)  # rows go to data-parallel replicas, not processes
        self._key: tuple[int, int] | None = None  # (stage index, next step in stage) the iterator is at
        self._it: Iterator[Any] | None = None

    def take(self, stage: Any, step_in_stage: int) -> list[MicroBatch]:
        if self._key != (stage.index, step_in_stage):
            self._it = None  # drops the previous loader's iterator (its workers stop)
            sampler = StepBatchSampler(stage.sampler.batch, stage.data.lengths, start=step_in_stage,
                                       end=stage.plan.steps, micro_batch_size=stage.plan.micro_batch,
                                       world_size=self.place.dp_size, grad_accum=self.accum,
                                       group_by_length=self.group_by_length)
            # pairs (and kto rows, each with its KL side): two sides each
            kto = getattr(stage.resolved, "kto", False)
            collate = pair_collator(self.collate) if stage.resolved.pairs or kto else self.collate
            self._it = iter(stage_loader(self.accelerator, stage.data.samples, sampler, collate,
                                         num_workers=self.num_workers, seed=(stage.index << 32) + step_in_stage,
                                         place=self.place))
        assert self._it is not None
        out = []
        for _ in range(self.accum):
            item = next(self._it)
            if isinstance(item, Failed):
                raise ToolkitError(item.message)
            out.append(item)
        self._key = (stage.index, step_in_stage + 1)
        return out

    def close(self) -> None:
        self._it, self._key = None, None
