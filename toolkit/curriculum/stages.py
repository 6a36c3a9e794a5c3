"""The curriculum: an ordered list of stages laid out on one global step axis.

`Curriculum` is the run's one owner of its stages: each `Stage` record holds the stage's resolved settings, its
plan on the step axis, its training set and sampler, its eval rows and its trainable parameter count. It answers
which stage a step is in (`locate`), the samples seen and the learning rate (`lr_at`, the method the LambdaLR
calls), keeps the current stage's eval patience, ends a stage early (moving later stages up and rebuilding the
schedule), and saves and restores its part of a checkpoint (`state` / `restore`). The pure functions below are
its building blocks.

Apart from that state (stage lengths after an early advance, patience counters), everything here is a pure
function of (recipe, dataset sizes, global batch, seed, global step): which stage a step is in, which samples form
that step's global batch (toolkit.curriculum.sampling: shuffle, sequential, easy-to-hard with competence pacing,
weighted mixtures), which of them each rank and micro-step gets, and the learning rate. Nothing depends on the number of
processes except the final split, so a 2-process run sees the same global batches as a 1-process run, and resuming at
any step replays exactly the data the uninterrupted run would have seen. The position in the curriculum is therefore the
global step plus, when a stage ended early on eval patience, the stages' actual lengths (`stage_steps`); checkpoints
save both, and the patience counters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers import get_scheduler

from toolkit.config.schema import AdvanceWhen
from toolkit.config.stages import ResolvedStage
from toolkit.curriculum.sampling import Pacing, StageSampler
from toolkit.data.plan import TrainingSet, kept_by_rank
from toolkit.errors import ToolkitError


@dataclass(frozen=True)
class StagePlan:
    """One stage placed on the global step axis."""

    index: int
    name: str
    num_samples: int
    steps: int
    start_step: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float
    global_batch: int
    micro_batch: int
    steps_per_epoch: int
    schedule: str  # cosine | linear | constant | wsd | continue
    decay_ratio: float = 0.1

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


def plan_stages(names: list[str], sizes: list[int], *, micro_batches: list[int], grad_accum: int, world_size: int,
                epochs: list[float | None], max_steps: list[int | None], lrs: list[float],
                warmup_ratios: list[float], min_lr_ratios: list[float], schedules: list[str],
                decay_ratio: float = 0.1, groups: list[int] | None = None) -> list[StagePlan]:
    """Lay the stages end to end. A stage runs `max_steps`, else `epochs` (default 1) full global batches. An RL
    stage's samples are prompts, each completed `groups[i]` times (rl.num_generations): its global batch of
    micro_batch_size x grad_accum x processes completions is that many times fewer prompts."""
    plans, start = [], 0
    for i, name in enumerate(names):
        group = groups[i] if groups is not None else 1
        n, global_batch = sizes[i], micro_batches[i] * grad_accum * world_size // group
        per_epoch = n // global_batch if global_batch else 0
        if per_epoch == 0:
            unit = (f"{global_batch} prompts (micro_batch_size x grad_accum x processes completions / "
                    f"rl.num_generations {group})" if group > 1 else
                    f"{global_batch} (micro_batch_size x grad_accum x processes)")
            raise ToolkitError(
                f"Stage '{name}' has {n} usable samples, fewer than one global batch of {unit}. Add data or lower "
                "the batch size.")
        steps = max_steps[i] or max(1, round((epochs[i] or 1.0) * per_epoch))
        warmup = math.ceil(round(warmup_ratios[i] * steps, 9))  # round first: 0.07 * 100 is 7.000000000000001
        plans.append(StagePlan(index=i, name=name, num_samples=n, steps=steps, start_step=start, lr=lrs[i],
                               warmup_steps=warmup, min_lr_ratio=min_lr_ratios[i], global_batch=global_batch,
                               micro_batch=micro_batches[i], steps_per_epoch=per_epoch, schedule=schedules[i],
                               decay_ratio=decay_ratio))
        start += steps
    return plans


def end_stage_early(plans: list[StagePlan], index: int, steps: int) -> list[StagePlan]:
    """The plans with stage `index` cut to its first `steps` steps and the later stages moved up to follow it.

    Later stages keep their own lengths and schedules (a stage whose schedule continues into the next may not end
    early: the recipe check refuses patience there). The data each stage samples does not change.
    """
    if not 0 < steps <= plans[index].steps:
        raise ValueError(f"stage {index} has {plans[index].steps} steps, cannot end it after {steps}")
    out, start = list(plans[:index]), plans[index].start_step
    for plan in plans[index:]:
        plan = replace(plan, start_step=start, steps=steps if plan.index == index else plan.steps)
        out.append(plan)
        start = plan.end_step
    return out


def apply_stage_steps(plans: list[StagePlan], stage_steps: list[int]) -> list[StagePlan]:
    """Re-apply the actual stage lengths saved in a checkpoint (stages that ended early are shorter)."""
    if len(stage_steps) != len(plans):
        raise ValueError(f"{len(stage_steps)} saved stage lengths for {len(plans)} stages")
    for plan, steps in zip(list(plans), stage_steps, strict=True):
        if steps != plan.steps:
            plans = end_stage_early(plans, plan.index, steps)
    return plans


@dataclass
class Patience:
    """Early stage advance: True from `update` once eval_loss has not improved by more than `min_delta` on the
    best so far for `patience` evaluations in a row. Serialisable (`state` / `from_state`) for exact resume."""

    patience: int
    min_delta: float = 0.0
    best: float = math.inf
    since_best: int = 0

    def update(self, eval_loss: float) -> bool:
        if eval_loss < self.best - self.min_delta:
            self.best, self.since_best = eval_loss, 0
        else:
            self.since_best += 1
        return self.since_best >= self.patience

    def state(self) -> dict[str, Any]:
        return {"best": None if math.isinf(self.best) else self.best, "since_best": self.since_best}

    @classmethod
    def from_state(cls, patience: int, min_delta: float, state: dict[str, Any] | None) -> Patience:
        state = state or {}
        best = state.get("best")
        return cls(patience, min_delta, math.inf if best is None else best, state.get("since_best", 0))


@dataclass
class Gate:
    """A stage's mastery gate (`advance_when`): met at an evaluation whose metric reaches the threshold once the
    stage has trained `min_steps` steps. Keeps the last and best values and where it was met, for the stage summary
    and its messages; serialisable (`state` / `from_state`) for exact resume."""

    rule: AdvanceWhen
    last: float | None = None
    best: float | None = None
    best_step: int | None = None
    met_step: int | None = None  # the global step it was met at

    def update(self, metrics: dict[str, Any], *, steps_in_stage: int, step: int) -> bool:
        """Take an evaluation's metrics (rank 0's, the same on every rank); True when the gate is met."""
        value = metrics.get(self.rule.metric)
        if not isinstance(value, int | float) or not math.isfinite(value):
            return False
        self.last = float(value)
        higher = self.rule.at_least is not None
        if self.best is None or (value > self.best if higher else value < self.best):
            self.best, self.best_step = self.last, step
        if steps_in_stage >= self.rule.min_steps and self.rule.met(self.last):
            self.met_step = step
            return True
        return False

    def summary(self) -> dict[str, Any]:
        """What the stage summary and metrics.jsonl say about the gate."""
        rule = self.rule
        threshold = {"at_least": rule.at_least} if rule.at_least is not None else {"at_most": rule.at_most}
        return {"metric": self.rule.metric, **threshold, "min_steps": self.rule.min_steps,
                "required": self.rule.required, "met": self.met_step is not None, "met_step": self.met_step,
                "last": self.last, "best": self.best, "best_step": self.best_step}

    def state(self) -> dict[str, Any]:
        return {"last": self.last, "best": self.best, "best_step": self.best_step, "met_step": self.met_step}

    @classmethod
    def from_state(cls, rule: AdvanceWhen, state: dict[str, Any] | None) -> Gate:
        state = state or {}
        return cls(rule, state.get("last"), state.get("best"), state.get("best_step"), state.get("met_step"))


def locate(plans: list[StagePlan], step: int) -> tuple[StagePlan, int]:
    """(stage, step within it) of a global step; steps past the end map to the last stage's last step."""
    for plan in plans:
        if step < plan.end_step:
            return plan, step - plan.start_step
    return plans[-1], plans[-1].steps - 1


