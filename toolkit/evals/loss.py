"""Evaluation: loss and perplexity on held-out data, sharded over ranks, reduced to one number.

Rank r takes samples r, r + world, ...; every rank runs the same number of forward passes (ranks whose shard
ran out repeat a sample with weight 0), because under ZeRO-3 and FSDP each forward gathers parameters
collectively and a rank that stopped early would hang the others. Summed token losses and token counts are
all-reduced, so the result equals the single-process value on the same data. The loss comes from the model's
installed loss head (toolkit/model/loss_head.py: chunked by default, so no full-vocabulary logits here either).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.data.encoding import IGNORE_INDEX


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, samples: list[dict[str, Any]],
             collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]], micro_batch_size: int
             ) -> dict[str, float]:
    """`eval_loss` (mean over label tokens), `eval_ppl` and `eval_tokens` of `samples`."""
    world, rank = accelerator.num_processes, accelerator.process_index
    shard = list(range(rank, len(samples), world))
    per_rank = math.ceil(len(samples) / world)
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    tokens = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for start in range(0, per_rank, micro_batch_size):
        idx = shard[start:start + micro_batch_size]
        weight = 1.0 if idx else 0.0  # a rank past its shard still runs a forward, contributing nothing
        batch = collate([samples[i] for i in (idx or [0])])
        batch = {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        # num_items_in_batch=1 turns the model's loss into the sum over label tokens
        summed = model(**batch, num_items_in_batch=torch.ones((), device=accelerator.device)).loss
        loss_sum += weight * summed.double()
        tokens += weight * (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    model.train(was_training)
    total_loss = accelerator.reduce(loss_sum, reduction="sum").item()
    total_tokens = accelerator.reduce(tokens, reduction="sum").item()
    mean = total_loss / max(total_tokens, 1.0)
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_tokens": int(total_tokens)}
