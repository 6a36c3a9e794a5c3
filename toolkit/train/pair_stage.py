"""A preference stage (objective dpo | orpo | simpo) inside the run: its reference log-probs taken as it begins, the
loss of a micro-batch of pairs, TRL's step metrics, and its eval pairs' `pref_accuracy`.

The losses themselves are toolkit/train/preference.py's; this module wires them into the loop's units.

Reference. At the stage's first step, before it trains, one scoring pass of the prepared policy (sharded over the
data-parallel ranks under the run's strategy: toolkit/evals/scoring.py) goes over every side of the stage's pairs,
train and eval, and keeps each side's summed log-prob (float64) in `<output_dir>/scores/`
(toolkit/train/stage_scores.py `stage_entry_scores`). The key binds them to the stage's pairs and to the run's state
at the stage's first step: a resume inside the stage reads them back and never scores with its later policy; a pass
stopped by a signal keeps its finished blocks and the relaunch goes on. `reference: base` takes the pass with the
LoRA adapter switched off (LLaMA-Factory's reference). No second model copy is ever held. ORPO and SimPO take none.

Step. A micro-batch holds its pairs' sides in pair order (chosen 0, rejected 0, chosen 1, ...: padded rows, or the
spans of one packed row; toolkit/data/collate.py `pair_collator`) and the stage-global index of each pair
(`pair_index`), which finds its reference. One forward gives every side's summed log-prob through the loss head
(`policy_logps`); the pair losses are normalised by the global batch's pair count and the sft term by its chosen-token
count (`global_normalisers`, one all-reduce, kept on the device as the sft step's token count), so neither gradient
accumulation nor the process count changes the loss. The metrics' sums ride in the step's own all-reduce
(toolkit/train/loop.py). Under Ulysses each side's log-prob is summed over the group's slices (`policy_logps`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolkit.config.schema import describe_objective as describe
from toolkit.config.schema import pair_losses
from toolkit.config.stages import ResolvedStage
from toolkit.curriculum.stages import Stage
from toolkit.data.collate import sides_collator
from toolkit.data.plan import PairSides
from toolkit.evals.scoring import row_sums
from toolkit.runtime.run_dir import RunLayout
from toolkit.strategies.sequence_parallel import Layout
from toolkit.train.kto import KTO_SUMS
from toolkit.train.preference import (
    METRICS,
    PairLogps,
    PreferenceSettings,
    adapter_disabled,
    metric_sums,
    pair_counts,
    policy_logps,
    preference_loss,
    preference_terms,
    split_pairs,
)
from toolkit.train.stage_scores import (
    ScoringStopped,
    kept_digests,
    pair_sides_key,
    stage_entry_scores,
    stop_for_signal,
)

log = logging.getLogger("toolkit")

METRIC_SUMS = len(METRICS) + 1
"""The step's metric sums (one per METRICS name, then the pair count) that ride in the step's all-reduce."""


def settings_of(stage: ResolvedStage) -> PreferenceSettings:
    """The stage's loss settings: its losses and weights as the recipe's one rule gives them
    (toolkit/config/schema.py `pair_losses`), with `preference`'s beta, label smoothing and gamma (TRL's defaults
    where absent)."""
    names, weights = pair_losses(stage.objective, stage.preference)
    pref = stage.preference
    if pref is None:
        return PreferenceSettings(loss=names, loss_weights=weights)
    return PreferenceSettings(loss=names, loss_weights=weights, beta=pref.beta,
                              label_smoothing=pref.label_smoothing, simpo_gamma=pref.simpo_gamma)


def describe_objective(stage: ResolvedStage) -> str:
    """The stage's objective as the model card names it: `sft`, or e.g. `dpo (sigmoid; beta 0.1; reference: the
    policy at the stage's entry)` (toolkit/config/schema.py `describe_objective`, which the run page reads too)."""
    objective = getattr(stage, "objective", "sft")
    if stage.pairs or getattr(stage, "kto", False):
        return describe(objective, stage.preference)
    return describe(objective, None, getattr(stage, "rl", None), getattr(stage, "rewards", ()))


def takes_reference(stage: ResolvedStage) -> bool:
    """A dpo stage scores its reference, and so does a kto stage (each row and its KL side); orpo and simpo take
    none."""
    return stage.objective in ("dpo", "kto")


