"""The optimizer: AdamW as the strategy needs it (`build_optimizer`), and stage freezing, which keeps the parameters
a stage does not train bit-identical, with their Adam state untouched (`StageFreezer`)."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator

from toolkit.strategies import deepspeed, optimizer_chain, uses_deepspeed


class StageFreezer:
    """Keeps the parameters a stage freezes bit-identical, with their Adam state untouched, under every strategy.

    The optimizer's param groups are the signature groups of `trainable.TrainablePlan` (one per set of stages a
    parameter trains in), all handed over once before `prepare`; `set_stage` marks the groups frozen in a stage.
    A frozen group's update is withheld in two steps:
      * its gradients must not reach clipping: DDP / FSDP2 / single drop them after backward (`drop_frozen_grads`,
        before `clip_grad_norm_`); DeepSpeed clips inside its step, so tensor hooks zero them during backward;
      * hooks around the innermost torch optimizer's step hide the group's grads (None) for the step and put
        them back after, so AdamW (or DeepSpeed's CPU Adam) skips it: no update, no weight decay, no change to
        its moments or step count, and DeepSpeed's own gradient buffers are left as they were. DeepSpeed steps
        that optimizer once per (flat, partitioned) group, so the same hooks work on its fp32 partitions.
    Every parameter's Adam state exists from the start (`create_optimizer_state`), so a checkpoint taken while a
    group has not trained yet holds its (zero) state under every strategy.
    Parameters frozen in a stage still get (zeroed) weight gradients computed: the cost of keeping the set of
    trainable parameters, and so every strategy's wrapping, the same for the whole run.
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, optimizer: Any,
                 groups: list[tuple[tuple[bool, ...], list[str]]]) -> None:
        """`groups`: (signature, parameter names) in optimizer param-group order; call after `prepare`."""
        self.signatures = [sig for sig, _ in groups]
        self.names = [names for _, names in groups]
        self.updates = [0] * len(groups)  # optimizer updates applied to each group (its Adam step count)
        self._base = optimizer_chain(optimizer)[-1]  # the torch optimizer that updates tensors
        if len(self.groups) != len(groups):
            raise ValueError(f"{len(self.groups)} optimizer param groups for {len(groups)} signature groups")
        self.deepspeed = uses_deepspeed(accelerator)
        base = self._base
        create_optimizer_state(base)
        if all(all(sig) for sig in self.signatures):
            return  # nothing is ever frozen: no hooks at all
        self._hidden: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        base.register_step_pre_hook(self._hide_frozen_grads)
        base.register_step_post_hook(self._restore_grads)
        if not self.deepspeed:
            return
        group_of = {name: g for g, (_, names) in enumerate(groups) for name in names}
        for name, param in accelerator.unwrap_model(model).named_parameters():
            if name in group_of:
                g = group_of[name]
                param.register_hook(lambda grad, g=g: torch.zeros_like(grad) if self.groups[g].get("frozen") else grad)

    @property
    def groups(self) -> list[dict[str, Any]]:
        """The live param groups of the torch optimizer (DeepSpeed's ZeRO optimizer shares them). Never cached:
        `load_state_dict` (a resume) replaces the group dicts, and flags set on the old ones would be lost."""
        return self._base.param_groups

    def set_stage(self, stage: int) -> None:
        for group, sig in zip(self.groups, self.signatures, strict=True):
            group["frozen"] = not sig[stage]

    def _hide_frozen_grads(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._hidden = [(p, p.grad) for group in optimizer.param_groups if group.get("frozen") for p in group["params"]]
        for p, _ in self._hidden:
            p.grad = None

    def _restore_grads(self, *_: Any) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden = []

    def drop_frozen_grads(self) -> None:
        """Before clipping (non-DeepSpeed strategies): frozen groups' gradients leave the norm and the update."""
        if not self.deepspeed:
            for group in self.groups:
                if group.get("frozen"):
                    for p in group["params"]:
                        p.grad = None

    def count_update(self, stage: int) -> None:
        """Record one applied optimizer step in `stage` (Adam's step count of each group trained in it)."""
        for g, sig in enumerate(self.signatures):
            self.updates[g] += sig[stage]

    def adam_steps(self) -> dict[str, int]:
        """Each trainable parameter's Adam step count, by name (for strategy-independent checkpoints)."""
        return {name: self.updates[g] for g, names in enumerate(self.names) for name in names}


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of the torch optimizer that updates tensors its state now, as its first update would:
    zero moments, step count 0.

    Adam creates a parameter's state at its first update, so a checkpoint taken before a group's first update (a
    group that a stage freezes, or every group after a skipped first step) holds no state for it, and the resumed
    run must find exactly that. Strategies do not: FSDP2's loader (torch.distributed.checkpoint) expects an entry
    for every parameter ("Missing key in checkpoint state_dict") and otherwise creates the state with a zero step
    of its own, which counts as an Adam step; ZeRO-2 links state to its partitions at its first step. With every
    state present from the start, checkpoints hold the same keys at every step under every strategy.

    The state is made by the optimizer itself (its own dtypes and devices: fused or CPU Adam included) in one step
    over zero gradients at learning rate 0, the way torch.distributed.checkpoint initialises a state to load into,
    then the step counts are set back to 0. At lr 0 that step changes no parameter (weight decay multiplies by
    exactly 1, the update is 0 times the moments) and leaves zero moments. Call before any hook on its step.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    # Gradients already there are put back as they were: ZeRO-1/2 with optimizer offload keeps its pinned CPU
    # gradient buffers on the fp32 partitions from the start and writes into them (a None there fails its backward).
    grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
    for p in params:
        state = optimizer.state[p]
        state["step"] = state["step"].zero_() if isinstance(state["step"], torch.Tensor) else 0


def build_optimizer(accelerator: Accelerator, params: list[torch.nn.Parameter] | list[dict[str, Any]], *, lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """AdamW, in the form the strategy needs (`params`: tensors, or param-group dicts): torch's (fused on CUDA: one
    kernel for all parameters, and no host reads of its step counters), or the strategy's own where it wants one
    (ZeRO optimizer offload: `strategies.deepspeed.offload_adam`)."""
    adam = deepspeed.offload_adam(accelerator, params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    if adam is not None:
        return adam
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                             fused=True if accelerator.device.type == "cuda" else None)
