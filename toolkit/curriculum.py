"""The curriculum: an ordered list of stages laid out on one global step axis.

Everything here is a pure function of (recipe, dataset sizes, global batch, seed, global step): which stage a
step is in, which samples form that step's global batch, which of them each rank and micro-step gets, and the
learning rate. Nothing depends on the number of processes except the final split, so a 2-process run sees the
same global batches as a 1-process run, and resuming at any step replays exactly the data the uninterrupted run
would have seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import get_scheduler

from toolkit.errors import ToolkitError


@dataclass(frozen=True)
class StagePlan:
    """One stage placed on the global step axis."""

    index: int
    name: str
    num_samples: int
    steps: int
    start_step: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float
    global_batch: int
    steps_per_epoch: int

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


def plan_stages(names: list[str], sizes: list[int], *, global_batch: int, epochs: list[float | None],
                max_steps: list[int | None], lrs: list[float], warmup_ratios: list[float],
                min_lr_ratios: list[float]) -> list[StagePlan]:
    """Lay the stages end to end. A stage runs `max_steps`, else `epochs` (default 1) full global batches."""
    plans, start = [], 0
    for i, name in enumerate(names):
        n = sizes[i]
        per_epoch = n // global_batch
        if per_epoch == 0:
            raise ToolkitError(
                f"Stage '{name}' has {n} usable samples, fewer than one global batch of {global_batch} "
                "(micro_batch_size x grad_accum x processes). Add data or lower the batch size.")
        steps = max_steps[i] or max(1, round((epochs[i] or 1.0) * per_epoch))
        warmup = math.ceil(round(warmup_ratios[i] * steps, 9))  # round first: 0.07 * 100 is 7.000000000000001
        plans.append(StagePlan(index=i, name=name, num_samples=n, steps=steps, start_step=start, lr=lrs[i],
                               warmup_steps=warmup, min_lr_ratio=min_lr_ratios[i],
                               global_batch=global_batch, steps_per_epoch=per_epoch))
        start += steps
    return plans


def locate(plans: list[StagePlan], step: int) -> tuple[StagePlan, int]:
    """(stage, step within it) of a global step; steps past the end map to the last stage's last step."""
    for plan in plans:
        if step < plan.end_step:
            return plan, step - plan.start_step
    return plans[-1], plans[-1].steps - 1


def global_batch_indices(plan: StagePlan, step_in_stage: int, seed: int) -> list[int]:
    """Sample indices forming one optimizer step's global batch: a fresh seeded permutation per epoch.

    An epoch uses `steps_per_epoch` full global batches; the remainder of the permutation is left out
    (a different remainder each epoch), so every step has the same global batch size.
    """
    epoch, k = divmod(step_in_stage, plan.steps_per_epoch)
    order = np.random.default_rng([seed, plan.index, epoch]).permutation(plan.num_samples)
    g = plan.global_batch
    return order[k * g:(k + 1) * g].tolist()


def rank_micro_batches(indices: list[int], *, rank: int, world_size: int, micro_batch_size: int,
                       grad_accum: int) -> list[list[int]]:
    """This rank's micro-batches of a global batch: micro-step j of rank r takes slice (j * world + r)."""
    m = micro_batch_size
    return [indices[(j * world_size + rank) * m:(j * world_size + rank + 1) * m] for j in range(grad_accum)]


def build_lr_lambda(plans: list[StagePlan], kind: str) -> Callable[[int], float]:
    """Absolute LR at a global step (for a LambdaLR over an optimizer whose base lr is 1.0).

    Each stage runs its own transformers schedule (warmup, then `kind` decay) from its own peak lr; we borrow
    the schedule functions from transformers rather than rewriting them.
    """
    lambdas = []
    for plan in plans:
        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        kwargs = {"min_lr_rate": plan.min_lr_ratio} if kind == "cosine" else None
        name = "cosine_with_min_lr" if kind == "cosine" else kind + ("_with_warmup" if kind == "constant" else "")
        sched = get_scheduler(name, dummy, num_warmup_steps=plan.warmup_steps, num_training_steps=plan.steps,
                              scheduler_specific_kwargs=kwargs)
        lambdas.append(sched.lr_lambdas[0])

    def lr_at(step: int) -> float:
        plan, k = locate(plans, step)
        return plan.lr * lambdas[plan.index](k)

    return lr_at
