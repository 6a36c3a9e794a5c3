"""GRPO and its fixes (DAPO, Dr. GRPO) as TRL 1.16's GRPOTrainer computes them, on plain tensors.

The pieces of one RL step, each a pure function the loop calls (docs/rl.md says what each setting does):

* ``group_advantages``: rewards (one column per reward, NaN where a reward returned None) weighted and summed, less
  the mean of the prompt's group, divided by the group's or the batch's standard deviation (``scale_rewards``:
  group / batch / none); a completion no reward could score gets advantage 0, as in TRL.
* ``truncated`` and ``mask_truncated``: completions that hit ``max_completion_length`` without an end token, and
  ``mask_truncated_completions`` taking them out of the loss.
* ``policy_batch``: prompt (left-padded) + completion (right-padded) as the forward's ``input_ids``,
  ``attention_mask`` and ``labels`` (the completion tokens): what the chunked loss head scores. Its ``per_token``
  mode (toolkit/model/loss_head.py) gives each label token's log-probability at the sampling temperature in label
  order; ``tokens_to_grid`` puts them back on the ``[B, C]`` completion grid; ``completion_logps`` does both for a
  model. No full-vocabulary logits.
* ``token_terms`` and ``grpo_loss``: the clipped surrogate ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)`` per token,
  plus ``beta`` times the k3 estimate of KL to the reference (TRL's), reduced as ``loss_type`` says and divided by a
  normaliser handed in (``normaliser``), so that the loop can count it over the whole global batch: every rank's
  micro-batches' losses then sum to the global batch's loss, whatever the split.
* ``metric_sums``: TRL's ``kl``, ``entropy`` and ``clip_ratio/*`` as sums and counts, to be summed over ranks and
  micro-steps before dividing.

With ``num_iterations: 1`` the old log-probs are the current ones detached (the ratio is 1 and the gradient is the
advantage-weighted token NLL); with more, the rollout's per-token log-probs are kept and passed as ``old``.

Why not call TRL: its loss is a method of a Trainer that owns the model, data and loop; the functions here take the
tensors our loop has. tests/train/test_grpo.py checks them against TRL's own ``_compute_loss`` and advantages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from toolkit.errors import ToolkitError
from toolkit.model.loss_head import loss_head_of, shifted_labels

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class GrpoSettings:
    """The loss's settings, named and defaulted as TRL 1.16's GRPOConfig (docs/rl.md says why each default)."""

    loss_type: str = "dapo"
    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (symmetric clipping); DAPO's clip-higher sets it above
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    num_iterations: int = 1
    use_bias_correction_kl: bool = True  # the KL term times the ratio: the unbiased reverse-KL gradient (TRL 1.16)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ToolkitError(f"rl.loss_type is '{self.loss_type}'; choose one of {', '.join(LOSS_TYPES)}.")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ToolkitError(f"rl.scale_rewards is '{self.scale_rewards}'; choose one of "
                               f"{', '.join(SCALE_REWARDS)}.")
        if self.num_generations < 2:
            raise ToolkitError(f"rl.num_generations is {self.num_generations}; a group needs at least 2 completions "
                               "of a prompt to compare (TRL's default is 8).")
        for key in ("max_completion_length", "num_iterations"):
            if getattr(self, key) < 1:
                raise ToolkitError(f"rl.{key} is {getattr(self, key)}; it must be at least 1.")
        if not self.temperature > 0:
            raise ToolkitError(f"rl.temperature is {self.temperature}; RL samples its completions: give a "
                               "temperature above 0 (TRL's default is 1.0).")
        if not 0 < self.top_p <= 1:
            raise ToolkitError(f"rl.top_p is {self.top_p}; it must be in (0, 1].")
        if self.beta < 0 or self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ToolkitError("rl.beta, rl.epsilon and rl.epsilon_high must not be negative.")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# ------------------------------------------------------------------------------------------------- rewards


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (NaN below two values): TRL's ``nanstd``."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim) if dim is not None \
        else torch.nanmean((x - mean) ** 2)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim) if dim is not None else (~torch.isnan(x)).sum()
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    return torch.sqrt(variance * correction)


def combined_rewards(per_reward: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """``[N]`` weighted sums of ``per_reward`` (``[N, R]``, NaN where a reward returned None: it adds nothing);
    NaN where every reward returned None (the completion cannot be scored)."""
    if per_reward.dim() != 2 or per_reward.shape[1] != len(weights):
        raise ValueError(f"rewards of shape {tuple(per_reward.shape)} for {len(weights)} weights")
    w = torch.as_tensor(list(weights), dtype=per_reward.dtype, device=per_reward.device)
    rewards = (per_reward * w.unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(per_reward).all(dim=1), float("nan"))


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, whether the std they were scaled by is zero) of the global batch's ``rewards`` (``[N]``, the
    prompts' groups of ``num_generations`` consecutive completions, NaN for unscorable ones), as TRL's default
    ``sum_then_normalize``: reward less its group's mean, divided by the group's (``group``) or the batch's
    (``batch``) standard deviation + 1e-4, or not divided (``none``, Dr. GRPO). NaN advantages become 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # group (and none, where the std only tells which groups are all equal)
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


# --------------------------------------------------------------------------------------------- the batch


def truncated(completion_ids: Sequence[Sequence[int]], stop_ids: Sequence[int]) -> list[bool]:
    """Whether each completion was cut at the length limit: its last token is not an end-of-sequence or pad token
    (``stop_ids``), as TRL decides it."""
    stops = set(stop_ids)
    return [not ids or ids[-1] not in stops for ids in completion_ids]


def mask_truncated(completion_mask: torch.Tensor, is_truncated: torch.Tensor) -> torch.Tensor:
    """``mask_truncated_completions``: a truncated completion's tokens leave the loss (and the attention, as in
    TRL); its row still counts as a sequence for ``grpo`` and ``dr_grpo``."""
    return completion_mask * (~is_truncated.to(torch.bool)).unsqueeze(1).to(completion_mask.dtype)


def policy_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                 completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward's inputs: prompt (left-padded) then completion (right-padded), labels on the completion tokens
    the mask keeps, so that the loss head scores exactly them. (No position ids, as TRL: Qwen's rotary attention
    depends only on relative positions, so the left padding does not move the scores.)"""
    labels = torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX),
                        completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)], dim=1)
    return {"input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
            "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1), "labels": labels}


def tokens_to_grid(flat: torch.Tensor | None, completion_mask: torch.Tensor) -> torch.Tensor:
    """The loss head's per-token values (label order: row-major over the kept positions) on the ``[B, C]``
    completion grid, 0 where the mask is 0; differentiable in ``flat``."""
    mask = completion_mask.to(torch.bool)
    if flat is None:
        flat = torch.zeros(0, device=completion_mask.device)
    if flat.numel() != int(mask.sum()):
        raise ValueError(f"{flat.numel()} token values for {int(mask.sum())} completion tokens")
    return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask.to(flat.device), flat)


