"""Stage freezing: parameters a stage does not train stay bit-identical, with their Adam state untouched."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator

from toolkit.strategies import optimizer_chain, param_state, uses_deepspeed


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
        if all(all(sig) for sig in self.signatures):
            return  # nothing is ever frozen: no hooks at all
        base = self._base
        self._hidden: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        base.register_step_pre_hook(self._hide_frozen_grads)
        base.register_step_post_hook(self._restore_grads)
        if not self.deepspeed:
            return
        # ZeRO-2 creates Adam state lazily and links it to the parameters after its first step: a group frozen
        # at that step would stay linked to an empty state. Create the state now, exactly as the optimizer would.
        param_state.ensure_adam_state(accelerator, optimizer)
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
