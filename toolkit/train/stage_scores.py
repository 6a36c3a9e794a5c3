"""Scores a model gives a stage's rows at a point of the run, kept in the run folder, read back on every later
launch: a stage's difficulty `by: loss | perplexity | ifd` (`model: base`, the run's model before training,
`current`, the policy as it enters the stage, or a separate scorer model: toolkit/train/scorer_model.py), what
orders the stage and what its `drop` ranks by, and any other "score these rows at this stage's entry" (a preference
stage's reference log-probs take `stage_entry_scores`).

When. `base` scores at step 0, before the first step (with LoRA the prepared model then equals the base: the
adapters start at zero effect); a separate scorer at step 0 too, loaded whole for its pass and freed after it;
`current` at the stage's first step, before it runs, with the prepared policy (its sharded form under ZeRO-3 /
FSDP2: toolkit/evals/scoring.py `row_sums`). The stage's sampler is then rebuilt over the scores
(`StageSampler.with_difficulty`): the stage's length in steps does not depend on them. A `drop` by the scores
leaves out the lowest and highest scored of the stage's rows (packed rows with packing, each ranked by its hardest
sample), as many as the recipe's shares of them (`TrainingSet.dropped_by_score`, known at launch: the stage is
planned over the rest), and the sampler draws from the rows kept.

Kept and reused. The row sums go to `<output_dir>/scores/scores-<key>.npz` (toolkit/evals/scoring.py `ScoreCache`),
written after every block, so a pass stopped part-way goes on at the relaunch. The key hashes what decides the
scores: the rows (each source's store checksum, kept rows and length cut), the rendering (the rows as trained, or
their responses alone for IFD), and the scorer (`base`: the base model and the model settings; `current`: the run's
resume identity, the recipe hash, data checksums, stage batches and trainable state, with the step it scores at, a
function of which is the policy's state then; a separate scorer: the sha256 of its weights files and config, and
its dtype). A resume inside the stage reads the file and never scores with its
later policy; one whose file is gone is refused in one line. A checkpoint references its scores through its run
folder: a resume into a new output_dir takes them from the checkpoint's run (`<run>/checkpoints/step-N`). A resume
from a checkpoint at or before the stage entry scores again from the same state: the same scores (the file, when
there, is simply read).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from accelerate import Accelerator

from toolkit.config.schema import ORDERED, PAIR_MEASURES, SCORED_MEASURES, SCORERS
from toolkit.curriculum.stages import Stage
from toolkit.data.collate import PAIR_PAD_MULTIPLE, sides_collator
from toolkit.data.plan import KeptRows, PairSides, kept_by_rank
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import (
    RowSums,
    ScoreCache,
    cached_row_sums,
    measure,
    response_alone,
    score_key,
    sums_digest,
)
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout, committed_checkpoints
from toolkit.train.scorer_model import free_memory, load_scorer, resolve_scorer, weights_identity

log = logging.getLogger(__name__)


def stage_entry_scores(accelerator: Accelerator, model: Any, samples: Sequence[dict[str, Any]],
                       collate: Callable[[list[dict[str, Any]]], dict[str, Any]], micro_batch_size: int, *,
                       folder: Path, key: str, may_score: bool, what: str,
                       elsewhere: Path | None = None, should_stop: Callable[[], bool] | None = None,
                       digests: dict[str, str] | None = None, recorded: dict[str, str] | None = None
                       ) -> RowSums | None:
    """Each sample's row sums by `model` (the prepared model: collective, every process calls it), kept in
    `folder` under `key` and read from there when already complete.

    `may_score`: whether the run stands where the key says the scores are taken (a stage's first step, step 0):
    only then may rows still missing be scored. Past that point the model has moved on; a missing or incomplete
    file is refused in one line rather than scored with a later model. `what` names the scores in the log and in
    that refusal. `elsewhere`: another run folder's scores (the run a resume's checkpoint belongs to, when it
    resumes into a new output_dir), whose complete file of this key is taken over. `should_stop`: asked after
    each block, on every process (collective); True stops the pass there, its blocks kept, and returns None.

    `recorded`: the digests (`sums_digest`) of the scores the checkpoint a launch resumes from was trained with,
    by key; a kept file of such a key that holds other scores (edited or replaced after the run) is refused in one
    line, never used. `digests`: the run's own record, to which the complete scores' digest is added (a checkpoint
    saves it)."""
    want = (recorded or {}).get(key)

    def check(kept: ScoreCache) -> None:
        if kept.complete and want is not None and sums_digest(kept.sums) != want:
            raise ToolkitError(f"{what}: {kept.path} holds other scores than the checkpoint this launch resumes from "
                               "was trained with (their sha256 differs from the one its meta.json records): the file "
                               "was edited or replaced after the run. Restore it, or resume from a checkpoint at or "
                               "before the point those scores were taken.")

    cache = ScoreCache(folder, key, len(samples), writer=accelerator.is_main_process)
    unread = (cache.path, cache.unreadable) if cache.unreadable else None
    if not cache.complete and elsewhere is not None and elsewhere.resolve() != folder.resolve():
        theirs = ScoreCache(elsewhere, key, len(samples), writer=False)
        check(theirs)  # before they are copied into this run's folder
        if theirs.complete:
            cache.record(np.arange(len(samples)), theirs.sums)
        elif theirs.unreadable:
            unread = (theirs.path, theirs.unreadable)
    # Every process takes process 0's reading of the file: another process may read it while process 0 still
    # writes a pass's last block (a second pass of the same key right after), or not see it at all (another node).
    cache.sums, cache.done = distributed.broadcast_from_main(accelerator, (cache.sums, cache.done))
    if not cache.complete and not may_score:
        assert cache.path is not None
        state = f"{unread[0]} cannot be read ({unread[1]})" if unread else f"{cache.path} is missing or incomplete"
        raise ToolkitError(f"{what}: {state}, and this launch resumes past the point those scores were "
                           "taken; scoring now would use a later model. Restore the file, or resume from a checkpoint "
                           "at or before that point (checkpoint.resume: a step folder).")
    check(cache)
    if unread and may_score:
        log.warning("%s: %s cannot be read (%s): scored again", what, *unread)
    if cache.complete:
        log.info("%s: read from %s", what, cache.path)
    sums = cached_row_sums(accelerator, model, samples, collate, micro_batch_size, cache=cache, what=what,
                           should_stop=should_stop)
    if sums is not None and digests is not None:
        digests[key] = sums_digest(sums)
    return sums


def kept_digests(run: Any) -> dict[str, Any]:
    """`stage_entry_scores`'s `digests` and `recorded` of a run: the train loop's `Run` keeps them (its checkpoints
    save them, its resume reads them back); `toolkit score`'s stand-in has none."""
    return {"digests": getattr(run, "score_digests", None), "recorded": getattr(run, "recorded_digests", None)}


