"""A loss head that never materialises the full `[tokens x vocabulary]` logits, in forward or in backward.

Why: Qwen's vocabulary has 151,936 tokens. The standard head builds the logits of every token, their fp32 copy,
log-softmax and gradient: at 4096 tokens that is ~2.5 GB per copy, far more than a LoRA run's weights and
activations, and it grows with sequence length. Here the cross-entropy is computed chunk by chunk over tokens:

* ``chunked`` (portable, exact): only the positions whose (shifted) label is not ``ignore_index`` go through the
  head, ``chunk`` tokens at a time. Each chunk's logits -> fp32 -> cross-entropy (summed) runs under
  non-reentrant activation checkpointing, so forward keeps no logits at all and backward recomputes one chunk's
  logits at a time. The head module's own forward computes each chunk, so LoRA on ``lm_head`` (PEFT
  ``lora.Linear``), ``modules_to_save`` and tied embeddings are differentiated as usual.
* ``liger`` (CUDA, ``pip install 'curriculum-toolkit[liger]'``): Liger-Kernel's fused linear cross-entropy,
  which computes the gradients of hidden states and weight chunk by chunk in forward. Only for a plain
  ``nn.Linear`` head (no LoRA on it). On the CPU its Triton kernels run in Triton's interpreter
  (``TRITON_INTERPRET=1``): how CI checks it against the chunked head (tests/model/test_loss_head.py, and a ZeRO-3
  launch in tests/e2e/test_strategies.py).

Where it runs: under ZeRO-3 and FSDP2 the head's weight is sharded and gathered only while the head module runs
(DeepSpeed's / FSDP's module hooks), and re-gathered for its backward. So the loss is computed *inside the head
module's forward call*: a wrapper around the causal LM's forward records the labels of the call, the model calls its
head once with the hidden states as usual, and the head's patched forward returns the loss (a 0-d tensor) in
place of the logits. The model's ``loss_function`` (transformers' hook for exactly this) then hands that
tensor back as ``loss``. ``num_items_in_batch`` normalises exactly as transformers' ``ForCausalLMLoss``: the
summed token losses divided by it, or the mean over label tokens without it. Labels shift the same way (pad
with ``ignore_index`` on the right, then drop the first column), so packed rows match the standard head.

Per token: inside ``LossHead.per_token`` a labelled call also keeps each label token's log-probability at a
sampling temperature (``TokenLogps``: the logits divided by it, as TRL's GRPO scores completions), differentiable,
in the order of the label positions, and optionally its entropy (no gradient): what an RL objective's clipped
ratios and KL need (toolkit/train/grpo.py), by the same chunks, still without full logits.

Per row: inside ``LossHead.per_segment`` a labelled call also adds each label token's loss (float64) to its segment
(a padded row, or one sample of a packed row): the scoring pass's per-row sums (toolkit/evals/scoring.py), by the
same chunks, so scoring never builds full logits either. ``loss_head_of`` finds the head under any wrapper.

A call without labels, or with ``logits_to_keep``, takes the standard path and returns real logits
(generation, export). With labels, ``outputs.logits`` is the loss itself, not logits: nothing in training reads
them. If the labelled call's head never ran (a model whose forward does not call its output embeddings), the loss
function raises instead of silently falling back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from toolkit.errors import ToolkitError

log = logging.getLogger(__name__)

LOSS_HEADS = ("auto", "chunked", "liger", "standard")
DEFAULT_CHUNK_ELEMENTS = 2**25
"""Default chunk: as many tokens as keep one chunk's logits near 32 Mi elements (128 MiB in fp32): 220 tokens of
Qwen's 151,936-token vocabulary, the whole micro-batch for small vocabularies."""


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk when the recipe gives none (see DEFAULT_CHUNK_ELEMENTS)."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(int(vocab_size), 1))


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1): how CI runs Liger's kernels."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_loss_head(kind: str) -> None:
    """Fail in seconds, before the model loads, on a head that cannot run here."""
    if kind not in LOSS_HEADS:
        raise ToolkitError(f"model.loss_head is '{kind}'; choose one of {', '.join(LOSS_HEADS)}.")
    if kind == "liger" and not (liger_available() and (torch.cuda.is_available() or triton_interpreted())):
        raise ToolkitError("model.loss_head is liger but " + ("liger-kernel is not installed: pip install "
                           "'curriculum-toolkit[liger]'" if not liger_available() else "there is no CUDA device "
                           "(TRITON_INTERPRET=1 runs its kernels on the CPU, slowly: for tests)")
                           + "; use auto (Liger where it can run, the chunked head otherwise) or chunked.")


# ---------------------------------------------------------------------------------------------- the loss


def shifted_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Token i's target is label i+1, as in transformers' ForCausalLMLoss (per row; the last position ignored)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


