"""Preference losses on pairs of completions (DPO and its variants), from per-sequence summed log-probs.

A pair is a prompt with a chosen and a rejected completion, encoded as two sequences that share the prompt (labels
on the completion only). A micro-batch holds its pairs as sequences in the order chosen 0, rejected 0, chosen 1,
rejected 1, ...: padded rows or the spans of one packed row. Each sequence's summed log-prob comes from the scoring
pass's forward (toolkit/evals/scoring.py `forward_sums`: minus the summed label-token loss of each segment, through
the loss head that never builds full-vocabulary logits), with gradients for the policy and without for the
reference (`reference_logps`: the scoring pass itself, `row_sums`).

The losses, with h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), named as TRL's `DPOConfig.loss_type`:

* ``sigmoid`` (DPO, Rafailov et al. 2023): -log sigmoid(beta h).
* ``hinge`` (SLiC, Zhao et al. 2023): relu(1 - beta h).
* ``ipo`` (Azar et al. 2023, eq. 17): (h' - 1 / (2 beta))^2, where h' divides each log-ratio by its completion's
  token count (TRL's normalisation, confirmed by the IPO authors).
* ``robust`` (rDPO, Chowdhury et al. 2024): ((1 - e) -log sigmoid(beta h) - e -log sigmoid(-beta h)) / (1 - 2 e),
  e = ``label_smoothing`` in [0, 0.5).
* ``orpo`` (Hong et al. 2024, eqs. 4 and 7; no reference): -beta log sigmoid(log odds(c) - log odds(r)), odds
  of the average token log-probs, odds(p) = p / (1 - p); with ``sft`` (weight 1) it is TRL's ORPOTrainer loss.
* ``simpo`` (Meng et al. 2024, eq. 6; no reference): -log sigmoid(beta (avg log pi(c) - avg log pi(r)) -
  ``simpo_gamma``), TRL's CPOTrainer with loss_type simpo (its `cpo_alpha` NLL is ``sft`` here).
* ``sft``: the chosen completions' negative log-likelihood per token (summed over the batch's chosen tokens,
  divided by their count: TRL's `sft` term).

The pair losses are summed over pairs and divided by the number of pairs in the global batch (all ranks, all
micro-steps: `pair_counts` on the host batches, `global_normalisers`' one all-reduce); the `sft` term by the global
batch's chosen-token count, so neither gradient accumulation nor the process count changes the loss. `loss_weights`
weighs each named loss (default 1 each). `pair_metrics` gives TRL's step metrics over the global batch.

The reference of `reference: precompute` is the policy as it enters the stage: one scoring pass over the stage's
pairs at its first step (`reference_logps`; in a run, kept float64 in the run folder and resumed block by block:
toolkit/train/pair_stage.py). `base` runs the same pass with the LoRA adapter off (`adapter_disabled`;
LLaMA-Factory's reference for a LoRA run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from toolkit.data.encoding import IGNORE_INDEX
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import forward_sums, row_sums, segment_ids
from toolkit.model.loss_head import shifted_labels
from toolkit.strategies.sequence_parallel import Layout, group_sum

PAIR_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCE_FREE = ("orpo", "simpo")
"""Losses without a reference: ORPO (TRL's ORPOTrainer) and SimPO (TRL's CPOTrainer, loss_type simpo)."""
LOSSES = (*PAIR_LOSSES, *REFERENCE_FREE, "sft")
DEFAULT_BETA = 0.1
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""The step metrics, named as TRL's trainers log them: means over the global batch's pairs (`logps/*`: the summed
log-probs, as DPOTrainer; for orpo / simpo the per-token averages, as ORPOTrainer and CPOTrainer)."""


@dataclass(frozen=True)
class PreferenceSettings:
    """A preference stage's loss: the named losses, their weights, beta and label smoothing (TRL's names)."""

    loss: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    beta: float = DEFAULT_BETA
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        where = "stages[].preference"
        if not self.loss:
            raise ToolkitError(f"{where}.loss is empty; name one or more of {', '.join(LOSSES)}.")
        for name in self.loss:
            if name not in LOSSES:
                raise ToolkitError(f"{where}.loss names {name!r}; choose from {', '.join(LOSSES)}.")
        if len(set(self.loss)) != len(self.loss):
            raise ToolkitError(f"{where}.loss names a loss twice ({list(self.loss)}); name each once.")
        if not any(name in (*PAIR_LOSSES, *REFERENCE_FREE) for name in self.loss):
            raise ToolkitError(f"{where}.loss is only sft; add a pair loss ({', '.join(PAIR_LOSSES)}) or make the "
                               "stage objective sft.")
        free = [name for name in self.loss if name in REFERENCE_FREE]
        if free and len([name for name in self.loss if name != "sft"]) > 1:
            raise ToolkitError(f"{where}.loss mixes {free[0]}, which takes no reference, with other pair losses "
                               f"({list(self.loss)}); {free[0]} goes alone (with sft at most).")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss):
            raise ToolkitError(f"{where}.loss_weights has {len(self.loss_weights)} weights for {len(self.loss)} "
                               "losses; give one weight per loss.")
        if not self.beta > 0:
            raise ToolkitError(f"{where}.beta is {self.beta}; it must be > 0 (TRL's default: 0.1).")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ToolkitError(f"{where}.label_smoothing is {self.label_smoothing}; it must lie in [0, 0.5).")
        if self.simpo_gamma < 0:
            raise ToolkitError(f"{where}.simpo_gamma is {self.simpo_gamma}; it must be >= 0 (TRL's default: 0.5).")
        if self.label_smoothing and "robust" not in self.loss:
            raise ToolkitError(f"{where}.label_smoothing is {self.label_smoothing} but only the robust loss uses "
                               "it; add robust to preference.loss or remove label_smoothing.")

    @property
    def reference_free(self) -> bool:
        """ORPO and SimPO: no reference log-probs (PairLogps' ref_* are zeros, unused)."""
        return any(name in REFERENCE_FREE for name in self.loss)

    @property
    def weights(self) -> dict[str, float]:
        return dict(zip(self.loss, self.loss_weights or (1.0,) * len(self.loss), strict=True))