def model_scored(stage: Stage) -> str | None:
    """The stage's scorer (`base` | `current` | a separate scorer's folder or hub id) when a model orders it or
    ranks it for `drop`, else None."""
    how = stage.resolved.difficulty
    if how is None or how.by not in SCORED_MEASURES:
        return None
    if stage.resolved.order not in ORDERED and stage.resolved.drop is None:
        return None
    return how.model


def rows_identity(parts: Sequence[Any]) -> list[dict[str, Any]]:
    """What decides which rows a pass scores: per source part (`SourceRows`, or a pair stage's `PairRows`), its
    store's checksum, length cut and kept rows."""
    return [{"store": part.store.meta.get("sha256"), "limit": part.selection.limit,
             "rows": hashlib.sha256(np.ascontiguousarray(part.selection.index, np.int64).tobytes()).hexdigest()}
            for part in parts]


def scorer_identity(identity: Any, scorer: str, at_step: int, *, precision: str = "no") -> dict[str, Any]:
    """What decides a scorer's sums: its weights, the base model (`base`) or the run's state at `at_step`
    (`current`, a function of the run's resume identity and the step), and the launch's mixed precision (a bf16
    pass sums other numbers than an fp32 one: the two never share a scores file; "no" leaves the keys of fp32 runs
    as they were)."""
    weights = ({"base": identity.base_model, "model": identity.invariants.get("model"), "state": identity.state}
               if scorer == "base" else
               {"current": at_step, "recipe": identity.recipe_hash, "stores": identity.data_stores,
                "batches": identity.stage_batches, "state": identity.state, "base": identity.base_model})
    return weights if precision == "no" else {**weights, "precision": precision}


