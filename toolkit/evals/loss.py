"""Evaluation: loss and perplexity on held-out data, sharded over ranks, reduced to one number.

The rows are scored by the scoring pass (toolkit/evals/scoring.py: sharded so every rank runs the same number of
forward calls, as ZeRO-3 and FSDP need; per-row float64 sums through the installed loss head, so no
full-vocabulary logits here either), then summed: the result equals the single-process value on the same data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.evals.scoring import row_sums


def evaluate(accelerator: Accelerator, model: torch.nn.Module, samples: Any,
             collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]], micro_batch_size: int
             ) -> dict[str, float]:
    """`eval_loss` (mean over label tokens), `eval_ppl` and `eval_tokens` of `samples`."""
    sums = row_sums(accelerator, model, samples, collate, micro_batch_size)
    total_loss, total_tokens = float(sums.loss.sum()), float(sums.tokens.sum())
    mean = total_loss / max(total_tokens, 1.0)
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_tokens": int(total_tokens)}