def samples_seen(plans: list[StagePlan], steps_done: int) -> int:
    """Samples (packed rows with packing) consumed by the first `steps_done` optimizer steps."""
    return sum(min(max(steps_done - p.start_step, 0), p.steps) * p.global_batch for p in plans)


def rank_micro_batches(indices: list[int], *, rank: int, world_size: int, micro_batch_size: int,
                       grad_accum: int) -> list[list[int]]:
    """This rank's micro-batches of a global batch: micro-step j of rank r takes slice (j * world + r)."""
    m = micro_batch_size
    return [indices[(j * world_size + rank) * m:(j * world_size + rank + 1) * m] for j in range(grad_accum)]


def _schedule_fn(kind: str, *, warmup: int, steps: int, min_lr_ratio: float, decay_ratio: float
                 ) -> Callable[[int], float]:
    """transformers' schedule multiplier for `steps` steps (borrowed from a throwaway optimizer's LambdaLR)."""
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    names = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup",
             "wsd": "warmup_stable_decay"}
    kwargs = {"cosine": {"min_lr_rate": min_lr_ratio},
              "wsd": {"num_decay_steps": max(1, round(decay_ratio * steps)), "min_lr_ratio": min_lr_ratio}}
    sched = get_scheduler(names[kind], dummy, num_warmup_steps=warmup, num_training_steps=steps,
                          scheduler_specific_kwargs=kwargs.get(kind))
    return sched.lr_lambdas[0]