def reference_is_base(stage: ResolvedStage) -> bool:
    return stage.preference is not None and stage.preference.reference == "base"


@dataclass
class Reference:
    """Per pair of a stage's rows: the reference's summed (chosen, rejected) log-probs, float64."""

    chosen: np.ndarray
    rejected: np.ndarray

    def of(self, pairs: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        at = np.asarray(pairs, dtype=np.int64)
        return (torch.as_tensor(self.chosen[at], device=device),
                torch.as_tensor(self.rejected[at], device=device))


@dataclass
class PairState:
    """The run's preference stages: each stage's train and eval references (by stage index) and the metric sums of
    the logging interval not yet written (a checkpoint keeps them: `RunState.pending_pairs`)."""

    train: dict[int, Reference] = field(default_factory=dict)
    evals: dict[int, Reference] = field(default_factory=dict)
    pending: list[float] = field(default_factory=lambda: [0.0] * METRIC_SUMS)
    kto_pending: list[float] = field(default_factory=lambda: [0.0] * len(KTO_SUMS))  # a kto stage's (KTO_SUMS)

    def add(self, sums: Sequence[float]) -> None:
        self.pending = [a + b for a, b in zip(self.pending, sums, strict=True)]

    def record(self) -> dict[str, float]:
        """TRL's metric names, means over the interval's pairs; the interval then starts afresh."""
        n = self.pending[-1]
        out = {} if n <= 0 else {name: v / n for name, v in zip(METRICS, self.pending[:-1], strict=True)}
        self.pending = [0.0] * METRIC_SUMS
        return out


def _reference(run: Any, stage: Stage, step: int | None, rows: Any, *, role: str) -> Reference | None:
    """The stage's reference over `rows` (a StageRows of pairs): read back, or scored now when the run stands at
    the stage's first step (`step`; None: past it, read back only). None when a stop signal ended the pass."""
    at = stage.plan.start_step
    base = reference_is_base(stage.resolved)
    folder = Path(run.recipe.output_dir) / "scores"
    elsewhere = None if run.resumed_from is None else RunLayout.of_checkpoint(run.resumed_from).scores
    scorer = "the base model, adapter off" if base else "the policy"
    what = f"stage '{stage.name}' {role} reference log-probs ({scorer} at step {at})"
    stop = stop_for_signal(run, step) if run.preemption.started and step is not None else None
    sides = PairSides(rows.parts)
    # a kto stage's sides are its rows and their KL sides, which its micro-batch size decides (KtoRows.chunk)
    render = f"kto-{stage.resolved.micro_batch_size}" if stage.resolved.kto else "pairs"
    with adapter_disabled(run.model) if base else contextlib.nullcontext():
        sums = stage_entry_scores(run.accelerator, run.model, sides, sides_collator(run.collate),
                                  stage.resolved.eval_micro_batch_size
                                  if role == "eval" else stage.plan.micro_batch, folder=folder,
                                  key=pair_sides_key(run, rows.parts, "current", at, adapter_off=base,
                                                     render=render),
                                  may_score=step == at, what=what, elsewhere=elsewhere, should_stop=stop,
                                  **kept_digests(run))
    if sums is None:
        return None
    chosen, rejected = split_pairs(-sums.loss)
    return Reference(np.ascontiguousarray(chosen), np.ascontiguousarray(rejected))


def enter_pair_stage(run: Any, stage: Stage, step: int) -> None:
    """At a dpo or kto stage's first step (or the first after a resume): its train and eval references (a kto
    stage's eval rows are scored as rows: no eval reference), scored now or read back. Raises `ScoringStopped`
    when a stop signal ends the pass (its blocks kept)."""
    if not (stage.resolved.pairs or stage.resolved.kto) or not takes_reference(stage.resolved):
        return
    pairs: PairState = run.pairs
    if stage.index not in pairs.train:
        ref = _reference(run, stage, step, stage.data.samples, role="train")
        if ref is None:
            raise ScoringStopped(f"stage '{stage.name}' reference log-probs")
        pairs.train[stage.index] = ref
    if stage.eval_rows and stage.resolved.pairs and stage.index not in pairs.evals:
        ref = _reference(run, stage, step, stage.eval_rows, role="eval")
        if ref is None:
            raise ScoringStopped(f"stage '{stage.name}' eval reference log-probs")
        pairs.evals[stage.index] = ref
    kind = "base-model" if reference_is_base(stage.resolved) else "entry-policy"
    log.info("stage '%s': %s reference log-probs of %d pairs%s", stage.name, kind, len(pairs.train[stage.index].chosen),
             f" and {len(pairs.evals[stage.index].chosen)} eval pairs" if stage.index in pairs.evals else "")


def pair_normalisers(batches: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """This rank's (pairs, chosen label tokens) over its micro-batches of the step, counted on the host."""
    pairs = tokens = 0
    for batch in batches:
        n, t = pair_counts(batch)
        pairs, tokens = pairs + n, tokens + t
    return pairs, tokens


def pair_micro_loss(run: Any, stage: Stage, model: Any, batch: dict[str, Any], *, pairs: torch.Tensor,
                    chosen_tokens: torch.Tensor, segments: tuple[torch.Tensor, int], place: Layout | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of pairs: its share of the global batch's preference loss (to backward), and its metric sums
    (METRIC_SUMS float64 values, detached). `pairs` and `chosen_tokens` are the global normalisers divided by the
    number of gradients the strategy averages (`global_normalisers`); `segments` the batch's `segment_ids`, read
    on its host copy (under Ulysses, `place`: this process's slice of the whole rows', `shard_segments`; the
    log-probs are then summed over the group)."""
    device = run.accelerator.device
    batch = dict(batch)
    index = batch.pop("pair_index")
    settings = settings_of(stage.resolved)
    chosen, rejected, c_tokens, r_tokens = policy_logps(model, batch, len(index), device, segments, place)
    if takes_reference(stage.resolved):
        ref_chosen, ref_rejected = run.pairs.train[stage.index].of(index, device)
    else:
        ref_chosen = ref_rejected = torch.zeros_like(chosen)
    logps = PairLogps(chosen, rejected, ref_chosen, ref_rejected, c_tokens, r_tokens)
    terms = preference_terms(settings, logps)
    loss = preference_loss(settings, terms, pairs, chosen_tokens)
    return loss, metric_sums(terms)


@torch.no_grad()
def evaluate_pairs(run: Any, model: Any, stage: Stage) -> dict[str, float] | None:
    """A preference stage's eval pairs under the policy now: `eval_loss` (the stage's preference loss, mean over
    pairs), `pref_accuracy` (the share of pairs whose chosen reward beats the rejected one) and TRL's reward
    metrics as `eval_rewards/...`. None before the stage's reference exists (a dpo stage not yet entered)."""
    if takes_reference(stage.resolved) and stage.index not in run.pairs.evals:
        if stage.index >= run.current_stage:
            return None  # not entered yet: its reference is the policy as it will enter
        ref = _reference(run, stage, None, stage.eval_rows, role="eval")  # an earlier stage's, kept in the run folder
        assert ref is not None
        run.pairs.evals[stage.index] = ref
    acc = run.accelerator
    sums = row_sums(acc, model, PairSides(stage.eval_rows.parts), sides_collator(run.collate),
                    stage.resolved.eval_micro_batch_size)
    chosen, rejected = (torch.as_tensor(x) for x in split_pairs(-torch.as_tensor(sums.loss)))
    c_tokens, r_tokens = (torch.as_tensor(x) for x in split_pairs(torch.as_tensor(sums.tokens)))
    if takes_reference(stage.resolved):
        ref = run.pairs.evals[stage.index]
        ref_chosen, ref_rejected = torch.as_tensor(ref.chosen), torch.as_tensor(ref.rejected)
    else:
        ref_chosen = ref_rejected = torch.zeros_like(chosen)
    settings = settings_of(stage.resolved)
    logps = PairLogps(chosen, rejected, ref_chosen, ref_rejected, c_tokens, r_tokens)
    terms = preference_terms(settings, logps)
    n = len(chosen)
    loss = float(preference_loss(settings, terms, n, float(c_tokens.sum())))
    reward_c, reward_r = terms.chosen_rewards, terms.rejected_rewards
    return {"eval_loss": loss, "pref_accuracy": float((reward_c > reward_r).double().mean()),
            "eval_rewards/margins": float((reward_c - reward_r).mean()), "eval_pairs": n}