def completion_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], completion_mask: torch.Tensor,
                     temperature: float, *, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token log-probs ``[B, C]`` at ``temperature``, entropies or None) of the completion tokens of
    ``policy_batch``'s ``batch`` (``completion_mask`` the one it was built with) under ``model`` (any wrapper),
    differentiable under autograd: by the chunked loss head's per-token mode (no full-vocabulary logits; the
    backward passes through the model's own output, as ZeRO-3 needs), or from full logits when the model has no
    loss head (``model.loss_head: standard``, the user's choice)."""
    labels = batch["labels"]
    head = loss_head_of(model)
    if head is None:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float() / temperature
        target = shifted_labels(labels)
        keep = target != IGNORE_INDEX
        full = torch.log_softmax(logits[keep], dim=-1)
        flat = full.gather(-1, target[keep].unsqueeze(-1)).squeeze(-1)
        ent = tokens_to_grid(-(full.exp() * full).sum(-1).detach(), completion_mask) if entropy else None
        return tokens_to_grid(flat, completion_mask), ent
    with head.per_token(temperature, entropy=entropy) as kept:
        out = model(**batch, num_items_in_batch=torch.ones((), device=labels.device))
    logps = tokens_to_grid(kept.logps, completion_mask)
    if torch.is_grad_enabled() and out.loss is not None and out.loss.requires_grad:
        logps = logps + 0.0 * out.loss  # the backward opens at the model's output (ZeRO-3's module hooks)
    return logps, (tokens_to_grid(kept.entropies, completion_mask) if entropy else None)


# ----------------------------------------------------------------------------------------------- the loss


@dataclass
class TokenTerms:
    """The per-token pieces of the loss: the loss itself, the importance ratio and the KL estimate (None at
    beta 0)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None


def token_terms(logps: torch.Tensor, advantages: torch.Tensor, *, old_logps: torch.Tensor | None = None,
                ref_logps: torch.Tensor | None = None, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                beta: float = 0.0, bias_correction_kl: bool = True) -> TokenTerms:
    """Per-token clipped surrogate ``-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)`` with
    ``r = exp(logps - old_logps)`` (``old_logps`` None: ``logps`` detached, r = 1), plus ``beta`` times the k3 KL
    estimate ``exp(ref - logps) - (ref - logps) - 1``, times the ratio with ``bias_correction_kl`` (TRL 1.16's
    ``use_bias_correction_kl``, on by default: the ratio's gradient makes the KL gradient the unbiased reverse-KL
    one, DeepSeek-V3.2, even where its value is 1). ``advantages``: ``[B]`` (or ``[B, C]``)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's per-token log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_correction_kl:
            kl = kl * ratio
        loss = loss + beta * kl
    return TokenTerms(loss, ratio, kl)