def build_lr_lambda(plans: list[StagePlan], default_kind: str) -> Callable[[int], float]:
    """Absolute LR at a global step (for a LambdaLR over an optimizer whose base lr is 1.0).

    Each stage runs its own transformers schedule (warmup, then decay) from its own peak lr; a stage with
    `schedule: continue` instead extends the previous stage's schedule, which then spans both stages' steps.
    """
    segments: list[tuple[int, StagePlan, Callable[[int], float]]] = []  # (start step, first plan, multiplier)
    owner: dict[int, int] = {}
    for plan in plans:
        if plan.schedule == "continue" and segments:
            owner[plan.index] = len(segments) - 1
            continue
        span = [plan]
        for nxt in plans[plan.index + 1:]:
            if nxt.schedule != "continue":
                break
            span.append(nxt)
        kind = default_kind if plan.schedule in (None, "", "continue") else plan.schedule  # nothing to continue
        fn = _schedule_fn(kind, warmup=plan.warmup_steps, steps=sum(p.steps for p in span),
                          min_lr_ratio=plan.min_lr_ratio, decay_ratio=plan.decay_ratio)
        owner[plan.index] = len(segments)
        segments.append((plan.start_step, plan, fn))

    def lr_at(step: int) -> float:
        plan, _ = locate(plans, step)
        start, first, fn = segments[owner[plan.index]]
        return first.lr * fn(min(step, plans[-1].end_step - 1) - start)

    return lr_at


@dataclass
class Stage:
    """One stage of the run: its settings, its place on the step axis (moved by an early advance), its training
    rows and their sampler, its eval rows and how many parameters it trains (known once the model is built)."""

    resolved: ResolvedStage
    plan: StagePlan
    data: TrainingSet
    sampler: StageSampler
    eval_rows: list[dict[str, Any]]
    trainable_params: int | None = None

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def name(self) -> str:
        return self.plan.name


