"""Rollouts of an RL stage: `num_generations` sampled completions per prompt, batched, with the KV cache.

Each completion is drawn from its own random stream, seeded by (run seed, step, prompt, sample index): a
completion does not depend on which other prompts share its batch, nor on which rank draws it, nor on the training's
random state (untouched). transformers' `generate` runs the model with its KV cache, left-padded prompts, end tokens
and `synced_gpus`; its sampling draws one multinomial for the whole batch from the global generator, so here the
draw is made by a logits processor (`SeededSampler`) and `generate` decodes greedily over what it returns: per row,
temperature, then top-p, then an inverse-CDF draw (the same distribution as a multinomial draw) from one uniform
number per row and token, counter-based: a hash (SplitMix64) of the row's seed and the token position, so every row
is drawn in one vectorised pass and none depends on another. The processor also keeps each chosen token's
log-probability at the temperature (before top-p, as TRL scores completions): the rollout's "old" per-token
log-probs.

Batches hold whole groups (`prompts_per_batch` prompts, each with its `num_generations` rows) in the order given:
a process whose share of the global batch is whole batches of the same prompts draws exactly what one process
would. Under ZeRO-3 / FSDP the caller gathers the full weights once per rollout (toolkit.strategies.full_weights)
and passes `rounds`, the most batches any rank has, with `lockstep`: a rank short of batches generates its first
batch again and discards it, and `synced_gpus` keeps every rank stepping until all are done (as the generation
evals do, toolkit/evals/generation.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

SEED_MIX = 1_000_003


def sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of one completion's random stream: (run seed, step, prompt's key, sample index)."""
    value = seed
    for part in (step, prompt, sample):
        value = (value * SEED_MIX + part) % 2**63
    return value


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch holds (the same bits)."""
    return value - 2**64 if value >= 2**63 else value


GOLDEN, MIX1, MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's `>>` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser: a bijection of 64-bit words whose outputs pass BigCrush for consecutive inputs
    (int64 products wrap, as the algorithm's unsigned ones do)."""
    x = x ^ _shift(x, 30)
    x = x * MIX1
    x = x ^ _shift(x, 27)
    x = x * MIX2
    return x ^ _shift(x, 31)


def row_uniforms(seeds: torch.Tensor, position: int) -> torch.Tensor:
    """One uniform draw in [0, 1) per row (float64, 53 random bits), a pure function of (the row's seed, the token
    position): counter-based, so a row's draw never depends on the other rows, and all rows are drawn in one
    vectorised pass (a generator per row would cost a call per row and token)."""
    bits = _mix(_mix(seeds * GOLDEN + position) + GOLDEN)
    return _shift(bits, 11).to(torch.float64) / 2**53


class SeededSampler(LogitsProcessor):
    """Draws each row's next token from the row's own stream (temperature, top-p) and returns scores that make
    it the greedy choice; keeps the chosen tokens' log-probabilities at the temperature.

    The draw is by inverse CDF: one uniform per row and token (`row_uniforms`) against the row's cumulative
    probabilities (summed in float64, so a token's chance is its probability to about 1e-16), found by binary
    search. torch's `multinomial` (what `generate` samples with) and an exponential race both need a random number
    per vocabulary entry; this needs one per row, which is what makes the seeded draw cheaper than an unseeded one
    (bench/rollout.py)."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float, device: torch.device) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.seeds = torch.tensor(list(seeds), dtype=torch.int64, device=device)
        self.position = 0
        self.logps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scaled = scores.float() / self.temperature
        norm = torch.logsumexp(scaled, dim=-1, keepdim=True)
        probs = (scaled - norm).exp_()
        order = None
        if self.top_p < 1.0:  # keep the smallest set of top tokens whose mass reaches top_p (the top one always)
            probs, order = probs.sort(dim=-1, descending=True)
            probs.masked_fill_((probs.cumsum(-1) - probs) >= self.top_p, 0.0)
        cdf = probs.cumsum(-1, dtype=torch.float64)
        total = cdf[:, -1:].contiguous()
        target = row_uniforms(self.seeds.to(scores.device), self.position).unsqueeze(1) * total
        self.position += 1
        # the first token whose cumulative mass exceeds the target (a token of zero probability never does); the
        # clamp to the last token with mass guards the target rounding up to the total
        chosen = torch.minimum(torch.searchsorted(cdf, target, right=True), torch.searchsorted(cdf, total))
        if order is not None:
            chosen = order.gather(-1, chosen)
        self.logps.append((scaled.gather(-1, chosen) - norm).squeeze(-1))
        return torch.full_like(scores, -math.inf).scatter_(-1, chosen, 0.0)


@dataclass
class Rollout:
    """One rollout's completions, in the order of the prompts given, `num_generations` consecutive rows per
    prompt: prompt and completion token ids (a completion ends with its end token, or is `truncated` at the
    length limit), and the completion tokens' log-probs at the sampling temperature."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    logps: list[list[float]] = field(default_factory=list)

    def tensors(self, pad_id: int) -> dict[str, torch.Tensor]:
        """Padded tensors as TRL lays them out: prompts left-padded, completions (and their log-probs)
        right-padded, with their masks, and the truncation flags."""
        def pad(rows: list[list[int]] | list[list[float]], left: bool, value: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
            width = max((len(r) for r in rows), default=0)
            values = torch.full((len(rows), width), value, dtype=dtype)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                if r:
                    span = slice(width - len(r), width) if left else slice(0, len(r))
                    values[i, span], mask[i, span] = torch.tensor(r, dtype=dtype), 1
            return values, mask

        prompt_ids, prompt_mask = pad(self.prompt_ids, True, pad_id, torch.long)
        completion_ids, completion_mask = pad(self.completion_ids, False, pad_id, torch.long)
        logps, _ = pad(self.logps, False, 0.0, torch.float32)
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                "completion_mask": completion_mask, "old_logps": logps,
                "truncated": torch.tensor(self.truncated, dtype=torch.bool)}


