"""Regional `torch.compile` of the decoder layers (`train.compile: true`).

Why regional: the decoder layers are one module class repeated L times, so compiling the layer (not the whole
model) traces one graph that every layer reuses (PEFT's adapters are inlined as inputs, not guarded by identity),
and the embedding, the loss head and the data-dependent packing logic around the layers stay eager. The compiled
layer runs the norms, projections with their LoRA adapters, RoPE, SwiGLU and the residual adds; inductor fuses
their elementwise work into the matmuls' neighbours.

What keeps a stage to one compilation per layer variant:

* The micro-batch's token count T changes every step (packing is not perfect), so the layers are compiled with
  `dynamic=True`: T is symbolic from the first trace. With the default (`dynamic=None`) the first batch would
  compile for its exact T and the second recompile with T symbolic anyway (automatic dynamic shapes), a compile
  thrown away.
* The packed row's varlen boundaries are made shape- and value-stable before the layers see them
  (`FixedBoundaries`, a forward pre-hook on the decoder, eager): `max_length_q/k` is the run's row length (the
  longest stage's `max_seq_len`; every sample of a row is at most that, and a larger `max_seqlen` only widens the
  varlen kernel's grid with blocks that exit at once), and `cu_seq_lens_q/k` is padded to a fixed number of
  slots (`SLOTS`) by repeating its last offset: empty spans, which every kernel of toolkit/model/attention.py
  skips. So the kernel's arguments do not change shape or value within a run.
* A layer whose input needs no gradient (the first one, after frozen embeddings, when gradient checkpointing does
  not make the embeddings' output require grad) is a second variant: a guard on `requires_grad`, once per run.
  Loss evaluations (no grad, padded or packed rows) are further variants, each compiled once. Generation evals
  with a KV cache may exceed Dynamo's recompile limit (the cache is indexed by layer) and then run those layers
  eagerly: slower evals, the same results.

What is not compiled: the CPU path of the packed-row attention splits the row at its sample boundaries with host
values (`cu.tolist()`), which cannot be traced; that call is excluded with `torch.compiler.disable`
(attention.py, `_per_span`), a graph break per layer. The CUDA varlen kernel is a traceable custom op and stays in
the graph. No `mode="reduce-overhead"`: CUDA graphs need static input addresses and shapes, which LoRA's adapters
and a varying T break.

`layer.compile()` (in place) rather than accelerate's `compile_regions`: the latter wraps each layer in an
`OptimizedModule`, which renames every parameter (`_orig_mod.`) and so every checkpoint and adapter key.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from toolkit.errors import ToolkitError

log = logging.getLogger(__name__)

SLOTS = 32
"""cu_seq_lens is padded to a multiple of this many entries (`FixedBoundaries`): a packed micro-batch of chat
samples holds fewer than 31 samples (about 6 per 4096-token row), so in practice every step gets exactly 32; a batch
with more gets the next multiple, a new shape that the dynamic graph takes without recompiling. Kept small: each
empty span still costs the varlen kernel a few thread blocks that exit at once."""


def pad_boundaries(cu: torch.Tensor, multiple: int = SLOTS) -> torch.Tensor:
    """`cu` (sample offsets plus the total) padded to the next multiple of `multiple` entries by repeating its last
    offset: the extra spans are empty, so the attention is unchanged."""
    size = -(-cu.numel() // multiple) * multiple
    if cu.numel() == size:
        return cu
    return torch.cat([cu, cu[-1:].expand(size - cu.numel())])


class FixedBoundaries:
    """A forward pre-hook (with kwargs) for the decoder: a packed batch's `cu_seq_lens_q/k` padded to a multiple of
    `SLOTS` entries and `max_length_q/k` set to `row_length`, so the compiled layers see the same shapes and values
    every step. A batch without boundaries (padded rows) passes unchanged."""

    def __init__(self, row_length: int) -> None:
        self.row_length = row_length

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            return args, kwargs
        longest = int(kwargs["max_length_q"])
        if longest > self.row_length:
            raise ToolkitError(f"train.compile: a packed sample of {longest} tokens is longer than the run's row "
                               f"length {self.row_length} (the longest stage's max_seq_len)")
        padded = pad_boundaries(cu)
        return args, {**kwargs, "cu_seq_lens_q": padded, "cu_seq_lens_k": padded,
                      "max_length_q": self.row_length, "max_length_k": self.row_length}


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """(the text decoder, its repeated layers) of a causal LM, plain or PEFT-wrapped, or the language model of a
    vision-language one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not all(isinstance(m, GradientCheckpointingLayer)
                                                               for m in layers):
        raise ToolkitError(f"train.compile: {type(base).__name__} has no list of decoder layers to compile "
                           "(model.get_decoder().layers); set train.compile: false.")
    return decoder, list(layers)


def compile_layers(model: torch.nn.Module, *, row_length: int, packing: bool,
                   backend: str | Any = "inductor") -> int:
    """Compile every decoder layer of `model` in place (see the module docstring) and, for packed rows, fix the
    varlen boundaries they receive; returns the number of layers. Call it after LoRA and gradient checkpointing
    are set up (the traced layer is the one that trains) and before `accelerator.prepare`. `backend`: inductor
    for training; tests pass a counting backend."""
    decoder, layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    if packing:
        decoder.register_forward_pre_hook(FixedBoundaries(row_length), with_kwargs=True)
    log.info("train.compile: %d decoder layers compiled (%s, dynamic token count%s)", len(layers),
             backend if isinstance(backend, str) else type(backend).__name__,
             f", packed boundaries fixed at {row_length} tokens" if packing else "")
    return len(layers)
