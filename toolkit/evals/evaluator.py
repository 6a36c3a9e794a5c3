"""One evaluation of the run: eval loss and generation evals of the current stage, or of every stage with
eval.all_stages (the forgetting matrix), reduced to one set of metrics that every rank acts on.

`Evaluator.evaluate` is what the loop calls every eval.every_steps and at stage ends. It runs

* the loss evaluation (toolkit.evals.loss) of the stage's eval files: `eval_loss`, `eval_ppl`, `eval_tokens`; with
  all_stages every stage's files too, as `<stage>.eval_loss`. A preference stage's eval pairs are scored by the
  training side's `pair_eval` (toolkit/train/pair_stage.py: its preference loss as `eval_loss`, `pref_accuracy`),
  once its reference exists;
* the generation evals (toolkit.evals.generation) of the stage, or of every stage: `<eval>.<score>`, the mean over the
  eval's rows. The weights are gathered once for all of them (toolkit.strategies.full_weights).

Rank 0 then writes the completions of the eval, one line per row with the prompt, output, reference and score, to
`evals/<stage>/step-N.jsonl`, sends them to TensorBoard (text) and W&B (a table) where those trackers are on,
appends the forgetting matrix (toolkit.evals.forgetting) and broadcasts its metrics: every rank then decides gates and
patience on rank 0's numbers. The eval's time is returned, so the loop leaves it out of training tokens/s.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from toolkit.atomic import write_text_atomic, writing
from toolkit.config.schema import Recipe, RlConfig
from toolkit.config.stages import ResolvedStage
from toolkit.curriculum.stages import Curriculum, Stage
from toolkit.errors import ToolkitError
from toolkit.evals.forgetting import MatrixLog, matrix_record
from toolkit.evals.generation import GenerationEval, gather_records, generate, load_generation_eval, score_rows
from toolkit.evals.loss import evaluate
from toolkit.evals.rewards import build_rewards
from toolkit.evals.scorers import Scorer, build_scorers
from toolkit.metrics.log import to_json_line
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout
from toolkit.strategies.full_weights import full_weights_for_generation, shards_parameters

log = logging.getLogger("toolkit")

TRACKER_ROWS = 32
"""Rows of each eval shown in TensorBoard's text panel (the completions file and W&B's table have all of them)."""


def import_scorers(recipe: Recipe, recipe_dir: Path) -> dict[str, list[Scorer]]:
    """Every generation eval's scorers by eval name, user functions imported (from `recipe_dir` or the installed
    packages), and every RL stage's rewards built (toolkit/evals/rewards.py). Called before anything
    heavy: a broken scorer or reward is one error line naming its key."""
    for i, stage in enumerate(recipe.stages):  # RL stages' rewards: built (user modules imported) and dropped
        if stage.objective == "grpo" and stage.rewards:
            build_rewards([r.model_dump() for r in stage.rewards], key=f"stages.{i}.rewards", recipe_dir=recipe_dir,
                          max_completion_length=(stage.rl or RlConfig()).max_completion_length)
    scorers = {g.name: build_scorers(g.scorers, key=f"eval.generation.{i}.scorers", recipe_dir=recipe_dir)
               for i, g in enumerate(recipe.eval.generation)}
    for i, stage in enumerate(recipe.stages):
        for j, g in enumerate(stage.generation or []):
            scorers[g.name] = build_scorers(g.scorers, key=f"stages.{i}.generation.{j}.scorers",
                                            recipe_dir=recipe_dir)
    return scorers


@dataclass
class GenerationPlan:
    """The run's generation evals, per stage (in stage order; one object per eval, shared by the stages that
    use it), and what renders and decodes them."""

    per_stage: list[list[GenerationEval]] = field(default_factory=list)
    processing: Any = None  # the tokenizer, or a VL model's processor
    vision: bool = False
    image_kwargs: dict[str, Any] = field(default_factory=dict)


def load_generation_plan(recipe: Recipe, stages: list[ResolvedStage], scorers: dict[str, list[Scorer]],
                         processing: Any, dummy_dir: Path, *, vision: bool) -> GenerationPlan:
    """Every stage's generation evals, each read and rendered once (a stage-defined eval belongs to its stage)."""
    shared = {g.name for g in recipe.eval.generation}
    loaded: dict[str, GenerationEval] = {}
    per_stage = []
    for stage in stages:
        evals = []
        for config in stage.generation:
            if config.name not in loaded:
                loaded[config.name] = load_generation_eval(
                    config, scorers[config.name], processing, stage=None if config.name in shared else stage.name,
                    dummy_dir=dummy_dir, vision=vision, thinking=recipe.data.thinking)
            evals.append(loaded[config.name])
        per_stage.append(evals)
    image_kwargs = {}
    if vision and (recipe.data.min_pixels or recipe.data.max_pixels):
        size = dict(processing.image_processor.size)
        size.update({k: v for k, v in (("shortest_edge", recipe.data.min_pixels),
                                       ("longest_edge", recipe.data.max_pixels)) if v})
        image_kwargs = {"images_kwargs": {"size": {k: size[k] for k in ("shortest_edge", "longest_edge")}}}
    if loaded:
        log.info("generation evals: %s", ", ".join(f"'{g.name}' ({len(g.prompts)} prompts)" for g in loaded.values()))
    return GenerationPlan(per_stage, processing, vision, image_kwargs)


