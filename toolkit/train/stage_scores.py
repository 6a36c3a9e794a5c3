"""Scores a model gives a stage's rows at a point of the run, kept in the run folder, read back on every later
launch: a stage's difficulty `by: loss | perplexity | ifd` (`model: base`, the run's model before training, or
`current`, the policy as it enters the stage), and any other "score these rows at this stage's entry" (a preference
stage's reference log-probs take `stage_entry_scores`).

When. `base` scores at step 0, before the first step (with LoRA the prepared model then equals the base: the
adapters start at zero effect); `current` at the stage's first step, before it runs, with the prepared policy (its
sharded form under ZeRO-3 / FSDP2: toolkit/evals/scoring.py `row_sums`). The stage's sampler is then rebuilt over
the scores (`StageSampler.with_difficulty`): the stage's length in steps does not depend on them.

Kept and reused. The row sums go to `<output_dir>/scores/scores-<key>.npz` (toolkit/evals/scoring.py `ScoreCache`),
written after every block, so a pass stopped part-way goes on at the relaunch. The key hashes what decides the
scores: the rows (each source's store checksum, kept rows and length cut), the rendering (the rows as trained, or
their responses alone for IFD), and the scorer (`base`: the base model and the model settings; `current`: the run's
resume identity, the recipe hash, data checksums, stage batches and trainable state, with the step it scores at, a
function of which is the policy's state then). A resume inside the stage reads the file and never scores with its
later policy; one whose file is gone is refused in one line. A checkpoint references its scores through its run
folder: a resume into a new output_dir takes them from the checkpoint's run (`<run>/checkpoints/step-N`). A resume
from a checkpoint at or before the stage entry scores again from the same state: the same scores (the file, when
there, is simply read).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from accelerate import Accelerator

from toolkit.config.schema import MODEL_MEASURES, ORDERED
from toolkit.curriculum.stages import Stage
from toolkit.data.plan import KeptRows
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import RowSums, ScoreCache, cached_row_sums, measure, response_alone, score_key
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout, committed_checkpoints

log = logging.getLogger(__name__)


def stage_entry_scores(accelerator: Accelerator, model: Any, samples: Sequence[dict[str, Any]],
                       collate: Callable[[list[dict[str, Any]]], dict[str, Any]], micro_batch_size: int, *,
                       folder: Path, key: str, may_score: bool, what: str,
                       elsewhere: Path | None = None, should_stop: Callable[[], bool] | None = None
                       ) -> RowSums | None:
    """Each sample's row sums by `model` (the prepared model: collective, every process calls it), kept in
    `folder` under `key` and read from there when already complete.

    `may_score`: whether the run stands where the key says the scores are taken (a stage's first step, step 0):
    only then may rows still missing be scored. Past that point the model has moved on; a missing or incomplete
    file is refused in one line rather than scored with a later model. `what` names the scores in the log and in
    that refusal. `elsewhere`: another run folder's scores (the run a resume's checkpoint belongs to, when it
    resumes into a new output_dir), whose complete file of this key is taken over. `should_stop`: asked after
    each block, on every process (collective); True stops the pass there, its blocks kept, and returns None."""
    cache = ScoreCache(folder, key, len(samples), writer=accelerator.is_main_process)
    if not cache.complete and elsewhere is not None and elsewhere.resolve() != folder.resolve():
        theirs = ScoreCache(elsewhere, key, len(samples), writer=False)
        if theirs.complete:
            cache.record(np.arange(len(samples)), theirs.sums)
    # Every process takes process 0's reading of the file: another process may read it while process 0 still
    # writes a pass's last block (a second pass of the same key right after), or not see it at all (another node).
    cache.sums, cache.done = distributed.broadcast_from_main(accelerator, (cache.sums, cache.done))
    if not cache.complete and not may_score:
        assert cache.path is not None
        raise ToolkitError(f"{what}: {cache.path} is missing or incomplete, and this launch resumes past the point "
                           "those scores were taken; scoring now would use a later model. Restore the file, or "
                           "resume from a checkpoint at or before that point (checkpoint.resume: a step folder).")
    if cache.complete:
        log.info("%s: read from %s", what, cache.path)
    return cached_row_sums(accelerator, model, samples, collate, micro_batch_size, cache=cache, what=what,
                           should_stop=should_stop)


def model_scored(stage: Stage) -> str | None:
    """The stage's scorer (`base` | `current`) when a model orders it, else None."""
    how = stage.resolved.difficulty
    if how is None or how.by not in MODEL_MEASURES or stage.resolved.order not in ORDERED:
        return None
    return how.model


def rows_identity(parts: Sequence[Any]) -> list[dict[str, Any]]:
    """What decides which rows a pass scores: per source part (`SourceRows`, or a pair stage's `PairRows`), its
    store's checksum, length cut and kept rows."""
    return [{"store": part.store.meta.get("sha256"), "limit": part.selection.limit,
             "rows": hashlib.sha256(np.ascontiguousarray(part.selection.index, np.int64).tobytes()).hexdigest()}
            for part in parts]