def pair_sides_key(run: Any, parts: Sequence[Any], scorer: str, at: int, *, adapter_off: bool,
                   render: str = "pairs") -> str:
    """The scores key of a preference stage's pairs' sides (`PairSides` over `parts`) scored by the run's `scorer`
    (`base` | `current`) at step `at`, with the LoRA adapter off or not: a dpo stage's reference pass and a pair
    stage's difficulty by margin | chosen_loss share it, so a dpo stage whose difficulty is the current model's
    reads its reference's own scores (one pass, never two). `render`: how the sides are made (a kto stage's
    names its KL sides' chunk)."""
    return score_key(rows=rows_identity(parts), scorer=scorer_identity(run.identity, scorer, at,
                                                                       precision=run.accelerator.mixed_precision),
                     render=render,
                     base=adapter_off, pad_to=PAIR_PAD_MULTIPLE)


def pair_measure(name: str, sides: RowSums) -> np.ndarray:
    """Each pair's difficulty from its sides' sums (chosen 0, rejected 0, chosen 1, ...), higher is harder:
    `margin` ranks by minus (chosen log-prob - rejected log-prob), so a large margin is easy; `chosen_loss` is the
    chosen side's mean per-token NLL (NaN without label tokens)."""
    chosen, rejected = RowSums(sides.loss[0::2], sides.tokens[0::2]), RowSums(sides.loss[1::2], sides.tokens[1::2])
    if name == "margin":
        return chosen.loss - rejected.loss  # NLLs: -(log p(chosen) - log p(rejected))
    if name == "chosen_loss":
        return chosen.mean()
    raise ValueError(f"unknown pair measure {name!r}; choose one of {', '.join(PAIR_MEASURES)}")


def _pair_sums(run: Any, stage: Stage, scorer: str, at: int, step: int) -> RowSums | None:
    """The sides' sums of a pair stage's train pairs by the run's `scorer` at step `at` (read back, or taken now
    when `step` is `at`), as a dpo stage's reference pass takes them (the same micro-batch, collator and key);
    None when a stop signal ended the pass."""
    parts = stage.data.samples.parts
    folder = Path(run.recipe.output_dir) / "scores"
    elsewhere = None if run.resumed_from is None else RunLayout.of_checkpoint(run.resumed_from).scores
    if run.accelerator.num_processes > 1:  # the main process's last write of this key is done: all read alike
        run.accelerator.wait_for_everyone()
    stop = stop_for_signal(run, step) if run.preemption.started else None
    what = f"stage '{stage.name}' pairs scored by the {scorer} model at step {at}"
    sides = PairSides(parts)
    return stage_entry_scores(run.accelerator, run.model, sides, sides_collator(run.collate), stage.plan.micro_batch,
                              folder=folder, key=pair_sides_key(run, parts, scorer, at, adapter_off=False),
                              may_score=step == at, what=what, elsewhere=elsewhere, should_stop=stop,
                              **kept_digests(run))


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