class Curriculum:
    """The run's stages on the step axis, the learning rate at any step, the current stage's eval patience and
    early advance; `state` / `restore` are its part of a checkpoint (actual stage lengths, patience counters)."""

    def __init__(self, stages: list[Stage], default_schedule: str) -> None:
        self.stages = stages
        self.default_schedule = default_schedule
        self.patience: Patience | None = None
        self.gate: Gate | None = None
        self.ended_by: str | None = None  # what ended the current stage early: patience | gate
        self._resumed_patience: tuple[int, dict[str, Any] | None] | None = None  # (stage index, counters)
        self._resumed_gate: tuple[int, dict[str, Any] | None] | None = None
        self._schedule = build_lr_lambda(self.plans, default_schedule)

    @property
    def plans(self) -> list[StagePlan]:
        return [stage.plan for stage in self.stages]

    @property
    def end_step(self) -> int:
        return self.stages[-1].plan.end_step

    def locate(self, step: int) -> tuple[Stage, int]:
        """(stage, step within it) of a global step; steps past the end map to the last stage's last step."""
        plan, step_in_stage = locate(self.plans, step)
        return self.stages[plan.index], step_in_stage

    def samples_seen(self, steps_done: int) -> int:
        return samples_seen(self.plans, steps_done)

    def lr_at(self, step: int) -> float:
        """Absolute LR at a global step: `LambdaLR(optimizer, curriculum.lr_at)` over base lr 1.0. After an early
        advance it follows the moved-up stages' schedule."""
        return self._schedule(step)

    def set_trainable_params(self, counts: list[int]) -> None:
        for stage, count in zip(self.stages, counts, strict=True):
            stage.trainable_params = count

    def enter(self, stage: Stage) -> None:
        """Start `stage`'s eval patience and mastery gate: the checkpoint's counters when the run resumed inside this
        stage."""
        saved, saved_gate = None, None
        if self._resumed_patience is not None and self._resumed_patience[0] == stage.index:
            saved = self._resumed_patience[1]
        if self._resumed_gate is not None and self._resumed_gate[0] == stage.index:
            saved_gate = self._resumed_gate[1]
        settings = stage.resolved
        self.patience = None if settings.patience is None else Patience.from_state(
            settings.patience, settings.patience_min_delta, saved)
        self.gate = None if settings.advance_when is None else Gate.from_state(settings.advance_when, saved_gate)
        self.ended_by = None

    def advance(self, stage: Stage, steps_in_stage: int, step: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """Whether an evaluation after `steps_in_stage` steps of `stage` (global step `step`) ends it: its gate met
        (first), or its eval_loss patience run out. Returns the reason's record fields, or None. The caller cuts the
        stage (`end_stage_early`) unless this was its last step anyway."""
        if self.gate is not None and self.gate.update(metrics, steps_in_stage=steps_in_stage, step=step):
            return {"reason": "gate", "gate": self.gate.rule.describe(), "metric": self.gate.rule.metric,
                    "value": self.gate.last}
        patience = self.patience
        if patience is not None and "eval_loss" in metrics and patience.update(metrics["eval_loss"]):
            return {"reason": "patience", "best_eval_loss": patience.best}
        return None

    def end_stage_early(self, stage: Stage, steps: int, reason: str = "patience") -> None:
        """Cut `stage` to its first `steps` steps; later stages move up and the LR schedule is rebuilt."""
        self.ended_by = reason
        self._replan(end_stage_early(self.plans, stage.index, steps))

    def ending(self) -> dict[str, Any]:
        """What ended the current stage, for its summary: `ended_by` (gate, patience, or its planned length) and its
        gate's outcome."""
        return {"ended_by": self.ended_by or "planned_length",
                **({"gate": self.gate.summary()} if self.gate is not None else {})}

    def unmet_required_gate(self, stage: Stage) -> str | None:
        """The message that stops the run when `stage` ended without meeting a required gate, else None."""
        gate = self.gate
        if gate is None or not gate.rule.required or gate.met_step is not None:
            return None
        seen = "it was never evaluated" if gate.best is None else (
            f"last {gate.last:.4g}, best {gate.best:.4g} at step {gate.best_step}")
        return (f"stage '{stage.name}' reached its length ({stage.plan.steps} steps, step {stage.plan.end_step}) "
                f"without meeting advance_when {gate.rule.describe()} ({seen}), and the gate is required "
                f"(stages.{stage.index}.advance_when.required): the run stops here. Train the stage longer (a new run "
                "with more max_steps / epochs), or lower the threshold, or set required: false to move on.")

    def _replan(self, plans: list[StagePlan]) -> None:
        for stage, plan in zip(self.stages, plans, strict=True):
            stage.plan = plan
        self._schedule = build_lr_lambda(plans, self.default_schedule)

    def state(self, *, stage_end: bool) -> dict[str, Any]:
        """The checkpoint's `curriculum` entry: actual stage lengths, the current stage's patience counters (none
        at a stage end: the next stage starts afresh) and, for a gated stage, its gate (at a stage end too: a
        resume there must know whether a required gate was met)."""
        return {"stage_steps": [p.steps for p in self.plans],
                "patience": None if self.patience is None or stage_end else self.patience.state(),
                **({"gate": self.gate.state()} if self.gate is not None else {})}

    def restore(self, state: dict[str, Any], *, stage_index: int) -> None:
        """Continue from a checkpoint taken in stage `stage_index`: the lengths of the stages it began (stages that
        ended early keep their length; samplers keep the planned one; `checkpoint.check_resumable` refused a changed
        plan for them), this run's plan for the later ones (a forced change of their length is honoured) and, for
        that stage, its patience counters and gate."""
        planned = [p.steps for p in self.plans]
        stage_steps = (state.get("stage_steps") or planned)[:stage_index + 1] + planned[stage_index + 1:]
        self._replan(apply_stage_steps(self.plans, stage_steps))
        self._resumed_patience = (stage_index, state.get("patience"))
        self._resumed_gate = (stage_index, state.get("gate"))

    def check_resumed_at(self, step: int, stage_index: int) -> None:
        """A resume at the end of a stage that stopped the run on its unmet required gate stops again (it would
        otherwise move on to the next stage as if the gate had been met)."""
        stage = self.stages[stage_index]
        if step != stage.plan.end_step:
            return
        self.enter(stage)
        gate = self.gate
        if gate is not None and gate.last is not None and gate.rule.met(gate.last):
            return  # its last value meets the gate as the recipe now sets it (a lowered threshold)
        message = self.unmet_required_gate(stage)
        if message is not None:
            raise ToolkitError(message)


def build_curriculum(stages: list[ResolvedStage], training_sets: list[TrainingSet],
                     eval_rows: list[list[dict[str, Any]]], *, grad_accum: int, world_size: int, seed: int,
                     default_schedule: str, lr_scaling: str = "none",
                     reference_batch_size: int | None = None) -> Curriculum:
    """Each stage placed on the step axis (steps, lr schedule, batch) with its sampler (mixture, order, pacing).
    A stage dropped by a model's scores is planned over the rows it will keep; until the scores exist its sampler
    keeps a stand-in (the rows by length), never drawn from: the scores replace it before the stage's first step
    (toolkit/train/stage_scores.py). With lr_scaling ('linear' or 'sqrt') each stage's lr scales with its own
    global batch over the reference."""

    def scaled_lr(stage: ResolvedStage) -> float:
        if lr_scaling == "none" or reference_batch_size is None:
            return stage.lr
        ratio = stage.micro_batch_size * grad_accum * world_size / reference_batch_size
        return stage.lr * (ratio if lr_scaling == "linear" else math.sqrt(ratio))

    plans = plan_stages(
        [s.name for s in stages], [src.planned_rows for src in training_sets],
        micro_batches=[s.micro_batch_size for s in stages], grad_accum=grad_accum, world_size=world_size,
        epochs=[s.epochs for s in stages], max_steps=[s.max_steps for s in stages],
        lrs=[scaled_lr(s) for s in stages], warmup_ratios=[s.warmup_ratio for s in stages],
        min_lr_ratios=[s.min_lr_ratio for s in stages], schedules=[s.schedule for s in stages],
        decay_ratio=stages[0].decay_ratio,
        groups=[s.rl.num_generations if s.rl is not None else 1 for s in stages])
    records = []
    for stage, src, plan, rows in zip(stages, training_sets, plans, eval_rows, strict=True):
        sampler = StageSampler(sizes=src.sizes, weights=None if stage.weights is None else list(stage.weights),
                               replacement=stage.mixture_replacement, order=stage.order,
                               difficulty=None if src.difficulty is None else np.array(src.difficulty),
                               lengths=np.array(src.lengths), seed=seed, stage_index=plan.index,
                               pacing=Pacing(stage.pacing.kind, stage.pacing.start_fraction) if stage.pacing else None,
                               global_batch=plan.global_batch, total_steps=plan.steps,
                               keep=None if src.dropped_by_score is None else kept_by_rank(
                                   np.asarray(src.lengths, np.float64), *src.dropped_by_score))
        records.append(Stage(stage, plan, src, sampler, rows))
    return Curriculum(records, default_schedule)