@dataclass
class EvalResult:
    """An evaluation's metrics (rank 0's, on every rank) and how long it took, in seconds."""

    metrics: dict[str, Any]
    seconds: float


class Evaluator:
    """The run's evaluations (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, curriculum: Curriculum, layout: RunLayout,
                 generation: GenerationPlan | None = None, *, all_stages: bool = False, seed: int = 0) -> None:
        self.accelerator, self.curriculum, self.layout = accelerator, curriculum, layout
        self.generation = generation or GenerationPlan([[] for _ in curriculum.stages])
        self.all_stages, self.seed = all_stages, seed
        self.matrix = MatrixLog(layout.eval_matrix, enabled=accelerator.is_main_process and all_stages)
        # A preference stage's eval pairs: (model, stage) -> metrics, or None before the stage's reference exists.
        self.pair_eval: Callable[[Any, Stage], dict[str, Any] | None] | None = None

    def _loss_stages(self, stage: Stage) -> list[Stage]:
        """The stages whose eval files this eval scores (one per distinct set of files and length)."""
        if not self.all_stages:
            return [stage] if stage.eval_rows else []
        seen, out = set(), []
        for s in self.curriculum.stages:
            key = (s.resolved.eval, s.resolved.max_seq_len, s.resolved.pairs)
            if s.eval_rows and key not in seen:
                seen.add(key)
                out.append(s)
        return out

    def _generation_evals(self, stage: Stage) -> list[GenerationEval]:
        per_stage = self.generation.per_stage
        chosen = per_stage if self.all_stages else [per_stage[stage.index]]
        return list({id(g): g for evals in chosen for g in evals}.values())

    def has_evals(self, stage: Stage) -> bool:
        return bool(self._loss_stages(stage) or self._generation_evals(stage))

    def evaluate(self, model: Any, collate: Any, stage: Stage, step: int) -> EvalResult:
        """Every eval due at `step` in `stage` (`collate` batches the loss evaluation's rows); collective: every
        rank calls it."""
        acc, started = self.accelerator, time.perf_counter()
        metrics: dict[str, Any] = {}
        matrix: list[dict[str, Any]] = []
        for s in self._loss_stages(stage):
            if s.resolved.pairs:
                result = self.pair_eval(model, s) if self.pair_eval is not None else None
                if result is None:  # a preference stage not entered yet: its reference is not taken
                    continue
            else:
                result = evaluate(acc, model, s.eval_rows, collate, s.resolved.eval_micro_batch_size)
            key = (s.resolved.eval, s.resolved.max_seq_len, s.resolved.pairs)
            shared = [o.name for o in self.curriculum.stages
                      if (o.resolved.eval, o.resolved.max_seq_len, o.resolved.pairs) == key]
            if stage.name in shared:
                metrics.update(result)
            if self.all_stages:
                owner = shared[0] if len(shared) == 1 else None
                for name in shared:
                    metrics[f"{name}.eval_loss"] = result["eval_loss"]
                matrix.append(matrix_record(step, stage.name, owner, "loss", "eval_loss", result["eval_loss"]))
                if "pref_accuracy" in result:
                    for name in shared:
                        metrics[f"{name}.pref_accuracy"] = result["pref_accuracy"]
                    matrix.append(matrix_record(step, stage.name, owner, "pairs", "pref_accuracy",
                                                result["pref_accuracy"]))
        evals = self._generation_evals(stage)
        records: dict[str, list[dict[str, Any]]] = {}
        if evals:
            gen_started = time.perf_counter()
            records = self._generate(model, evals, step)
            metrics["eval_gen_seconds"] = time.perf_counter() - gen_started
            for g in evals:
                for scorer in g.scorers:
                    value = sum(r["score"][scorer.name] for r in records[g.name]) / len(records[g.name])
                    metrics[f"{g.name}.{scorer.name}"] = value
                    if self.all_stages:
                        matrix.append(matrix_record(step, stage.name, g.stage, g.name, scorer.name, value))
        metrics["eval_seconds"] = time.perf_counter() - started
        if acc.is_main_process:
            self._write(stage, step, evals, records, matrix)
        metrics = distributed.broadcast_from_main(acc, metrics if acc.is_main_process else None)
        return EvalResult(metrics, time.perf_counter() - started)

    def _generate(self, model: Any, evals: list[GenerationEval], step: int) -> dict[str, list[dict[str, Any]]]:
        """Every eval's completions and scores, gathered (all ranks get them); a scorer error stops every rank."""
        acc, plan = self.accelerator, self.generation
        lockstep = shards_parameters(acc)
        was_training = model.training
        model.eval()
        out = {}
        try:
            # Under the launch's mixed precision, as the training forward runs: `generate` calls the unwrapped model,
            # outside the autocast accelerate wraps the prepared forward in, and the adapters' input casts are off
            # for the run (`skip_adapter_input_casts`), so a 16-bit base would feed fp32 adapters 16-bit inputs.
            with acc.autocast(), full_weights_for_generation(acc, model) as unwrapped:
                for g in evals:
                    completions = generate(acc, unwrapped, g, plan.processing, vision=plan.vision, lockstep=lockstep,
                                           seed=self.seed, step=step, image_kwargs=plan.image_kwargs)
                    rows, error = gather_records(*score_rows(g, completions))
                    if error is not None:
                        raise ToolkitError(error)  # on every rank: the error was gathered to all
                    out[g.name] = rows
        finally:
            model.train(was_training)
        return out

    def _write(self, stage: Stage, step: int, evals: list[GenerationEval], records: dict[str, list[dict[str, Any]]],
               matrix: list[dict[str, Any]]) -> None:
        """Rank 0: the completions file, the trackers, the matrix."""
        self.matrix.write(matrix)
        if not evals:
            return
        lines = []
        for g in evals:
            for r in records[g.name]:
                prompt = g.prompts[r["index"]]
                lines.append({"eval": g.name, "eval_stage": g.stage, "row": r["index"], "where": prompt.where,
                              "prompt": prompt.text, "output": r["output"], "reference": prompt.reference,
                              "score": r["score"]})
        path = self.layout.completions(stage.name, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, "".join(to_json_line(line) for line in lines))
        completions_to_trackers(self.accelerator, stage.name, step, lines)


def completions_to_trackers(accelerator: Accelerator, stage: str, step: int, lines: list[dict[str, Any]]) -> None:
    """An eval's completions (the lines of its file) to the run's trackers: TensorBoard, a Markdown table per eval
    (its first TRACKER_ROWS rows); W&B, a table of every row. Rank 0."""
    names = {t.name for t in accelerator.trackers}
    columns = ["eval", "row", "prompt", "output", "reference", "score"]
    evals = dict.fromkeys(line["eval"] for line in lines)
    if "tensorboard" in names:
        writer = accelerator.get_tracker("tensorboard", unwrap=True)
        events = Path(accelerator.logging_dir or ".")  # TensorBoard's event files
        for name in evals:
            rows = [line for line in lines if line["eval"] == name][:TRACKER_ROWS]
            table = "| row | prompt | output | reference | score |\n|---|---|---|---|---|\n" + "".join(
                f"| {r['row']} | {_cell(r['prompt'])} | {_cell(r['output'])} | {_cell(r['reference'])} | "
                f"{_cell(r['score'])} |\n" for r in rows)
            with writing(events):
                writer.add_text(f"completions/{stage}/{name}", table, global_step=step)
        with writing(events):
            writer.flush()
    if "wandb" in names:
        data = [[line[c] if isinstance(line[c], str | int) else json.dumps(line[c]) for c in columns]
                for line in lines]
        accelerator.get_tracker("wandb").log_table(f"completions/{stage}", columns=columns, data=data, step=step)


def _cell(value: Any) -> str:
    """A value in one Markdown table cell: JSON for non-strings, pipes escaped, newlines as <br>."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", "<br>")