def normaliser(loss_type: str, *, tokens: float, sequences: float, max_completion_length: int) -> float:
    """What ``grpo_loss`` divides by, from the counts of the batch the loss is normalised over (the loop passes
    the global batch's, summed over ranks and micro-steps, so the split does not change the loss):

    * ``dapo``: its completion tokens (TRL's ``num_items_in_batch``);
    * ``bnpo``: its completion tokens. TRL counts them per micro-batch (the local batch) and averages the
      micro-batches' losses: equal to ``dapo`` when the batch is one micro-batch, different when micro-batches
      hold different token counts; pass the micro-batch's tokens times the number of micro-batches for TRL's;
    * ``grpo``: its sequences (each sequence's loss is its token mean);
    * ``dr_grpo``: its sequences times ``max_completion_length`` (a constant per sequence, no length bias).
    """
    if loss_type in ("dapo", "bnpo"):
        return max(float(tokens), 1.0)
    if loss_type == "grpo":
        return max(float(sequences), 1.0)
    if loss_type == "dr_grpo":
        return max(float(sequences), 1.0) * max_completion_length
    raise ValueError(f"loss_type {loss_type!r}")


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, divisor: float) -> torch.Tensor:
    """This micro-batch's share of the batch's loss: ``grpo`` sums each sequence's token mean, the others sum
    every kept token, and both divide by ``divisor`` (``normaliser``)."""
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        summed = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    elif loss_type in ("bnpo", "dr_grpo", "dapo"):
        summed = (per_token * mask).sum()
    else:
        raise ValueError(f"loss_type {loss_type!r}")
    return summed / divisor


def grpo_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, settings: GrpoSettings, *,
              divisor: float, old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, TokenTerms]:
    """(this micro-batch's loss, its per-token terms): ``logps`` ``[B, C]`` the policy's per-token log-probs at
    the sampling temperature (``tokens_to_grid`` of the loss head's), ``mask`` the completion mask (truncated ones
    masked already, if asked), ``divisor`` the ``normaliser`` of the batch. ``old_logps``: the rollout's, needed
    with ``num_iterations > 1`` (None: the ratio is 1); ``ref_logps``: the reference's, needed with ``beta > 0``."""
    if settings.num_iterations > 1 and old_logps is None:
        raise ValueError("num_iterations > 1 needs the rollout's per-token log-probs (old_logps)")
    terms = token_terms(logps, advantages, old_logps=old_logps, ref_logps=ref_logps,
                        epsilon_low=settings.epsilon_low, epsilon_high=settings.clip_high, beta=settings.beta,
                        bias_correction_kl=settings.use_bias_correction_kl)
    return reduce_loss(terms.loss, mask, settings.loss_type, divisor), terms


METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def metric_sums(terms: TokenTerms, advantages: torch.Tensor, mask: torch.Tensor, settings: GrpoSettings,
                entropies: torch.Tensor | None = None) -> torch.Tensor:
    """``[len(METRICS) + 1]`` float64 token sums of TRL's token-mean metrics, then the token count: summed over
    ranks and micro-steps, each sum over the count is TRL's value (``metric_means``). NaN where not computed."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    m = mask.to(torch.float64)
    low = (terms.ratio < 1 - settings.epsilon_low) & (advantages < 0)
    high = (terms.ratio > 1 + settings.clip_high) & (advantages > 0)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=m.device)

    def total(x: torch.Tensor | None) -> torch.Tensor:
        return nan if x is None else (x.detach().to(torch.float64) * m).sum()

    return torch.stack([total(terms.kl), total(entropies), total(low), total(high), total(low | high), m.sum()])


def metric_means(sums: torch.Tensor) -> dict[str, float]:
    """TRL's metric values from ``metric_sums`` summed over the batch (metrics not computed are left out)."""
    count = max(float(sums[-1]), 1.0)
    return {name: float(value) / count for name, value in zip(METRICS, sums[:-1].tolist(), strict=True)
            if value == value}


# ------------------------------------------------------------------------------------- dynamic sampling


def informative_groups(correct: torch.Tensor, num_generations: int) -> torch.Tensor:
    """DAPO's dynamic sampling filter: ``[N / num_generations]`` whether each group's binary correctness
    (``correct``, ``[N]``, bool or 0/1) is mixed. Groups all right or all wrong carry no advantage and are dropped
    (filtered on correctness, not a shaped reward: a shaped filter lets all-wrong groups through)."""
    grouped = correct.to(torch.bool).view(-1, num_generations)
    return grouped.any(dim=1) & ~grouped.all(dim=1)