@dataclass
class SegmentSums:
    """Per-segment token-loss sums (float64) and label-token counts of one forward call. ``ids`` gives each
    position of the batch its segment (``[B, T]``, -1 for none); a position's loss counts for the segment of the
    label it predicts, so ids are shifted like the labels (``preshifted``: they already are, as a Ulysses slice's
    ``shift_labels`` are: shifted over the whole row before slicing)."""

    ids: torch.Tensor
    count: int
    loss: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    preshifted: bool = False

    @property
    def shifted(self) -> torch.Tensor:
        return self.ids if self.preshifted else shifted_labels(self.ids, -1)

    def add(self, owners: torch.Tensor, losses: torch.Tensor) -> None:
        if self.loss is None or self.tokens is None:
            self.loss = torch.zeros(self.count, dtype=torch.float64, device=losses.device)
            self.tokens = torch.zeros(self.count, dtype=torch.int64, device=losses.device)
        self.loss.index_add_(0, owners, losses.double())
        self.tokens.index_add_(0, owners, torch.ones_like(owners))


@dataclass
class TokenLogps:
    """Per-token log-probabilities (and entropies) of one forward call's label tokens at ``temperature``, in the
    order of the label positions (row-major over ``[B, T]``, shifted like the labels): chunks kept as computed,
    differentiable under autograd; entropies (only with ``entropy``) carry no gradient."""

    temperature: float = 1.0
    entropy: bool = False
    chunks: list[torch.Tensor] | None = None
    entropy_chunks: list[torch.Tensor] | None = None

    def add(self, logps: torch.Tensor, entropies: torch.Tensor | None) -> None:
        self.chunks = [*(self.chunks or []), logps]
        if entropies is not None:
            self.entropy_chunks = [*(self.entropy_chunks or []), entropies]

    @property
    def logps(self) -> torch.Tensor | None:
        """Every label token's log-probability (float32), or None when the call had no label tokens."""
        return torch.cat(self.chunks) if self.chunks else None

    @property
    def entropies(self) -> torch.Tensor | None:
        return torch.cat(self.entropy_chunks) if self.entropy_chunks else None


def _token_logps(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, target: torch.Tensor,
                 temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float() / temperature
    logps = -F.cross_entropy(logits, target, reduction="none")
    if not entropy:
        return logps, logps.new_zeros(0)
    with torch.no_grad():
        full = torch.log_softmax(logits, dim=-1)
        ent = -(full.exp() * full).sum(-1)
    return logps, ent


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, target: torch.Tensor
                ) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), target, reduction="sum")


def _token_losses(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, target: torch.Tensor
                  ) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), target, reduction="none")


