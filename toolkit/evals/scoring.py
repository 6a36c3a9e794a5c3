"""The scoring pass: one no-grad forward of a model over a list of rows, sharded across the processes, giving every
process each row's summed token loss (float64) and label-token count. One owner for every "score these rows"
question: the eval loss (toolkit/evals/loss.py), model-scored difficulty (loss, perplexity, IFD) and the
reference log-probs of a preference stage (a row's summed log-prob is minus its summed loss).

How it shards. The rows go in blocks; in each block rank r takes rows r, r + world, ... and every rank runs the
same number of forward calls (a rank past its share repeats a row and discards it), because under ZeRO-3 and FSDP2
each forward gathers the parameters collectively and a rank that stopped early would hang the others: the model
stays sharded, nothing is gathered whole. After a block one all-reduce of two float64 vectors (each rank writes only
its own rows, the others add zeros: the sum is exact) gives every rank the block's results, and `on_block` may keep
them: the unit a stopped pass resumes from. Under Ulysses the model runs in eval mode, where every process attends
over whole rows (toolkit/strategies/sequence_parallel.py), so the rows are shared over all processes as well.

Where the numbers come from. Rows are batched by the run's collator, padded or packed into one row. The installed
loss head (toolkit/model/loss_head.py) computes each label token's cross-entropy chunk by chunk, never holding a
full `[tokens x vocabulary]` logits tensor, and adds it to its segment: a padded row, or one sample of a packed row
(its span between `cu_seq_lens` boundaries). With `model.loss_head: standard` the logits are computed in full and
reduced the same way.

Measures of a row (docs/recipes.md, "Model-scored difficulty"): `loss`, the mean label-token cross-entropy
(self-paced learning's difficulty, Kumar et al. 2010); `perplexity`, its exponential; `ifd`, the response's loss
given the prompt divided by its loss alone (Instruction-Following Difficulty, Li et al. 2024), the "alone" row being
`response_alone` of the row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from toolkit.atomic import write_atomic
from toolkit.data.collate import SHARED_IMAGES, SHARED_VIDEOS
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.model.loss_head import loss_head_of, shifted_labels
from toolkit.model.shared_media import shared_media

log = logging.getLogger(__name__)

MEASURES = ("loss", "perplexity", "ifd")


@dataclass
class RowSums:
    """Per row: the summed cross-entropy of its label tokens (float64; minus the summed log-prob) and their count."""

    loss: np.ndarray
    tokens: np.ndarray

    def mean(self) -> np.ndarray:
        """Mean token loss per row (NaN for a row without label tokens)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.tokens > 0, self.loss / np.maximum(self.tokens, 1), np.nan)


def measure(name: str, given: RowSums, alone: RowSums | None = None) -> np.ndarray:
    """The float64 score of each row under `name` (one of MEASURES); `ifd` needs the rows' `alone` sums."""
    if name == "loss":
        return given.mean()
    if name == "perplexity":
        return np.exp(given.mean())
    if name == "ifd":
        if alone is None:
            raise ValueError("ifd needs the response-alone sums")
        with np.errstate(invalid="ignore", divide="ignore"):
            return given.mean() / alone.mean()
    raise ValueError(f"unknown measure {name!r}; choose one of {', '.join(MEASURES)}")


def response_alone(sample: dict[str, Any]) -> dict[str, Any]:
    """The row's response without its prompt, for IFD's s(A): the row's first token (the chat template's opening
    token, an anchor as a BOS is) followed by its label tokens only, every one of them a label. So the response
    tokens are scored given only the response before them, and the count equals the row's own label count. A
    multi-turn row's assistant turns are joined in order."""
    ids, labels = list(sample["input_ids"]), list(sample["labels"])
    kept = [t for t, y in zip(ids, labels, strict=True) if y != IGNORE_INDEX]
    return {"input_ids": ids[:1] + kept, "labels": [IGNORE_INDEX, *kept]}


