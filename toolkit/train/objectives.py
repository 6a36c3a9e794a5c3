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

Rows become batches on the data side: `stage.resolved.pairs` (and `kto`) picks the pair collator
(toolkit/data/batching.py), which the pair objective's `micro` reads (`pair_index`, two sides per pair; a kto
stage's rows are each a row and its KL side, with `desirable`).
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
from toolkit.train.kto import KTO_SUMS, KtoSettings, kl_baseline, kto_losses, kto_metrics, kto_sums
from toolkit.train.pair_stage import METRIC_SUMS, enter_pair_stage, evaluate_pairs, pair_micro_loss, pair_normalisers
from toolkit.train.preference import global_normalisers, policy_logps
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


def kto_settings(stage: Stage) -> KtoSettings:
    """A kto stage's beta and weights (`stages[].preference`; TRL's defaults where absent)."""
    pref = stage.resolved.preference
    if pref is None:
        return KtoSettings()
    return KtoSettings(beta=pref.beta, desirable_weight=pref.desirable_weight,
                       undesirable_weight=pref.undesirable_weight)


def _on_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


class _KtoLoss:
    """A kto stage's step (toolkit/train/kto.py): the KL baseline and row count of the global batch, taken before
    the first forward, then each micro-batch's rows' losses. A micro-batch holds each row and its KL side in pair
    order (toolkit/data/plan.py KtoRows), `pair_index` (their references) and `desirable` (their labels)."""

    dtype = torch.float64

    def __init__(self, run: Any, stage: Stage, whole: Sequence[dict[str, Any]], divisor: int) -> None:
        self.run, self.stage, self.settings = run, stage, kto_settings(stage)
        device = run.accelerator.device
        self.reference = run.pairs.train[stage.index]
        self.segments = [segment_ids(b) for b in whole]  # on the host, as the pair step reads them
        # The KL sides' log-ratios under the policy as it is now, without gradients (TRL's `_compute_kl_logps`
        # runs under no_grad): every micro-batch's, so the baseline is the global batch's before any loss.
        self.kl_ratios: list[torch.Tensor] = []
        kl_sum = torch.zeros((), dtype=torch.float64, device=device)
        rows = 0
        with torch.no_grad():
            for b, segments in zip(whole, self.segments, strict=True):
                batch = {k: v for k, v in b.items() if k not in ("pair_index", "desirable")}
                index = b["pair_index"]
                _, kl_side, _, _ = policy_logps(run.model, _on_device(batch, device), len(index), device, segments)
                ratio = kl_side.double() - self.reference.of(index, device)[1]
                self.kl_ratios.append(ratio)
                kl_sum, rows = kl_sum + ratio.sum(), rows + len(index)
        self.kl, self.rows = kl_baseline(run.accelerator, kl_sum, torch.tensor(float(rows)), divisor)
        self.sums = torch.zeros(len(KTO_SUMS), dtype=torch.float64, device=device)

    def micro(self, model: Any, j: int, batch: dict[str, Any]) -> torch.Tensor:
        device = self.run.accelerator.device
        batch = dict(batch)
        index = batch.pop("pair_index")
        desirable = torch.tensor(batch.pop("desirable"), dtype=torch.bool, device=device)
        logps, _, _, _ = policy_logps(model, batch, len(index), device, self.segments[j])
        ref = self.reference.of(index, device)[0]
        self.sums += kto_sums(self.settings, logps, ref, desirable, self.kl_ratios[j])
        return kto_losses(self.settings, logps, ref, desirable, self.kl).sum() / self.rows


class KtoObjective(_StageRows):
    """kto on unpaired rows marked desirable or not (toolkit/train/kto.py); its reference is taken as a dpo
    stage's is (toolkit/train/pair_stage.py), over each row and its KL side."""

    name = "kto"

    def enter(self, run: Any, stage: Stage, step: int) -> None:
        enter_pair_stage(run, stage, step)

    def begin(self, run: Any, stage: Stage, batches: Sequence[dict[str, Any]], divisor: int, *,
              whole: Sequence[dict[str, Any]]) -> StepLoss:
        return _KtoLoss(run, stage, whole, divisor)

    def add_sums(self, run: Any, summed: Sequence[float]) -> None:
        run.pairs.kto_pending = [a + b for a, b in zip(run.pairs.kto_pending, summed, strict=True)]

    def record(self, run: Any) -> dict[str, float]:
        out = kto_metrics(run.pairs.kto_pending)
        run.pairs.kto_pending = [0.0] * len(KTO_SUMS)
        return out

    def evaluate(self, run: Any, model: Any, stage: Stage) -> dict[str, Any] | None:
        return None  # its eval files are scored as rows (the evaluator's eval_loss)


SFT, PAIR, KTO, GRPO = SftObjective(), PairObjective(), KtoObjective(), GrpoObjective()
OBJECTIVES: tuple[Objective, ...] = (SFT, PAIR, KTO, GRPO)
"""Every objective, once: `after_step` asks each for its interval's metrics (a stage's last sums may be logged in
the next stage's record)."""


def objective_of(stage: Stage) -> Objective:
    """The stage's objective (`stages[].objective`)."""
    return PAIR if stage.resolved.pairs else KTO if stage.resolved.kto else GRPO if stage.resolved.prompts else SFT