def _complete(folder: Path, elsewhere: Path | None, key: str, rows: int) -> bool:
    """Whether the scores of `key` are kept whole here or in `elsewhere` (no model need load for them)."""
    return any(where is not None and ScoreCache(where, key, rows, writer=False).complete
               for where in (folder, elsewhere))


def _scores(run: Any, stage: Stage, scorer: str, rows: KeptRows, at: int, step: int
            ) -> tuple[RowSums | None, RowSums | None]:
    """The stage's kept rows' sums (and for ifd the responses alone) by `scorer` at step `at`, read back or taken
    now; (None, None) when a stop signal ended the pass. A separate scorer is loaded only when some are missing and
    may be taken now, and freed after the pass."""
    how = stage.resolved.difficulty
    assert how is not None
    separate = scorer not in SCORERS
    path = resolve_scorer(scorer, run.recipe.output_dir) if separate else None
    scorer_ident = weights_identity(path, run.recipe) if path is not None else scorer_identity(
        run.identity, scorer, at, precision=run.accelerator.mixed_precision)
    ident = {"rows": rows_identity(rows.parts), "scorer": scorer_ident}
    folder = Path(run.recipe.output_dir) / "scores"
    elsewhere = None if run.resumed_from is None else RunLayout.of_checkpoint(run.resumed_from).scores
    renders = [("given", rows, "")] + ([("alone", _Alone(rows), " (responses alone, for ifd)")]
                                      if how.by == "ifd" else [])
    keys = [score_key(render=render, **ident) for render, _, _ in renders]
    if run.accelerator.num_processes > 1:  # the main process's last write of these keys is done: all read alike
        run.accelerator.wait_for_everyone()
    model: Any = run.model
    if path is not None:
        missing = not all(_complete(folder, elsewhere, key, len(rows)) for key in keys)
        model = None
        if missing and step == at:  # else stage_entry_scores reads them, or refuses: no model needed
            attn = run.accelerator.unwrap_model(run.model).config._attn_implementation
            model = load_scorer(path, run.recipe, run.accelerator.device, attn,
                                trust_remote_code=how.trust_remote_code)
    name = f"the scorer {scorer}" if separate else f"the {scorer} model"
    what = f"stage '{stage.name}' scored by {name} at step {at}"
    stop = stop_for_signal(run, step) if run.preemption.started else None  # before: a signal stops at once
    out: list[RowSums | None] = []
    try:
        with run.accelerator.autocast() if separate else contextlib.nullcontext():
            for (_, samples, said), key in zip(renders, keys, strict=True):
                out.append(stage_entry_scores(run.accelerator, model, samples, run.collate, stage.plan.micro_batch,
                                              folder=folder, key=key, may_score=step == at, what=what + said,
                                              elsewhere=elsewhere, should_stop=stop, **kept_digests(run)))
                if out[-1] is None:
                    return None, None
    finally:
        if path is not None and model is not None:
            del model
            free_memory(run.accelerator.device)
    return out[0], out[1] if len(out) > 1 else None


def scoring_step(stage: Stage) -> int | None:
    """The step at which the model that scores `stage` takes its scores: the stage's first step for `current`,
    0 for `base` and a separate scorer (before any training); None for a stage no model scores."""
    scorer = model_scored(stage)
    return None if scorer is None else stage.plan.start_step if scorer == "current" else 0


def entry_sums(run: Any, stage: Stage, step: int) -> tuple[RowSums, RowSums | None]:
    """The row sums a model-scored `stage` is ordered (or dropped) by, from the run standing at `step`: taken now
    when `step` is its `scoring_step`, else read back (or refused, `stage_entry_scores`). `run` is the train loop's
    `Run`, or `toolkit score`'s stand-in for one (recipe, identity, accelerator, model, collate, resumed_from,
    preemption). Collective. Raises `ScoringStopped` when a stop signal ends the pass."""
    scorer, at = model_scored(stage), scoring_step(stage)
    assert scorer is not None and at is not None and stage.resolved.difficulty is not None
    if stage.resolved.difficulty.by in PAIR_MEASURES:
        given, alone = _pair_sums(run, stage, scorer, at, step), None
    else:
        given, alone = _scores(run, stage, scorer, KeptRows(stage.data.samples.parts), at, step)
    if given is None:
        raise ScoringStopped(f"stage '{stage.name}' scored by {scorer} at step {at}")
    return given, alone