def chunked_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          shift_labels: torch.Tensor, *, chunk_tokens: int, ignore_index: int = -100,
                          same_chunks_on_all_ranks: bool = False, segments: SegmentSums | None = None,
                          tokens: TokenLogps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy over label tokens, number of label tokens) of ``head(hidden)`` against
    ``shift_labels``, without ever holding more than ``chunk_tokens`` rows of logits.

    Ignored positions are dropped before the head: they contribute nothing to the loss or any gradient. Under
    autograd each chunk is checkpointed (its logits are recomputed in backward, one chunk at a time). At least one
    (possibly empty) chunk always runs, so the head's parameters stay in the graph on a rank without label
    tokens, as with the standard head.

    ``same_chunks_on_all_ranks``: every rank runs as many chunks as the rank with the most label tokens (padding
    with empty ones; one scalar all-reduce). Needed when calling the head runs collectives per call: a head whose
    weights sit in submodules (PEFT's lora.Linear, modules_to_save) under ZeRO-3, where each submodule call
    gathers its weight from all ranks, and ranks with different chunk counts would wait on each other forever.

    ``segments``: also add each label token's loss (float64) to its segment's sum and count (``SegmentSums``: per
    padded row, or per sample of a packed row), for the scoring pass; under autograd the sums are differentiable
    (a preference stage's per-sequence log-probs), each chunk checkpointed as above.

    ``tokens``: also keep each label token's log-probability at ``tokens.temperature`` (and its entropy), in label
    order (``TokenLogps``); the returned sum is then of those tokens' negated log-probabilities.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(flat.device)
    keep = (targets != ignore_index).nonzero().squeeze(1)
    flat, targets = flat.index_select(0, keep), targets.index_select(0, keep)
    owners = segments.shifted.reshape(-1).to(flat.device).index_select(0, keep) if segments is not None else None
    grad = torch.is_grad_enabled()
    total: torch.Tensor | None = None
    longest = len(targets)
    if same_chunks_on_all_ranks and torch.distributed.is_available() and torch.distributed.is_initialized():
        count = torch.tensor(longest, device=flat.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        longest = int(count.item())
    for start in range(0, max(longest, 1), chunk_tokens):
        h, y = flat[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if tokens is not None:
            args = (head, h, y, tokens.temperature, tokens.entropy)
            logps, ent = checkpoint(_token_logps, *args, use_reentrant=False) if grad else _token_logps(*args)
            if len(y):  # the empty chunks that keep ranks in step add nothing
                tokens.add(logps, ent if tokens.entropy else None)
            part = -logps.sum()
        elif owners is not None and segments is not None:
            token_losses = (checkpoint(_token_losses, head, h, y, use_reentrant=False) if grad
                            else _token_losses(head, h, y))
            segments.add(owners[start:start + chunk_tokens], token_losses)
            part = token_losses.sum()
        else:
            part = checkpoint(_chunk_loss, head, h, y, use_reentrant=False) if grad else _chunk_loss(head, h, y)
        total = part if total is None else total + part
    assert total is not None
    return total, torch.tensor(len(targets), device=total.device)


def liger_cross_entropy(weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor,
                        shift_labels: torch.Tensor, *, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sum and count through Liger-Kernel's fused linear cross-entropy (CUDA, or TRITON_INTERPRET=1)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(flat.device)
    if flat.dtype != weight.dtype:  # under autocast the hidden states may still be fp32
        flat = flat.to(weight.dtype)
    out = liger_fused_linear_cross_entropy(flat, weight, targets, bias=bias, ignore_index=ignore_index,
                                           reduction="sum")
    loss = out[0] if isinstance(out, tuple) else out
    return loss.float(), (targets != ignore_index).sum()


# ---------------------------------------------------------------------------------------- installation


@dataclass
class _Call:
    """What the forward wrapper learnt about the current labelled forward call."""

    shift_labels: torch.Tensor
    num_items: Any
    ignore_index: int
    done: bool = False


class LossHead:
    """The installed head: the causal LM's forward wrapper, the head module's patched forward, the model's loss
    function. ``kind`` is ``chunked`` or ``liger``; ``calls`` counts the losses it computed (tests)."""

    def __init__(self, model: nn.Module, head: nn.Module, kind: str, chunk_tokens: int) -> None:
        self.kind, self.chunk_tokens, self.calls = kind, chunk_tokens, 0
        self.model, self.head = model, head
        self.wrapped = any(True for _ in head.children())  # its weights live in submodules with their own hooks
        self._pending: _Call | None = None
        self.segments: SegmentSums | None = None  # set by `per_segment` for the scoring pass's forward calls
        self.tokens: TokenLogps | None = None  # set by `per_token` for an RL objective's forward calls
        self._head_forward = head.forward  # the module's own forward (nn.Linear's, PEFT lora.Linear's, ...)
        self._standard_loss = model.loss_function
        # The causal LM's forward is wrapped, not hooked: PEFT before 0.21 calls `model.forward(...)` directly,
        # which skips module hooks (the labels would go unseen and the full-logits head would run, silently).
        # The wrapper keeps the forward's signature (functools.wraps): `generate` reads it to decide what to pass
        # (position_ids of left-padded rows, logits_to_keep=1 at prefill instead of full-vocabulary logits).
        forward = model.forward

        @functools.wraps(forward)
        def forward_with_labels(*args: Any, **kwargs: Any) -> Any:
            self._before_forward(model, args, kwargs)
            return forward(*args, **kwargs)

        model.forward = forward_with_labels  # type: ignore[method-assign]
        head.forward = self._forward  # type: ignore[method-assign]
        model.loss_function = self._loss  # transformers calls self.loss_function(logits=..., labels=..., ...)
        model.toolkit_loss_head = self  # found again under any wrapper by `loss_head_of`

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
        keep = kwargs.get("logits_to_keep", 0)
        self._pending = None
        if (labels is None and shift is None) or not (isinstance(keep, int) and keep == 0):
            return
        ignore = int(kwargs.get("ignore_index", -100))
        self._pending = _Call(shift if shift is not None else shifted_labels(labels, ignore),
                              kwargs.get("num_items_in_batch"), ignore)

    def _forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        call = self._pending
        if call is None or call.done or args or kwargs:
            return self._head_forward(hidden, *args, **kwargs)
        # inside the head's forward: the weight is gathered here
        if self.kind == "liger" and self.segments is None and self.tokens is None:
            summed, count = liger_cross_entropy(self.head.weight, self.head.bias, hidden, call.shift_labels,
                                                ignore_index=call.ignore_index)
        else:
            summed, count = chunked_cross_entropy(self._head_forward, hidden, call.shift_labels,
                                                  chunk_tokens=self.chunk_tokens, ignore_index=call.ignore_index,
                                                  same_chunks_on_all_ranks=self.wrapped, segments=self.segments,
                                                  tokens=self.tokens)
        call.done = True
        self.calls += 1
        if call.num_items is None:
            return summed / count
        items = call.num_items.to(summed.device) if torch.is_tensor(call.num_items) else call.num_items
        return summed / items

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
              **kwargs: Any) -> torch.Tensor:
        call, self._pending = self._pending, None
        if call is None:  # a call the wrapper left to the standard path (no labels seen, logits_to_keep)
            return self._standard_loss(logits=logits, labels=labels, vocab_size=vocab_size, **kwargs)
        if not call.done:
            raise RuntimeError("the chunked loss head did not run in this forward call: the model did not call "
                               "its output embeddings with the hidden states; set model.loss_head: standard")
        return logits.reshape(())  # the head returned the loss (possibly re-wrapped by DeepSpeed's hooks)

    @contextlib.contextmanager
    def per_segment(self, ids: torch.Tensor, count: int, *, preshifted: bool = False) -> Iterator[SegmentSums]:
        """Forward calls inside also sum each segment's token losses (``ids``: ``[B, T]`` segment of each position,
        -1 for none, ``count`` segments; ``preshifted``: ids already shifted like ``shift_labels``): the per-row
        (per-sample of a packed row) sums of the scoring pass, computed by the chunked head (Liger's kernel sums
        over the whole batch only), still without full logits."""
        self.segments = SegmentSums(ids, count, preshifted=preshifted)
        try:
            yield self.segments
        finally:
            self.segments = None

    @contextlib.contextmanager
    def per_token(self, temperature: float = 1.0, *, entropy: bool = False) -> Iterator[TokenLogps]:
        """Forward calls inside also keep each label token's log-probability at ``temperature`` (and, with
        ``entropy``, its entropy), in label order: by the chunked head (Liger's kernel gives only sums). The call's
        loss is then the sum of those tokens' negated log-probabilities over ``num_items_in_batch``; a caller that
        builds its loss from the kept log-probabilities adds ``0.0 * loss`` so that the backward passes through the
        model's output (ZeRO-3 opens its backward there; see toolkit/evals/scoring.py)."""
        self.tokens = TokenLogps(temperature, entropy)
        try:
            yield self.tokens
        finally:
            self.tokens = None

    def remove(self) -> None:
        """Back to the standard head (tests compare both on one model)."""
        del self.model.toolkit_loss_head
        del self.model.forward  # the instance attribute: the class's forward shows through again
        del self.head.forward  # the instance attribute: the class's forward shows through again
        self.model.loss_function = self._standard_loss
        self._pending = None


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def loss_head_of(model: nn.Module) -> LossHead | None:
    """The head installed on ``model`` under any wrapper (DDP / DeepSpeed's ``.module``, PEFT), or None."""
    seen = 0
    while hasattr(model, "module") and isinstance(model.module, nn.Module) and seen < 8:
        model, seen = model.module, seen + 1
    found = getattr(causal_lm(model), "toolkit_loss_head", None)
    return found if isinstance(found, LossHead) else None


def install_loss_head(model: nn.Module, kind: str = "auto", chunk_tokens: int | None = None) -> LossHead | None:
    """Make ``model`` (a causal LM or image-text-to-text model, PEFT-wrapped or not; call after LoRA and before
    ``accelerator.prepare``) compute its training loss with the chosen head; logs which one runs.

    ``auto``: Liger's fused kernel on CUDA when liger-kernel is installed and the head is a plain Linear, the
    chunked head otherwise. ``standard``: nothing changes (full-vocabulary logits). Returns the installed head.
    """
    check_loss_head(kind)
    base = causal_lm(model)
    head = base.get_output_embeddings()
    vocab = int(base.config.get_text_config().vocab_size)
    if kind == "standard":
        log.info("loss head: standard (full [tokens x %d] logits; model.loss_head: chunked avoids them)", vocab)
        return None
    if head is None or not hasattr(base, "loss_function"):
        raise ToolkitError(f"model.loss_head is {kind} but {type(base).__name__} has no output embeddings or loss "
                           "function to replace; set model.loss_head: standard.")
    plain = type(head) is nn.Linear
    if kind == "liger" and not plain:
        raise ToolkitError(f"model.loss_head is liger but the LM head is a {type(head).__name__} (LoRA or "
                           "modules_to_save on lm_head): Liger needs a plain Linear; use chunked.")
    if kind == "auto":
        kind = "liger" if plain and torch.cuda.is_available() and liger_available() else "chunked"
    tokens = chunk_tokens or default_chunk_tokens(vocab)
    installed = LossHead(base, head, kind, tokens)
    if kind == "liger":
        log.info("loss head: liger (fused linear cross-entropy, no [tokens x %d] logits)", vocab)
    else:
        log.info("loss head: chunked (%d tokens per chunk of a %d-token vocabulary; model.loss_head: standard "
                 "turns it off)", tokens, vocab)
    return installed
