"""Bytes saved for backward, counted with `torch.autograd.graph.saved_tensors_hooks`, attributed to decoder layers.

Each storage is counted once (a tensor saved by several ops, or viewed, holds one buffer); parameters are left out
(they are memory either way). With gradient checkpointing, what a checkpointed layer keeps is its inputs (held by
the checkpoint until backward), and backward recomputes one layer at a time: `held_bytes` adds both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SavedBytes:
    outside: int = 0  # saved outside the decoder layers (embeddings, final norm, loss head)
    layers: list[int] = field(default_factory=list)  # saved inside each decoder layer
    layer_inputs: int = 0  # checkpointed: the decoder layers' tensor inputs, which the checkpoints keep

    def held_bytes(self, recomputed_layer: int = 0) -> int:
        """Activation bytes held for backward; checkpointed, add the largest layer of an unchecked run (backward
        recomputes one layer at a time)."""
        return self.outside + self.layer_inputs + sum(self.layers) + recomputed_layer


def count_saved(model: torch.nn.Module, batch: dict[str, Any], layers: list[torch.nn.Module], *,
                checkpointed: bool = False) -> SavedBytes:
    """Run the model's forward on `batch` with grad enabled and count what autograd saves for it (`checkpointed`:
    the layers run under checkpoints, so their inputs are what they keep)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    out = SavedBytes(layers=[0] * len(layers))
    current: list[int] = []

    def new_bytes(t: torch.Tensor) -> int:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return 0
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or ptr in seen or ptr == 0:
            return 0
        seen.add(ptr)
        return storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        n = new_bytes(t)
        if current:
            out.layers[current[-1]] += n
        else:
            out.outside += n
        return t

    def before(i: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            if checkpointed and not current:
                out.layer_inputs += sum(new_bytes(a) for a in (*args, *kwargs.values())
                                        if isinstance(a, torch.Tensor))
                cos_sin = kwargs.get("position_embeddings")
                if isinstance(cos_sin, tuple):
                    out.layer_inputs += sum(new_bytes(a) for a in cos_sin)
            current.append(i)
        return hook

    def after(module: torch.nn.Module, args: tuple, output: Any) -> None:
        current.pop()

    handles = [h for i, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(before(i), with_kwargs=True), layer.register_forward_hook(after))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return out
