"""KTO (Ethayarajh et al. 2024) on unpaired feedback: rows of TRL's `{prompt, completion, label}`, each completion
marked desirable (true) or undesirable (false), with the loss of TRL's `KTOTrainer` (`loss_type: kto`).

Per row, with r = log pi(y|x) - log ref(y|x) (summed completion log-probs) and z the KL baseline:

* desirable:   desirable_weight   * (1 - sigmoid(beta (r - z)))
* undesirable: undesirable_weight * (1 - sigmoid(beta (z - r)))

The baseline z estimates KL(pi || ref) from mismatched prompt/completion pairs: each row's prompt with another
row's completion (toolkit/data/plan.py `KtoRows`, TRL's rotation of the completions within a batch), z = the mean
over the batch of log pi(y'|x) - log ref(y'|x), clamped at 0 and detached (TRL computes the policy's side under
no_grad). TRL takes that mean per micro-batch on each rank and averages the ranks' means (`gather_for_metrics`);
here it is the mean over the whole global batch (every rank, every micro-step: one all-reduce before the step's
first forward, `kl_baseline`), which is TRL's when micro-batches are of equal size and there is no gradient
accumulation, and which neither the process count nor accumulation changes. The loss is summed over rows and
divided by the global batch's row count (TRL: the mean over its micro-batch's rows, averaged over ranks).

Metrics, as TRL names them: `kl`, `rewards/chosen` and `logps/chosen` (means over the desirable rows; rewards are
beta r), `rewards/rejected` and `logps/rejected` (undesirable rows), `rewards/margins` (their difference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from toolkit.errors import ToolkitError

KTO_SUMS = ("chosen_rewards", "chosen_logps", "chosen", "rejected_rewards", "rejected_logps", "rejected", "kl",
            "kl_rows")
"""A step's metric sums, in this order: summed over micro-batches and ranks, then read by `kto_metrics`."""


@dataclass(frozen=True)
class KtoSettings:
    """A kto stage's loss: beta and the two weights, TRL's KTOConfig names and defaults."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ToolkitError(f"stages[].preference.beta is {self.beta}; it must be > 0 (TRL's default: 0.1).")
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ToolkitError("stages[].preference.desirable_weight and undesirable_weight must be >= 0 (TRL's "
                               "default: 1.0 each).")


def kl_baseline(accelerator: Accelerator, kl_sum: torch.Tensor, rows: torch.Tensor, divisor: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, the global batch's row count / `divisor`) from this rank's summed KL-side log-ratios `kl_sum` (detached)
    and its row count: one all-reduce of both, z = their global mean clamped at 0. Collective."""
    local = torch.stack([rows.double(), kl_sum.detach().double()]).to(accelerator.device)
    total = accelerator.reduce(local, reduction="sum") if accelerator.num_processes > 1 else local
    z = (total[1] / total[0].clamp(min=1)).clamp(min=0)
    return z, total[0] / divisor


def kto_losses(settings: KtoSettings, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor) -> torch.Tensor:
    """Each row's weighted KTO loss (module docstring), from its summed completion log-probs under the policy
    (with gradients) and the reference, its label and the baseline `kl` (detached)."""
    ratio = logps - ref_logps
    beta, kl = settings.beta, kl.detach()
    chosen = settings.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    rejected = settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable, chosen, rejected)


def kto_sums(settings: KtoSettings, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
             kl_ratio: torch.Tensor) -> torch.Tensor:
    """A micro-batch's KTO_SUMS (float64, detached): rewards and log-probs summed over its desirable and its
    undesirable rows, their counts, and its KL sides' summed log-ratios and count."""
    logps, ratio = logps.detach().double(), (logps.detach() - ref_logps).double()
    d = desirable.double()
    rewards = settings.beta * ratio
    return torch.stack([(rewards * d).sum(), (logps * d).sum(), d.sum(), (rewards * (1 - d)).sum(),
                        (logps * (1 - d)).sum(), (1 - d).sum(), kl_ratio.detach().double().sum(),
                        torch.tensor(float(len(d)), dtype=torch.float64, device=d.device)])


def kto_metrics(sums: Sequence[float]) -> dict[str, float]:
    """TRL's KTO metric names from summed KTO_SUMS (nothing for a side without rows; `kl` clamped at 0)."""
    s = dict(zip(KTO_SUMS, sums, strict=True))
    out: dict[str, float] = {}
    if s["kl_rows"] > 0:
        out["kl"] = max(s["kl"] / s["kl_rows"], 0.0)
    for side in ("chosen", "rejected"):
        if s[side] > 0:
            out[f"rewards/{side}"] = s[f"{side}_rewards"] / s[side]
            out[f"logps/{side}"] = s[f"{side}_logps"] / s[side]
    if s["chosen"] > 0 and s["rejected"] > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