def segment_ids(batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Each position's segment (``[B, T]``) and the number of segments: the rows of a padded batch, or the
    samples of a packed row (its ``cu_seq_lens_q`` boundaries, or where its text positions restart at 0)."""
    ids = batch["input_ids"]
    if "cu_seq_lens_q" in batch:
        bounds = batch["cu_seq_lens_q"].to(torch.int64).cpu()
        count = len(bounds) - 1
        seg = torch.repeat_interleave(torch.arange(count), bounds.diff()).reshape(ids.shape)
        return seg, count
    if "position_ids" in batch and ids.shape[0] == 1:
        pos = batch["position_ids"].cpu()
        text = (pos[0] if pos.dim() == 3 else pos).reshape(-1)  # VL: [4, 1, T], text positions first
        seg = torch.cumsum((text == 0).to(torch.int64), 0) - 1
        return seg.clamp(min=0).reshape(ids.shape), int(seg.max()) + 1 if seg.numel() else 1
    rows = ids.shape[0]
    return torch.arange(rows).unsqueeze(1).expand(rows, ids.shape[-1]).contiguous(), rows


def _full_logit_sums(model: torch.nn.Module, batch: dict[str, Any], seg: torch.Tensor, count: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment sums from full logits (``model.loss_head: standard``: the user chose full logits)."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    logits = model(**inputs).logits.float()
    if "shift_labels" in batch:  # a Ulysses slice: targets and segments shifted over the whole row (preshifted)
        target, owners = batch["shift_labels"].to(logits.device), seg.to(logits.device)
    else:
        target = shifted_labels(batch["labels"], IGNORE_INDEX).to(logits.device)
        owners = shifted_labels(seg, -1).to(logits.device)
    keep = target != IGNORE_INDEX
    token = F.cross_entropy(logits[keep], target[keep], reduction="none").double()
    loss = torch.zeros(count, dtype=torch.float64, device=logits.device).index_add_(0, owners[keep], token)
    tokens = torch.zeros(count, dtype=torch.int64, device=logits.device).index_add_(
        0, owners[keep], torch.ones_like(owners[keep]))
    return loss, tokens


def _forward_sums(model: torch.nn.Module, batch: dict[str, Any], device: torch.device,
                  segments: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's per-segment (loss sum, token count); `segments`: its `segment_ids`, when already known. A
    Ulysses slice (it carries `shift_labels`) takes its segments shifted over the whole row and sliced like them
    (toolkit/strategies/sequence_parallel.py `shard_segments`): this process's share of each segment's sums."""
    seg, count = segments if segments is not None else segment_ids(batch)
    # a vision pair's images and videos, passed once for both sides: the tower's calls in the forward's order
    shared = ([batch.get(SHARED_IMAGES)] if "pixel_values" in batch else []) + (
        [batch.get(SHARED_VIDEOS)] if "pixel_values_videos" in batch else [])
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
             if k not in (SHARED_IMAGES, SHARED_VIDEOS)}
    head = loss_head_of(model)
    if head is None:
        with shared_media(model, shared):
            return _full_logit_sums(model, batch, seg.to(device), count)
    with head.per_segment(seg.to(device), count, preshifted="shift_labels" in batch) as sums, \
            shared_media(model, shared):
        out = model(**batch, num_items_in_batch=torch.ones((), device=device))
    if sums.loss is None or sums.tokens is None:  # no label token in the micro-batch
        return (torch.zeros(count, dtype=torch.float64, device=device),
                torch.zeros(count, dtype=torch.int64, device=device))
    if torch.is_grad_enabled() and out.loss is not None and out.loss.requires_grad:
        # The sums' gradient must pass through the model's own output: ZeRO-3 opens its backward (the module
        # hooks that gather each layer's shards) on the wrapped model's outputs, and a backward that reaches the
        # layers by another path fails ("active_backward_submodules is empty"). A zero-weighted term adds nothing.
        return sums.loss + 0.0 * out.loss.double(), sums.tokens
    return sums.loss, sums.tokens