def scorer_identity(identity: Any, scorer: str, at_step: int) -> dict[str, Any]:
    """What decides a scorer's weights: the base model (`base`), or the run's state at `at_step` (`current`),
    a function of the run's resume identity and the step."""
    if scorer == "base":
        return {"base": identity.base_model, "model": identity.invariants.get("model"), "state": identity.state}
    return {"current": at_step, "recipe": identity.recipe_hash, "stores": identity.data_stores,
            "batches": identity.stage_batches, "state": identity.state, "base": identity.base_model}


class _Alone(Sequence[dict[str, Any]]):
    """Rows as their responses alone (IFD's denominator)."""

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        return response_alone(self.rows[i])


class ScoringStopped(Exception):
    """A stop signal ended a stage's scoring pass between blocks; a checkpoint at this step resumes it."""


def stop_for_signal(run: Any, step: int) -> Callable[[], bool]:
    """After a block: whether a stop signal reached any process (one all-reduce, the same answer everywhere) and a
    checkpoint at `step` exists for the relaunch to resume the pass from (the stage-end checkpoint, or the one this
    launch resumed from). Without one the pass goes on; the signal then ends the run after the next step."""
    import torch

    acc = run.accelerator
    committed = committed_checkpoints(run.manager.root)
    here = (bool(committed) and committed[-1].name == f"step-{step:08d}") or (
        run.resumed is not None and run.resumed.step == step)

    def ask() -> bool:
        flag = acc.reduce(torch.tensor(float(run.preemption.requested), device=acc.device), reduction="sum")
        return bool(flag.item() > 0) and here

    return ask


def order_by_model(run: Any, stage: Stage, step: int) -> np.ndarray | None:
    """Order `stage` by its model scores (difficulty by loss | perplexity | ifd): score its kept rows (or read
    them), set the stage's difficulty and sampler from them, and return the per-row scores. `run` is the
    train loop's `Run`; `step` the global step the run stands at. None for a stage no model orders. Raises
    `ScoringStopped` when a stop signal ends the pass (`current` scores, from a checkpoint at this step)."""
    scorer = model_scored(stage)
    if scorer is None:
        return None
    how = stage.resolved.difficulty
    assert how is not None
    at = 0 if scorer == "base" else stage.plan.start_step
    rows = KeptRows(stage.data.samples.parts)
    ident = {"rows": rows_identity(rows.parts), "scorer": scorer_identity(run.identity, scorer, at)}
    folder = Path(run.recipe.output_dir) / "scores"
    elsewhere = None if run.resumed_from is None else RunLayout.of_checkpoint(run.resumed_from).scores
    what = f"stage '{stage.name}' scored by the {scorer} model at step {at}"
    args = (run.accelerator, run.model)
    stop = stop_for_signal(run, step) if run.preemption.started else None  # before: a signal stops at once
    given = stage_entry_scores(*args, rows, run.collate, stage.plan.micro_batch, folder=folder,
                               key=score_key(render="given", **ident), may_score=step == at, what=what,
                               elsewhere=elsewhere, should_stop=stop)
    alone = None
    if given is not None and how.by == "ifd":
        alone = stage_entry_scores(*args, _Alone(rows), run.collate, stage.plan.micro_batch, folder=folder,
                                   key=score_key(render="alone", **ident), may_score=step == at,
                                   what=f"{what} (responses alone, for ifd)", elsewhere=elsewhere, should_stop=stop)
        if alone is None:
            raise ScoringStopped(what)
    if given is None:
        raise ScoringStopped(what)
    scores = measure(how.by, given, alone)
    finite = scores[np.isfinite(scores)]
    hardest = float(finite.max()) + 1.0 if len(finite) else 0.0
    per_row = rows.per_row(np.where(np.isfinite(scores), scores, hardest))  # not finite (ifd over 0): hardest
    stage.data.difficulty = per_row
    stage.sampler = stage.sampler.with_difficulty(per_row)
    log.info("stage '%s': ordered %s by %s of the %s model (%d rows; %s %.4g to %.4g, median %.4g)",
             stage.name, stage.resolved.order, how.by, scorer, len(scores), how.by,
             float(finite.min()) if len(finite) else float("nan"), float(finite.max()) if len(finite) else float("nan"),
             float(np.median(finite)) if len(finite) else float("nan"))
    return scores


def score_before_training(run: Any, step: int) -> None:
    """The `base` scores of every stage that takes them, at step 0 before the first step (read back when the run
    resumes later), so that a later stage's `base` is the model before any training."""
    for stage in run.curriculum.stages:
        if model_scored(stage) == "base":
            order_by_model(run, stage, step)