def sampling_config(max_completion_length: int, eos_ids: Sequence[int], pad_id: int) -> GenerationConfig:
    """Greedy decoding over the sampler's scores, stopping at the end tokens; every setting that could change the
    tokens is given, so nothing is inherited from the model's own generation config (Qwen3's top_k 20)."""
    return GenerationConfig(max_new_tokens=max_completion_length, do_sample=False, num_beams=1,
                            repetition_penalty=1.0, no_repeat_ngram_size=0, pad_token_id=pad_id,
                            eos_token_id=list(eos_ids), use_cache=True)


@torch.no_grad()
def rollout(model: torch.nn.Module, prompts: Sequence[Sequence[int]], keys: Sequence[int], *, num_generations: int,
            max_completion_length: int, temperature: float, top_p: float, seed: int, step: int,
            eos_ids: Sequence[int], pad_id: int, prompts_per_batch: int, rounds: int | None = None,
            lockstep: bool = False) -> Rollout:
    """`num_generations` completions of each prompt (token ids; `keys`: each prompt's index in the stage's rows,
    which seeds its draws). `model` holds its full weights (under ZeRO-3 / FSDP: inside
    `full_weights_for_generation`); with `lockstep`, `rounds` generate calls run on every rank."""
    if len(prompts) != len(keys):
        raise ValueError(f"{len(prompts)} prompts, {len(keys)} keys")
    device = next(model.parameters()).device
    batches = [list(range(i, min(i + prompts_per_batch, len(prompts))))
               for i in range(0, len(prompts), prompts_per_batch)]
    total = max(rounds or 0, len(batches)) if lockstep else len(batches)
    stops = set(eos_ids)
    out = Rollout()
    was_training = model.training
    model.eval()
    try:
        for r in range(total):
            idle = r >= len(batches)  # a rank short of batches keeps the others company
            if idle and not batches:
                raise ValueError("a rank with no prompts cannot keep the others company; give it at least one")
            chosen = batches[0] if idle else batches[r]
            rows = [(p, j) for p in chosen for j in range(num_generations)]
            width = max(len(prompts[p]) for p, _ in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, (p, _) in enumerate(rows):
                n = len(prompts[p])
                ids[i, width - n:], mask[i, width - n:] = torch.tensor(list(prompts[p])), 1
            sampler = SeededSampler([sample_seed(seed, step, keys[p], j) for p, j in rows], temperature, top_p,
                                    device)
            sequences = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                       generation_config=sampling_config(max_completion_length, eos_ids, pad_id),
                                       logits_processor=LogitsProcessorList([sampler]),
                                       synced_gpus=lockstep and torch.distributed.is_initialized())
            if idle:
                continue
            new = sequences[:, width:].tolist()
            logps = torch.stack(sampler.logps, dim=1).tolist() if sampler.logps else [[] for _ in rows]
            for i, (p, _) in enumerate(rows):
                tokens = new[i]
                end = next((k for k, t in enumerate(tokens) if t in stops), None)
                kept = tokens[:end + 1] if end is not None else tokens[:max_completion_length]
                out.prompt_ids.append(list(prompts[p]))
                out.completion_ids.append(kept)
                out.truncated.append(end is None)
                out.logps.append(logps[i][:len(kept)])
    finally:
        model.train(was_training)
    return out
