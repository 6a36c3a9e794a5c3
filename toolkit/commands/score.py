"""`toolkit score --config R [--stage NAME]`: a stage's rows scored before any training, by the pass training uses
(toolkit/evals/scoring.py), for the user to look at: a histogram, the easiest and hardest rows by `file:line`, and
every row's score in a parquet file.

    toolkit score --config R                                                       # one process, its device
    accelerate launch --config_file accelerate_configs/zero3.yaml -m toolkit score --config R   # any config file

It builds what training builds, with training's own builders (toolkit/train/setup.py: the accelerator of the launch,
the stages and their token stores, the model with its LoRA and loss head, `prepare` under the launch's strategy), so
under a launch the model is the strategy's (sharded under ZeRO-3 and FSDP2, not gathered; whole rows per process
under Ulysses) and the rows are shared over the data-parallel ranks. Rank 0 alone prints the report and writes the
parquet file.

What it scores, and what training then reads:
* a stage a model orders, at step 0 (`model: base`, or `current` on a stage that starts at step 0, where the policy
  is the model before training): the scores training takes, through training's own function
  (toolkit/train/stage_scores.py `entry_sums`), kept in `<output_dir>/scores/` under training's key, so a later
  launch of the run reads them instead of scoring (a launch of the same batch layout: `current`'s key holds the
  stages' global batches). A pass stopped by a signal keeps its finished blocks; the next `toolkit score` or the
  training run goes on from there.
* a `current` stage after training steps: its scores exist only at its entry during training. It scores the rows
  with the model before training instead, says so, and keeps nothing for training.
* a stage no model orders: the rows' loss under the model before training, kept nowhere but the parquet file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.atomic import write_atomic
from toolkit.config.schema import MODEL_MEASURES, Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.plan import KeptRows
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import measure
from toolkit.runtime.run_dir import RunLayout
from toolkit.strategies import strategy_name

log = logging.getLogger(__name__)

SHOWN = 5  # easiest and hardest rows printed
DUMMY_SAMPLES = 256
"""Rows per generated dummy file (`dummy:` data), as train_curriculum.py's --num_dummy_samples default: the rows
training then reads."""


def histogram(values: np.ndarray, bins: int = 10, width: int = 40) -> list[str]:
    """A text histogram of the finite values, one line per bin."""
    finite = values[np.isfinite(values)]
    if not len(finite):
        return ["(no finite score)"]
    counts, edges = np.histogram(finite, bins=bins)
    top = max(int(counts.max()), 1)
    return [f"  {lo:10.4g} - {hi:10.4g} | {'#' * round(width * c / top):<{width}} {c}"
            for lo, hi, c in zip(edges[:-1], edges[1:], counts.tolist(), strict=True)]


@dataclass
class _Scoring:
    """What the scoring pass takes of a training run (toolkit/train/stage_scores.py `entry_sums`): a run that stands
    at step 0, resumed from nothing, whose stop signals end it at once (the `toolkit` command's handler)."""

    recipe: Recipe
    identity: Any
    accelerator: Any
    model: Any
    collate: Any
    resumed_from: Path | None = None
    preemption: Any = field(default_factory=lambda: SimpleNamespace(started=False))


def score(recipe: Recipe, *, stage: str | None, out: Path | None, dummy_samples: int = DUMMY_SAMPLES) -> str | None:
    """Score one stage's rows (`stage`, default: the first stage a model orders, else the first) and write every
    row's score to `out` (default `<output_dir>/scores/<stage>.parquet`, ours to replace; a named `out` that
    exists is refused). Collective under a launch (every process calls it). Returns the report on rank 0, None on
    the other ranks."""
    from toolkit.builtin.models import materialize_builtin
    from toolkit.evals.scoring import cached_row_sums, response_alone
    from toolkit.runtime import process as distributed
    from toolkit.runtime.run_dir import RunLock, check_output_dir
    from toolkit.train import setup
    from toolkit.train.stage_scores import entry_sums, model_scored, scoring_step

    resolved = resolve_stages(recipe)
    names = [s.name for s in resolved]
    if stage is not None and stage not in names:
        raise ToolkitError(f"--stage {stage!r} is not a stage of the recipe; its stages are {names}.")
    scored = [s for s in resolved if s.difficulty is not None and s.difficulty.by in MODEL_MEASURES]
    st = next(s for s in resolved if s.name == stage) if stage is not None else (scored or resolved)[0]
    if st.pairs:
        raise ToolkitError(f"Stage '{st.name}' trains on preference pairs (objective {st.objective}); toolkit score "
                           "scores a stage's rows: name a stage of rows with --stage.")
    if out is not None and out.exists():
        raise ToolkitError(f"--out {out} exists; name a new file (toolkit score never replaces a file you named).")
    if dummy_samples < 1:
        raise ToolkitError(f"--num-dummy-samples must be at least 1, got {dummy_samples}.")
    layout = RunLayout(recipe.output_dir)
    check_output_dir(layout.root)
    model_path = materialize_builtin(recipe.model.name_or_path, layout.cache)  # every process, as training does
    accelerator = setup.start_accelerator(recipe, layout)
    lock = RunLock(layout)  # one writer per output dir: a live training run of it, or another toolkit score
    busy = distributed.broadcast_from_main(accelerator, lock.acquire() if accelerator.is_main_process else None)
    if busy is not None:
        raise ToolkitError(f"output_dir {layout.root}: {busy}.")
    try:
        run, curriculum = _prepared(recipe, resolved, layout, accelerator, model_path, dummy_samples)
        stage_ = curriculum.stages[names.index(st.name)]
        rows = KeptRows(stage_.data.samples.parts)
        if not len(rows):
            raise ToolkitError(f"Stage '{st.name}' has no usable rows to score.")
        scorer, at = model_scored(stage_), scoring_step(stage_)
        name = st.difficulty.by if scorer is not None and st.difficulty is not None else "loss"
        if at == 0:  # the scores training takes, in its cache under its key
            given, alone = entry_sums(run, stage_, 0)
        else:
            what, micro = f"scoring stage '{st.name}' with the model before training", stage_.plan.micro_batch
            given = cached_row_sums(accelerator, run.model, rows, run.collate, micro, cache=None, what=what)
            alone = None if name != "ifd" else cached_row_sums(
                accelerator, run.model, [response_alone(rows[i]) for i in range(len(rows))], run.collate, micro,
                cache=None, what=f"{what} (responses alone, for ifd)")
        if not accelerator.is_main_process:
            return None
        values = measure(name, given, alone)
        where = [part.store.where(int(i)) for part in rows.parts for i in part.selection.index]
        columns = {"row": where, name: values, "loss_sum": given.loss, "tokens": given.tokens}
        if alone is not None:
            columns |= {"alone_loss_sum": alone.loss, "alone_tokens": alone.tokens}
        target = out if out is not None else layout.stage_scores(st.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lambda f: pq.write_table(pa.table(columns), f))
    finally:
        lock.release()
    lines = [f"stage '{st.name}': {len(values)} rows scored by {name} of "
             f"{'the policy as it enters the stage at step 0: ' if scorer == 'current' and at == 0 else ''}"
             f"the model before training ({recipe.model.name_or_path}"
             f"{', LoRA at zero effect' if recipe.lora.enabled else ''}; {accelerator.num_processes} process(es), "
             f"{strategy_name(accelerator)})"]
    if at == 0:
        lines.append(f"  (the scores training takes: kept in {layout.scores}/, a launch of this run reads them)")
    elif scorer == "current":
        lines.append(f"  (training orders this stage by the policy as it enters it, at step {at}, known only then: "
                     "these are the base model's scores, not kept for training)")
    order = np.argsort(np.where(np.isfinite(values), values, np.inf), kind="stable")
    lines += histogram(values)
    lines += [f"easiest {min(SHOWN, len(order))}:"] + [f"  {values[i]:.4g}  {where[i]}" for i in order[:SHOWN]]
    lines += [f"hardest {min(SHOWN, len(order))}:"] + [f"  {values[i]:.4g}  {where[i]}" for i in order[::-1][:SHOWN]]
    lines.append(f"scores: {target}")
    return "\n".join(lines)


def _prepared(recipe: Recipe, resolved: list[Any], layout: RunLayout, accelerator: Any, model_path: str,
              dummy_samples: int) -> tuple[_Scoring, Any]:
    """The run as training builds it, up to its prepared model (toolkit/train/setup.py, in train_curriculum.py's
    order): the stages over their token stores, the collator, the run's identity (its model state included: part
    of the scores' key), the model prepared under the launch's strategy. Returns it with the curriculum."""
    from accelerate.utils import set_seed

    from toolkit.checkpoint.resume import state_signature
    from toolkit.data.stages import data_fingerprint, tokenized_cache_dir
    from toolkit.strategies.deepspeed import configure_deepspeed
    from toolkit.train import setup
    from toolkit.train.optimizer import build_optimizer

    if setup.check_model(model_path, trust_remote_code=recipe.model.trust_remote_code):
        raise ToolkitError("toolkit score scores text models only for now; this recipe's model is vision-language.")
    sp_attention = setup.check_sequence_parallel(accelerator, resolved, model_path, vision=False,
                                                 trust_remote_code=recipe.model.trust_remote_code)
    _, tokenizer = setup.prepare_inputs(recipe, resolved, accelerator, model_path, layout.dummy_data, vision=False,
                                        dummy_samples=dummy_samples)
    cache = tokenized_cache_dir(recipe.data.cache_dir, layout.root)
    curriculum = setup.build_stages(recipe, resolved, accelerator, tokenizer, None, layout.dummy_data, cache)
    collate = setup.build_collator(recipe, model_path, tokenizer, vision=False)
    identity = setup.run_identity(recipe, accelerator, curriculum, run_name="toolkit-score", model_path=model_path,
                                  data_files=data_fingerprint(resolved, layout.dummy_data, cache))
    set_seed(recipe.train.seed)  # as training builds its model
    model, trainable = setup.build_model(recipe, resolved, model_path, vision=False,
                                         mixed_precision=accelerator.mixed_precision, sp_attention=sp_attention)
    identity.state = state_signature(model, trainable.groups)
    configure_deepspeed(accelerator, model, resolved[0].micro_batch_size, recipe.optimizer.max_grad_norm)
    # Prepared with training's optimizer: nothing steps it, but ZeRO-1/2 and FSDP2 prepare a model only with one (the
    # state it would hold is training's own: no more memory than training takes).
    opt = recipe.optimizer
    optimizer = build_optimizer(accelerator, trainable.param_groups(model), lr=1.0, weight_decay=opt.weight_decay,
                                betas=opt.betas, eps=opt.eps)
    model, _ = setup.prepare(accelerator, model, optimizer)
    return _Scoring(recipe, identity, accelerator, model, collate), curriculum
