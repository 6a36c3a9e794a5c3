"""One interface for what a stage trains on: its objective (`stages[].objective`).

`run_step` (toolkit/train/loop.py) runs any objective the same way; what differs between sft on rows and a pair
loss on preference pairs lives here, behind one small protocol:

* `Objective.enter`: what the objective needs at the stage's first step (a dpo stage's reference pass).
* `Objective.micro_batches`: this rank's micro-batches of the step: the stage's rows from its DataLoader (sft,
  pairs), or the completions a grpo stage draws for its prompts (toolkit/train/rl_stage.py).
* `Objective.begin`: the step's global normalisers (over every rank and micro-step, so neither the process count
  nor gradient accumulation changes the loss), taken once before the first forward, as a `StepLoss`.
* `StepLoss.micro`: a micro-batch's share of the global batch's loss, to backward; it adds the micro-batch's
  metric sums (detached) to `StepLoss.sums`, which ride in the step's one all-reduce.
* `Objective.add_sums` / `Objective.record`: the reduced sums kept for the logging interval, then TRL's metric
  names in the step record.
* `Objective.evaluate`: its eval rows under the policy now (None: the evaluator's own eval loss serves).

Rows become batches on the data side: `stage.resolved.pairs` picks the pair collator (toolkit/data/batching.py),
which the pair objective's `micro` reads (`pair_index`, two sides per pair).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from toolkit.curriculum.stages import Stage
from toolkit.data.batching import MicroBatch
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.evals.scoring import segment_ids
from toolkit.strategies import sequence_parallel
from toolkit.train.pair_stage import METRIC_SUMS, enter_pair_stage, evaluate_pairs, pair_micro_loss, pair_normalisers
from toolkit.train.preference import global_normalisers
from toolkit.train.rl_stage import GrpoObjective


class StepLoss(Protocol):
    """One optimizer step of an objective: its normalisers taken, its micro-batches' losses one by one."""

    dtype: torch.dtype  # the step's loss sum (float64 where the objective's terms are)
    sums: torch.Tensor | None  # metric sums of the step's micro-batches so far (None: the objective has none)

    def micro(self, model: Any, j: int, batch: dict[str, Any]) -> torch.Tensor:
        """Micro-batch j's share of the global batch's loss, to backward; adds its metric sums to `sums`."""
        ...


class Objective(Protocol):
    """What `run_step`, `enter_stage`, `after_step` and the evaluator ask of a stage's objective."""

    name: str

    def enter(self, run: Any, stage: Stage, step: int) -> None:
        """At the stage's first step (or the first after a resume); may raise `ScoringStopped`. Collective."""
        ...

    def micro_batches(self, run: Any, stage: Stage, step_in_stage: int, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of the step (host tensors; the loop copies them to the device)."""
        ...

    def begin(self, run: Any, stage: Stage, batches: Sequence[dict[str, Any]], divisor: int, *,
              whole: Sequence[dict[str, Any]]) -> StepLoss:
        """The step's global normalisers over this rank's host `batches`, divided by `divisor` (the gradients the
        strategy averages: processes x accumulation steps). `whole`: the same micro-batches before a Ulysses group
        sliced them (they are `batches` without sequence parallelism). Collective: one all-reduce."""
        ...

    def add_sums(self, run: Any, summed: Sequence[float]) -> None:
        """The global batch's metric sums (reduced over ranks), kept for the logging interval."""
        ...

    def record(self, run: Any) -> dict[str, float]:
        """The interval's metrics by TRL's names (then the interval starts afresh)."""
        ...

    def evaluate(self, run: Any, model: Any, stage: Stage) -> dict[str, Any] | None:
        """The stage's eval rows under the policy now, or None."""
        ...


class _TokenLoss:
    """sft: the model's token-mean cross-entropy (the loss head), normalised by the global batch's label tokens."""

    dtype = torch.float32
    sums = None

    def __init__(self, items_per_micro: torch.Tensor) -> None:
        self.items_per_micro = items_per_micro

    def micro(self, model: Any, j: int, batch: dict[str, Any]) -> torch.Tensor:
        return model(**batch, num_items_in_batch=self.items_per_micro).loss


class _StageRows:
    """Micro-batches of the stage's rows, from its DataLoader (toolkit/data/batching.py: rank r's micro-step j is
    slot j * world + r of the step's global batch, `rank_micro_batches`)."""

    def micro_batches(self, run: Any, stage: Stage, step_in_stage: int, step: int) -> list[MicroBatch]:
        return run.batches.take(stage, step_in_stage)


class SftObjective(_StageRows):
    """Next-token cross-entropy on the label tokens of rows (sft, and continued pre-training)."""

    name = "sft"

    def enter(self, run: Any, stage: Stage, step: int) -> None:
        return None

    def begin(self, run: Any, stage: Stage, batches: Sequence[dict[str, Any]], divisor: int, *,
              whole: Sequence[dict[str, Any]]) -> StepLoss:
        # Normalise by the label tokens of the whole global batch (all ranks, all micro-steps): the gradient is then
        # independent of how the batch is split. Strategies average gradients over ranks and accumulation steps,
        # hence the divisor in num_items_in_batch. Counted on the host batches (the loop moves each to the device
        # itself), so the copy never blocks; the all-reduce's result stays on the device (no host sync).
        acc = run.accelerator
        local = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches).to(acc.device, non_blocking=True)
        return _TokenLoss(acc.reduce(local, reduction="sum") / divisor)

    def add_sums(self, run: Any, summed: Sequence[float]) -> None:
        return None

    def record(self, run: Any) -> dict[str, float]:
        return {}

    def evaluate(self, run: Any, model: Any, stage: Stage) -> dict[str, Any] | None:
        return None