@dataclass
class PairLogps:
    """Per pair: the policy's and the reference's summed completion log-probs and the completions' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass
class PreferenceTerms:
    """A micro-batch's summed terms: `pairs_loss` is the weighted pair losses summed over its pairs (divide by the
    global batch's pair count), `sft_nll` the chosen tokens' summed NLL (divide by the global chosen-token count,
    times the sft weight); `rewards` the per-pair chosen / rejected rewards (beta times the log-ratio, detached);
    `logps` the per-pair log-probs the metrics log as TRL's trainer does (detached): DPOTrainer's summed ones,
    ORPOTrainer's and CPOTrainer's (simpo) per-token averages, the log-probs their losses and rewards read."""

    pairs_loss: torch.Tensor
    sft_nll: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def preference_terms(settings: PreferenceSettings, logps: PairLogps) -> PreferenceTerms:
    """The weighted pair losses and the sft NLL of a micro-batch's pairs (module docstring's formulas)."""
    beta, eps = settings.beta, settings.label_smoothing
    chosen_ratio = logps.chosen - logps.ref_chosen
    rejected_ratio = logps.rejected - logps.ref_rejected
    h = chosen_ratio - rejected_ratio
    chosen_mean = logps.chosen / logps.chosen_tokens.clamp(min=1)  # average log-probs: ORPO's and SimPO's
    rejected_mean = logps.rejected / logps.rejected_tokens.clamp(min=1)
    total = torch.zeros((), dtype=h.dtype, device=h.device)
    for name, weight in settings.weights.items():
        if name == "orpo":  # ORPO eq. 4 and 7: log odds(p) = log p - log(1 - p) of the average log-probs
            log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
            per_pair = -beta * F.logsigmoid(log_odds)
        elif name == "simpo":  # SimPO eq. 6: the length-normalised margin less gamma
            per_pair = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - settings.simpo_gamma)
        elif name == "sigmoid":
            per_pair = -F.logsigmoid(beta * h)
        elif name == "hinge":
            per_pair = torch.relu(1 - beta * h)
        elif name == "ipo":
            normalised = (chosen_ratio / logps.chosen_tokens.clamp(min=1)
                          - rejected_ratio / logps.rejected_tokens.clamp(min=1))
            per_pair = (normalised - 1 / (2 * beta)) ** 2
        elif name == "robust":
            per_pair = ((1 - eps) * -F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
        else:  # sft: normalised by tokens, not pairs (below)
            continue
        total = total + weight * per_pair.sum()
    if settings.reference_free:  # TRL's ORPO / CPO log the average log-probs, and beta times them as the rewards
        chosen_mean, rejected_mean = chosen_mean.detach(), rejected_mean.detach()
        return PreferenceTerms(total, -logps.chosen.sum(), beta * chosen_mean, beta * rejected_mean, chosen_mean,
                               rejected_mean)
    return PreferenceTerms(total, -logps.chosen.sum(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach(),
                           logps.chosen.detach(), logps.rejected.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2 (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def preference_loss(settings: PreferenceSettings, terms: PreferenceTerms, pairs: float | torch.Tensor,
                    chosen_tokens: float | torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of the global batch's loss: its pair losses over the global pair count plus the sft
    weight times its chosen NLL over the global chosen-token count (numbers, or `global_normalisers`' device
    tensors). Summed over the global batch's micro-batches (and ranks) this is the batch's mean pair loss plus its
    per-token sft loss."""
    loss = terms.pairs_loss / pairs
    if "sft" in settings.weights:
        tokens = chosen_tokens.clamp(min=1) if torch.is_tensor(chosen_tokens) else max(chosen_tokens, 1)
        loss = loss + settings.weights["sft"] * terms.sft_nll / tokens
    return loss