def order_by_model(run: Any, stage: Stage, step: int) -> np.ndarray | None:
    """Order `stage` by its model scores (difficulty by loss | perplexity | ifd; a pair stage's by margin |
    chosen_loss, `pair_measure`), or drop its easiest / hardest rows by them: score its kept rows (or read them),
    set the stage's difficulty and sampler from them (over the rows a drop keeps), and return the per-row scores
    of the kept rows. `run` is the train loop's `Run`; `step` the global step the run stands at. None for a stage
    no model scores. Raises `ScoringStopped` when a stop signal ends the pass (`current` scores, from a checkpoint
    at this step)."""
    scorer = model_scored(stage)
    if scorer is None:
        return None
    how = stage.resolved.difficulty
    assert how is not None
    rows = KeptRows(stage.data.samples.parts)  # a pair stage's: its pairs, one a row (never packed together)
    given, alone = entry_sums(run, stage, step)
    scores = pair_measure(how.by, given) if how.by in PAIR_MEASURES else measure(how.by, given, alone)
    finite = scores[np.isfinite(scores)]
    hardest = float(finite.max()) + 1.0 if len(finite) else 0.0
    per_row = rows.per_row(np.where(np.isfinite(scores), scores, hardest))  # not finite (ifd over 0): hardest
    keep = None
    if stage.data.dropped_by_score is not None:
        keep = kept_by_rank(per_row, *stage.data.dropped_by_score)
        easy, hard = stage.data.dropped_by_score
        log.info("stage '%s': dropped the %d easiest and the %d hardest of its %d rows by %s of %s (%d kept)",
                 stage.name, easy, hard, len(per_row), how.by, _named(scorer), int(keep.sum()))
    stage.data.difficulty = per_row
    stage.sampler = stage.sampler.with_difficulty(per_row, keep)
    if stage.resolved.order in ORDERED:
        log.info("stage '%s': ordered %s by %s of %s (%d rows; %s %.4g to %.4g, median %.4g)",
                 stage.name, stage.resolved.order, how.by, _named(scorer), len(scores),
                 "minus margin" if how.by == "margin" else how.by,
                 float(finite.min()) if len(finite) else float("nan"),
                 float(finite.max()) if len(finite) else float("nan"),
                 float(np.median(finite)) if len(finite) else float("nan"))
    return scores


def _named(scorer: str) -> str:
    return f"the {scorer} model" if scorer in SCORERS else f"the scorer {scorer}"


def check_kept_scores(run: Any, step: int) -> None:
    """A launch resumed at `step` reads the scores taken before it (every stage's scored at step 0, and those of
    the stage it resumes inside when they were taken at its entry): read them now, before the launch writes anything
    into its run folder, so that one missing or incomplete is refused in one line while the folder is as it was
    (`stage_entry_scores`). Nothing is scored, and no separate scorer loaded: these scores were taken earlier."""
    here = run.curriculum.locate(step)[0] if step < run.curriculum.end_step else None
    for stage in run.curriculum.stages:
        at = scoring_step(stage)
        if at is not None and at < step and (model_scored(stage) != "current" or stage is here):
            entry_sums(run, stage, step)


def score_before_training(run: Any, step: int) -> None:
    """The `base` and separate scorers' scores of every stage that takes them, at step 0 before the first step
    (read back when the run resumes later), so that a later stage's `base` is the model before any training."""
    for stage in run.curriculum.stages:
        scorer = model_scored(stage)
        if scorer is not None and scorer != "current":
            order_by_model(run, stage, step)