class _PairLoss:
    """A preference stage's step: its pair and chosen-token normalisers, its micro-batches' pair losses."""

    dtype = torch.float64

    def __init__(self, run: Any, stage: Stage, whole: Sequence[dict[str, Any]], divisor: int) -> None:
        self.run, self.stage = run, stage
        self.place = sequence_parallel.layout(run.accelerator)
        # Counted over whole rows: under Ulysses every process of a group counts its whole rows, so the counts hold
        # each pair sp_size times, and the group's summed gradient of its one loss (`group_sum`) holds it sp_size
        # times too.
        self.pairs, self.chosen_tokens = global_normalisers(run.accelerator, *pair_normalisers(whole), divisor)
        self.segments = [segment_ids(b) for b in whole]  # on the host: the device copy's boundaries are not read back
        if self.place.sequence_parallel:  # this process's slice of each whole row's segments
            self.segments = [(sequence_parallel.shard_segments(seg, self.place), n) for seg, n in self.segments]
        self.sums = torch.zeros(METRIC_SUMS, dtype=torch.float64, device=run.accelerator.device)

    def micro(self, model: Any, j: int, batch: dict[str, Any]) -> torch.Tensor:
        loss, sums = pair_micro_loss(self.run, self.stage, model, batch, pairs=self.pairs,
                                     chosen_tokens=self.chosen_tokens, segments=self.segments[j], place=self.place)
        self.sums += sums
        return loss


class PairObjective(_StageRows):
    """dpo | orpo | simpo on preference pairs (toolkit/train/pair_stage.py, toolkit/train/preference.py)."""

    name = "pair"

    def enter(self, run: Any, stage: Stage, step: int) -> None:
        enter_pair_stage(run, stage, step)  # a dpo stage's reference log-probs: the policy as it enters the stage

    def begin(self, run: Any, stage: Stage, batches: Sequence[dict[str, Any]], divisor: int, *,
              whole: Sequence[dict[str, Any]]) -> StepLoss:
        return _PairLoss(run, stage, whole, divisor)

    def add_sums(self, run: Any, summed: Sequence[float]) -> None:
        run.pairs.add(summed)

    def record(self, run: Any) -> dict[str, float]:
        return run.pairs.record()

    def evaluate(self, run: Any, model: Any, stage: Stage) -> dict[str, Any] | None:
        return evaluate_pairs(run, model, stage)


SFT, PAIR, GRPO = SftObjective(), PairObjective(), GrpoObjective()
OBJECTIVES: tuple[Objective, ...] = (SFT, PAIR, GRPO)
"""Every objective, once: `after_step` asks each for its interval's metrics (a stage's last sums may be logged in
the next stage's record)."""


def objective_of(stage: Stage) -> Objective:
    """The stage's objective (`stages[].objective`)."""
    return PAIR if stage.resolved.pairs else GRPO if stage.resolved.prompts else SFT