def split_pairs(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence values of the pair order (chosen 0, rejected 0, chosen 1, ...) as (chosen, rejected)."""
    return sums[0::2], sums[1::2]


def policy_logps(model: torch.nn.Module, batch: dict[str, Any], pairs: int, device: torch.device,
                 segments: tuple[torch.Tensor, int] | None = None, place: Layout | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen log-probs, rejected log-probs, chosen token counts, rejected token counts) of a micro-batch of
    `pairs` pairs collated in pair order, with gradients: the scoring pass's forward (`forward_sums`; `segments`:
    its segment ids from the host batch). Under Ulysses (`place`) the batch is this process's slice, `segments` its
    slice of the whole rows' (`shard_segments`), and the slices' sums are added over the group (`group_sum`)."""
    loss, tokens = forward_sums(model, batch, device, segments)
    if place is not None and place.sequence_parallel:
        loss, tokens = group_sum(loss, place), group_sum(tokens, place)
    if len(loss) < 2 * pairs:
        raise ValueError(f"a micro-batch of {pairs} pairs collated into {len(loss)} sequences; expected {2 * pairs}")
    chosen, rejected = split_pairs(-loss[:2 * pairs])
    chosen_tokens, rejected_tokens = split_pairs(tokens[:2 * pairs])
    return chosen, rejected, chosen_tokens, rejected_tokens


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The PEFT model with its adapter switched off (the `base` reference), under any DDP / DeepSpeed wrapper."""
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
        inner = inner.module
    disable = getattr(inner, "disable_adapter", None)
    if disable is None:
        raise ToolkitError("preference.reference is base but the model has no LoRA adapter to switch off (full "
                           "fine-tuning); use reference: precompute.")
    with disable():
        yield


def reference_logps(accelerator: Accelerator, model: torch.nn.Module, sequences: Sequence[dict[str, Any]],
                    collate: Callable[[list[dict[str, Any]]], dict[str, Any]], micro_batch_size: int, *,
                    base: bool = False, on_block: Callable[[np.ndarray, Any], None] | None = None,
                    block_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every pair's reference (chosen, rejected) summed log-probs, float64, the same on every process: the scoring
    pass over `sequences` (in pair order) under the model as it is now (`base`: with its adapter off)."""
    if len(sequences) % 2:
        raise ValueError(f"{len(sequences)} sequences are not whole pairs")
    with adapter_disabled(model) if base else contextlib.nullcontext():
        sums = row_sums(accelerator, model, sequences, collate, micro_batch_size, on_block=on_block,
                        block_rows=block_rows)
    logps = -sums.loss
    return logps[0::2], logps[1::2]


def pair_counts(batch: dict[str, Any]) -> tuple[int, int]:
    """(pairs, chosen label tokens) of a host micro-batch collated in pair order, padded or packed: what the global
    batch's normalisers add up, counted without touching the device."""
    seg, count = segment_ids(batch)
    owners = shifted_labels(seg, -1)[shifted_labels(batch["labels"], IGNORE_INDEX) != IGNORE_INDEX]
    per_sequence = torch.bincount(owners[owners >= 0], minlength=count)
    return count // 2, int(per_sequence[0:count - count % 2:2].sum())


def global_normalisers(accelerator: Accelerator, pairs: int, chosen_tokens: int, divisor: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch's pair count and chosen-token count (this rank's micro-batches' `pair_counts` summed,
    all-reduced) divided by `divisor`, the number of gradients the strategy averages (processes x accumulation
    steps), as 0-d float64 tensors on the device: never read back on the host, so the step waits for no queue here
    (the guard's all-reduce is its one host read). Every micro-batch's `preference_loss` divides by them, so the
    averaged gradients are those of the global batch's loss: neither the process count nor gradient accumulation
    changes it. Collective."""
    local = torch.tensor([float(pairs), float(chosen_tokens)], dtype=torch.float64).to(accelerator.device,
                                                                                       non_blocking=True)
    total = accelerator.reduce(local, reduction="sum") if accelerator.num_processes > 1 else local
    scaled = total / divisor
    return scaled[0], scaled[1]


def metric_sums(terms: PreferenceTerms) -> torch.Tensor:
    """A micro-batch's METRICS sums over its pairs, then the pair count (float64, detached): summed over the
    global batch's micro-batches and ranks, then divided by the count, they are TRL's means."""
    chosen, rejected = terms.chosen_rewards.double(), terms.rejected_rewards.double()
    return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).double().sum(), (chosen - rejected).sum(),
                        terms.chosen_logps.double().sum(), terms.rejected_logps.double().sum(),
                        torch.tensor(float(len(chosen)), dtype=torch.float64, device=chosen.device)])


def pair_metrics(accelerator: Accelerator, parts: Sequence[tuple[PreferenceTerms, PairLogps]]) -> dict[str, float]:
    """METRICS over every pair of the global batch (this rank's micro-batches `parts`, one all-reduce)."""
    sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=accelerator.device)
    for terms, _ in parts:
        sums += metric_sums(terms).to(sums.device)
    if accelerator.num_processes > 1:
        sums = accelerator.reduce(sums, reduction="sum")
    values = sums.tolist()
    n = max(values[-1], 1.0)
    return {name: v / n for name, v in zip(METRICS, values[:-1], strict=True)}