def forward_sums(model: torch.nn.Module, batch: dict[str, Any], device: torch.device,
                 segments: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's per-segment (float64 loss sum, label-token count), in segment order (`segment_ids`), by
    the pass's own forward; differentiable under autograd: a preference stage's policy log-probs
    (toolkit/train/preference.py), the same numbers the pass gives its reference. `segments`: the batch's
    `segment_ids` taken on the host copy (the training step's batch is on the device, where reading its
    boundaries back would wait for the device's queue)."""
    return _forward_sums(model, batch, device, segments)


@torch.no_grad()
def row_sums(accelerator: Accelerator, model: torch.nn.Module, samples: Sequence[dict[str, Any]],
             collate: Callable[[list[dict[str, Any]]], dict[str, Any]], micro_batch_size: int, *,
             rows: Sequence[int] | None = None, block_rows: int | None = None,
             on_block: Callable[[np.ndarray, RowSums], None] | None = None) -> RowSums:
    """Each of `rows` (default: all `samples`, each one sequence) scored: a `RowSums` over `rows`, the same on every
    process. Collective: every process calls it with the same rows. `on_block(indices, sums)` is called on every
    process after each block (`block_rows` rows, default all) with that block's rows and results."""
    order = np.arange(len(samples), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    block = max(block_rows or len(order), 1)
    out = RowSums(np.zeros(len(order), np.float64), np.zeros(len(order), np.int64))
    was_training = model.training
    model.eval()
    try:
        for at in range(0, len(order), block):
            chunk = order[at:at + block]
            loss = torch.zeros(len(chunk), dtype=torch.float64, device=device)
            tokens = torch.zeros(len(chunk), dtype=torch.float64, device=device)
            mine = list(range(rank, len(chunk), world))
            per_rank = math.ceil(len(chunk) / world)
            for start in range(0, per_rank, micro_batch_size):
                idx = mine[start:start + micro_batch_size]
                batch = collate([samples[int(chunk[i])] for i in (idx or [0])])  # past its share: run, discard
                summed, counted = _forward_sums(model, batch, device)
                n = max(len(idx), 1)
                if len(summed) < n or bool(counted[n:].any()):  # a VL batch's trailing dummy image has no label
                    raise ValueError(f"a micro-batch of {n} rows collated into {len(summed)} segments with "
                                     "labels: the scoring pass takes one sequence per row")
                if idx:
                    where = torch.tensor(idx, device=device)
                    loss.index_copy_(0, where, summed[:len(idx)])
                    tokens.index_copy_(0, where, counted[:len(idx)].double())
            if world > 1:
                loss = accelerator.reduce(loss, reduction="sum")
                tokens = accelerator.reduce(tokens, reduction="sum")
            part = RowSums(loss.cpu().numpy(), tokens.cpu().numpy().astype(np.int64))
            out.loss[at:at + len(chunk)], out.tokens[at:at + len(chunk)] = part.loss, part.tokens
            if on_block is not None:
                on_block(chunk, part)
    finally:
        model.train(was_training)
    return out


# ------------------------------------------------------------------------------------- cached and resumable


def sums_digest(sums: RowSums) -> str:
    """The sha256 of a complete set of row sums (their loss and token arrays), as a checkpoint records the scores
    it was trained with: a resume checks the kept file against it."""
    digest = hashlib.sha256(np.ascontiguousarray(sums.loss, np.float64).tobytes())
    digest.update(np.ascontiguousarray(sums.tokens, np.int64).tobytes())
    return digest.hexdigest()


def score_key(**identity: Any) -> str:
    """The cache key of one set of row sums: a hash of what decides them, given by the caller as JSON-able values
    (the rows: store checksums and kept rows; the scorer: a weights hash or the run's state at stage entry; the
    rendering: the rows as trained, or their responses alone). Anything else (batch sizes, processes, strategy)
    leaves the sums as they are, so it is not part of the key."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


class ScoreCache:
    """The row sums of one key in `folder/scores-<key>.npz` (`loss`, `tokens` and `done` per row), rewritten
    atomically after every block by the main process: a pass stopped part-way keeps its finished blocks, and the
    next pass over the same key scores only the rows not done. A file of another row count is not this key's.
    `folder` None: kept in memory only."""

    def __init__(self, folder: Path | None, key: str, rows: int, *, writer: bool) -> None:
        self.path = None if folder is None else Path(folder) / f"scores-{key}.npz"
        self.rows, self.writer = rows, writer and self.path is not None
        self.sums = RowSums(np.zeros(rows, np.float64), np.zeros(rows, np.int64))
        self.done = np.zeros(rows, dtype=bool)
        self.unreadable: str | None = None  # why an existing file could not be read (it counts as absent)
        if self.path is None or not self.path.exists():  # kept in memory only, or not written yet
            return
        try:
            with np.load(self.path, allow_pickle=False) as saved:
                loss, tokens, done = saved["loss"], saved["tokens"], saved["done"]
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:  # cut short, edited, not ours
            self.unreadable = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
            return
        if len(loss) == len(tokens) == len(done) == rows:
            self.sums, self.done = RowSums(loss.astype(np.float64), tokens.astype(np.int64)), done.astype(bool)

    @property
    def complete(self) -> bool:
        return bool(self.done.all())

    def record(self, indices: np.ndarray, part: RowSums) -> None:
        self.sums.loss[indices], self.sums.tokens[indices] = part.loss, part.tokens
        self.done[indices] = True
        if self.writer and self.path is not None:
            write_atomic(self.path, lambda f: np.savez(f, loss=self.sums.loss, tokens=self.sums.tokens,
                                                        done=self.done))


class Progress:
    """The pass's progress in the log, once per block: rows done, rows/s and the time left."""

    def __init__(self, what: str, total: int, already: int) -> None:
        self.what, self.total, self.done, self.start_done = what, total, already, already
        self.start = time.monotonic()

    def line(self, rows: int) -> str:
        self.done += rows
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = (self.done - self.start_done) / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (f"{self.what}: {self.done}/{self.total} rows ({100 * self.done / max(self.total, 1):.0f}%), "
                f"{rate:.1f} rows/s, ETA {left:.0f} s")


STOP_FAULT_ENV = "TOOLKIT_FAULT_STOP_SCORING"
"""Fault injection for tests: 'ROWS[:TEXT]' makes a pass (one whose name holds TEXT, if given) go in blocks of ROWS
rows, and rank 0 send itself SIGTERM once its first block is kept: a scheduler's stop that lands inside the pass, at
a known row."""


def _stop_fault(what: str) -> int:
    """The block size STOP_FAULT_ENV asks of the pass named `what` (0: none)."""
    rows, _, text = os.environ.get(STOP_FAULT_ENV, "").partition(":")
    return int(rows) if rows and text in what else 0


def cached_row_sums(accelerator: Accelerator, model: torch.nn.Module, samples: Sequence[dict[str, Any]],
                    collate: Callable[[list[dict[str, Any]]], dict[str, Any]], micro_batch_size: int, *,
                    cache: ScoreCache | None, what: str = "scoring", block_rows: int | None = None,
                    should_stop: Callable[[], bool] | None = None) -> RowSums | None:
    """`row_sums` of every sample, through `cache`: rows it holds are not scored again, each finished block is
    kept as it ends (a pass stopped by a signal keeps them; the relaunch goes on), progress is logged per block.
    Collective, like `row_sums`; every process holds the same cache state (it is read from the same file).
    `should_stop` (collective too, the same answer on every process) is asked after each block: True ends the
    pass there, with None returned, its finished blocks kept."""
    cache = cache if cache is not None else ScoreCache(None, "", len(samples), writer=False)
    todo = np.flatnonzero(~cache.done)
    if len(todo):
        fault = _stop_fault(what)
        block = fault or block_rows or max(micro_batch_size * accelerator.num_processes * 16, 1)
        progress = Progress(what, len(samples), len(samples) - len(todo))
        first = [True]  # the fault's one signal

        def keep(indices: np.ndarray, part: RowSums) -> None:
            cache.record(indices, part)
            if accelerator.is_main_process:
                log.info("%s", progress.line(len(indices)))
                if fault and first:  # STOP_FAULT_ENV: the stop lands after this block, on rank 0 alone
                    first.clear()
                    os.kill(os.getpid(), signal.SIGTERM)
            if should_stop is not None and not cache.complete and should_stop():
                raise _StopPass

        try:
            row_sums(accelerator, model, samples, collate, micro_batch_size, rows=todo, block_rows=block,
                     on_block=keep)
        except _StopPass:
            return None
    return RowSums(cache.sums.loss.copy(), cache.sums.tokens.copy())


class _StopPass(Exception):
    pass
