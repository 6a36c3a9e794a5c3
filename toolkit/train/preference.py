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
* ``sft``: the chosen completions' negative log-likelihood per token (summed over the batch's chosen tokens,
  divided by their count: TRL's `sft` term).

The pair losses are summed over pairs and divided by the number of pairs in the global batch (all ranks, all
micro-steps); the `sft` term by the global batch's chosen-token count, so neither gradient accumulation nor the
process count changes the loss. `loss_weights` weighs each named loss (default 1 each).
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

from toolkit.errors import ToolkitError
from toolkit.evals.scoring import forward_sums, row_sums

PAIR_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
LOSSES = (*PAIR_LOSSES, "sft")
DEFAULT_BETA = 0.1


@dataclass(frozen=True)
class PreferenceSettings:
    """A preference stage's loss: the named losses, their weights, beta and label smoothing (TRL's names)."""

    loss: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    beta: float = DEFAULT_BETA
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        where = "stages[].preference"
        if not self.loss:
            raise ToolkitError(f"{where}.loss is empty; name one or more of {', '.join(LOSSES)}.")
        for name in self.loss:
            if name not in LOSSES:
                raise ToolkitError(f"{where}.loss names {name!r}; choose from {', '.join(LOSSES)}.")
        if len(set(self.loss)) != len(self.loss):
            raise ToolkitError(f"{where}.loss names a loss twice ({list(self.loss)}); name each once.")
        if not any(name in PAIR_LOSSES for name in self.loss):
            raise ToolkitError(f"{where}.loss is only sft; add a pair loss ({', '.join(PAIR_LOSSES)}) or make the "
                               "stage objective sft.")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss):
            raise ToolkitError(f"{where}.loss_weights has {len(self.loss_weights)} weights for {len(self.loss)} "
                               "losses; give one weight per loss.")
        if not self.beta > 0:
            raise ToolkitError(f"{where}.beta is {self.beta}; it must be > 0 (TRL's default: 0.1).")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ToolkitError(f"{where}.label_smoothing is {self.label_smoothing}; it must lie in [0, 0.5).")
        if self.label_smoothing and "robust" not in self.loss:
            raise ToolkitError(f"{where}.label_smoothing is {self.label_smoothing} but only the robust loss uses "
                               "it; add robust to preference.loss or remove label_smoothing.")

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
    times the sft weight); `rewards` the per-pair chosen / rejected rewards (beta times the log-ratio, detached)."""

    pairs_loss: torch.Tensor
    sft_nll: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_terms(settings: PreferenceSettings, logps: PairLogps) -> PreferenceTerms:
    """The weighted pair losses and the sft NLL of a micro-batch's pairs (module docstring's formulas)."""
    beta, eps = settings.beta, settings.label_smoothing
    chosen_ratio = logps.chosen - logps.ref_chosen
    rejected_ratio = logps.rejected - logps.ref_rejected
    h = chosen_ratio - rejected_ratio
    total = torch.zeros((), dtype=h.dtype, device=h.device)
    for name, weight in settings.weights.items():
        if name == "sigmoid":
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
    return PreferenceTerms(total, -logps.chosen.sum(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def preference_loss(settings: PreferenceSettings, terms: PreferenceTerms, pairs: float, chosen_tokens: float
                    ) -> torch.Tensor:
    """A micro-batch's share of the global batch's loss: its pair losses over the global pair count plus the sft
    weight times its chosen NLL over the global chosen-token count. Summed over the global batch's micro-batches
    (and ranks) this is the batch's mean pair loss plus its per-token sft loss."""
    loss = terms.pairs_loss / pairs
    if "sft" in settings.weights:
        loss = loss + settings.weights["sft"] * terms.sft_nll / max(chosen_tokens, 1)
    return loss


def split_pairs(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence values of the pair order (chosen 0, rejected 0, chosen 1, ...) as (chosen, rejected)."""
    return sums[0::2], sums[1::2]


def policy_logps(model: torch.nn.Module, batch: dict[str, Any], pairs: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen log-probs, rejected log-probs, chosen token counts, rejected token counts) of a micro-batch of
    `pairs` pairs collated in pair order, with gradients: the scoring pass's forward (`forward_sums`)."""
    loss, tokens = forward_sums(model, batch, device)
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
