"""Stability guards: skip an optimizer step whose loss is not finite or spikes, on every rank alike.

The decision is taken once per optimizer step, before the last micro-step's backward, from the step's loss
summed over all ranks and micro-steps (one all-reduce, shared with the preemption and timed-save flags). A NaN
on any rank makes the sum NaN, so every rank sees the same verdict. A skipped step still consumes its data
(the data position stays a function of the step), is logged with `skipped` in metrics.jsonl and counted; after
`max_consecutive_skips` in a row the run stops and names the last good checkpoint. A run whose last step was
skipped does not end in success either (its final weights are not the result of its last steps).
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

FAULT_ENV = "TOOLKIT_FAULT_NONFINITE"
"""Fault injection for tests: 'STEP:RANK[,STEP:RANK...]' makes that rank's loss NaN at those optimizer steps."""


def injected_fault(step: int, rank: int) -> bool:
    return f"{step}:{rank}" in os.environ.get(FAULT_ENV, "").split(",")


@dataclass
class Verdict:
    skip: bool
    reason: str | None = None


class StabilityGuard:
    """Tracks recent good losses and decides whether a step's update is applied."""

    def __init__(self, *, spike_factor: float | None, spike_window: int, max_consecutive_skips: int) -> None:
        self.spike_factor = spike_factor
        self.recent: deque[float] = deque(maxlen=spike_window)
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive = 0
        self.total_skipped = 0
        self.last_reason: str | None = None

    def judge(self, loss: float) -> Verdict:
        """Verdict for a step with this global loss (identical on every rank, so verdicts agree)."""
        if not math.isfinite(loss):
            verdict = Verdict(True, "non-finite loss")
        elif (self.spike_factor is not None and len(self.recent) >= max(2, self.recent.maxlen // 2)
              and loss > self.spike_factor * (sum(self.recent) / len(self.recent))):
            verdict = Verdict(True, f"loss spike ({loss:.4g} > {self.spike_factor} x recent mean)")
        else:
            verdict = Verdict(False)
            self.recent.append(loss)
        self.consecutive = self.consecutive + 1 if verdict.skip else 0
        self.total_skipped += verdict.skip
        self.last_reason = verdict.reason or self.last_reason
        return verdict

    @property
    def exhausted(self) -> bool:
        """`max_consecutive_skips` skipped steps in a row: the run stops after the last of them."""
        return self.consecutive >= self.max_consecutive_skips


def scaler_skipped(optimizer: Any) -> bool:
    """True when fp16 loss scaling skipped this step's update (gradient overflow; the scale is lowered).

    accelerate's GradScaler wrapper and DeepSpeed's fp16 optimizer both report it as `step_was_skipped`; such a
    step is not an update (Adam's step count stays) and not a stability skip (the loss was fine).
    """
    return bool(getattr(optimizer, "step_was_skipped", False))


def veto_update(loss: torch.Tensor) -> torch.Tensor:
    """The loss to backpropagate when every rank agreed to skip this step's update.

    Under DeepSpeed, accelerate's backward() also runs engine.step(), so the update cannot be withheld by not
    calling optimizer.step(); a NaN loss makes the gradient norm non-finite and DeepSpeed's own overflow check
    then discards the step and zeroes the gradients (ZeRO-1/2/3, fp32 and bf16). Other strategies simply do not
    call optimizer.step() and zero the (NaN) gradients, so the same call works everywhere.
    """
    return loss * float("nan")


def skip_update(scaler: torch.amp.GradScaler | None) -> None:
    """A step the stability guard vetoed, under fp16 with accelerate's GradScaler (DDP, FSDP2): close it.

    Clipping has already unscaled this step's (NaN) gradients; without the scaler's own step and update the
    next step's unscaling fails ("unscale_() has already been called"). `update()` ends the step as a skipped
    overflow would (the scale backs off). DeepSpeed's fp16 scaler handles the vetoed step inside its step.
    """
    if scaler is not None and scaler.is_enabled():
        scaler.update()
