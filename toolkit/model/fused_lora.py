"""Fused LoRA layers (`lora.fused`): one autograd function per adapted Linear, or per group of them that share an
input, in place of PEFT's chain of modules.

PEFT's LoRA Linear runs ``result = base(x) + lora_B(lora_A(dropout(x))) * scaling`` as four autograd nodes; for
backward they keep ``x``, ``t = x @ A^T`` (tokens x r per layer), and under autocast a 16-bit copy of each adapter
weight. Here the base output is computed as before, and `LoraAddFunction` adds the adapter's output onto it in
place; backward recomputes ``t`` from ``x`` and the adapter weights it holds by reference, so it keeps only ``x``.
Its operations are PEFT's own, in PEFT's order and dtypes, so a layer's outputs and gradients are bitwise PEFT's
(tests/model/test_fused_lora.py: fp32, and CPU bf16 autocast). The projections a block calls on one input, q/k/v
and gate/up (`GROUPS`), are tied into a `LoraGroup`: the first call computes all of them with one
``x @ [A_q; A_k; A_v]^T`` (`LoraGroupFunction`), and backward takes the input's gradient and the A gradients in
one matmul each instead of three, and one add instead of three into the input's gradient. Those sums run in
another order than PEFT's, so grouped layers agree with PEFT's to rounding (1e-6 relative in fp32), not bitwise.

PEFT's module objects stay: only the class of each adapted Linear is swapped for a subclass whose forward is this
one, so parameter names, the saved adapter, checkpoints, `modules_to_save` and per-stage freezing are untouched, and
any call the fused path does not cover (adapters disabled or merged, several active adapters, `adapter_names`, extra
arguments) runs PEFT's forward.

What it cannot reproduce: LoRA dropout (a dropout mask would have to be saved or replayed: PEFT's layers run and a
line says why), DoRA and other PEFT variants, a LoRA bias, a base other than ``nn.Linear``, and ZeRO-3, which
gathers each submodule's parameters in that submodule's own forward hook (the adapters' weights, and a group's
siblings', are read here without calling their modules). ``on`` refuses the latter in one line.

``auto`` (the default) runs PEFT's layers until a GPU has measured the fused ones; ``on`` fuses; ``off`` is PEFT.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn

from toolkit.errors import ToolkitError
from toolkit.strategies.deepspeed import zero3_partitions

log = logging.getLogger(__name__)

FUSED_LORA = ("auto", "on", "off")


class LoraAddFunction(torch.autograd.Function):
    """``y += scaling * (x @ A^T) @ B^T`` in place on the base output ``y``, saving ``x`` (and the weights by
    reference) for backward, which recomputes ``x @ A^T``.

    Each step mirrors PEFT's LoRA Linear so the numbers are its own: `cast` is the dtype PEFT casts the input to
    (the adapter's, unless the toolkit turned the cast off) or None; under autocast both matmuls run in the autocast
    dtype, as autocast runs lora_A and lora_B; the product is scaled, then added."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor,
                scaling: float, cast: torch.dtype | None) -> torch.Tensor:
        device = x.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        with torch.autocast(device, enabled=False):
            u = F.linear(F.linear(_input(x, cast, autocast), _weight(weight_a, autocast)), _weight(weight_b, autocast))
            u = u * scaling  # not folded into add_(alpha=): PEFT rounds the product before the sum
            y.add_(u)
        ctx.mark_dirty(y)
        keep_x = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]  # a stage that freezes the adapters needs no x
        ctx.save_for_backward(x if keep_x else None, weight_a, weight_b)
        ctx.scaling, ctx.cast, ctx.autocast, ctx.u_dtype = scaling, cast, autocast, u.dtype
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight_a, weight_b = ctx.saved_tensors
        _, need_x, need_a, need_b = ctx.needs_input_grad[:4]
        a, b = _weight(weight_a, ctx.autocast), _weight(weight_b, ctx.autocast)
        gu = (grad.to(ctx.u_dtype) * ctx.scaling).reshape(-1, b.shape[0])  # the add's, then the scaling's
        xs = _input(x, ctx.cast, ctx.autocast) if x is not None else None  # kept when A or B needs a gradient
        grad_x = grad_a = grad_b = grad_t = None
        if need_b:  # the formulas autograd applies to F.linear's matmul, on the same operands
            t = F.linear(xs, a).reshape(-1, a.shape[0])  # recomputed: the one tensor PEFT keeps that we do not
            grad_b = gu.t().mm(t).to(weight_b.dtype)
        if need_x or need_a:
            grad_t = gu.mm(b)
        if need_a:
            grad_a = grad_t.t().mm(xs.reshape(-1, a.shape[1])).to(weight_a.dtype)
        if need_x:
            grad_x = grad_t.mm(a).reshape(ctx.x_shape).to(ctx.x_dtype)
        return grad, grad_x, grad_a, grad_b, None, None


def _input(x: torch.Tensor, cast: torch.dtype | None, autocast: torch.dtype | None) -> torch.Tensor:
    """The adapter's input in the dtype PEFT's lora_A takes it: cast to the adapter's dtype (PEFT's
    `_cast_input_dtype`), then to the autocast dtype when autocast is on (as autocast casts lora_A's input)."""
    x = x.to(cast) if cast is not None else x
    return x.to(autocast) if autocast is not None else x


def _weight(weight: torch.Tensor, autocast: torch.dtype | None) -> torch.Tensor:
    """An adapter weight in the dtype its matmul runs in: autocast's when on (a copy made again in backward,
    not kept), else its own."""
    return weight.to(autocast) if autocast is not None else weight


class LoraGroupFunction(torch.autograd.Function):
    """`LoraAddFunction` for n LoRA Linears on the same input (q, k, v; gate, up): ``t = x @ [A_1; ...; A_n]^T``
    is one matmul, and in backward so are its recomputation, the A gradients and the input's gradient (one sum
    over every member's rank instead of n matmuls and n - 1 adds of a tokens x hidden gradient). The sums run in
    another order than PEFT's per-layer ones, so the numbers agree with PEFT's to rounding, not bitwise."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cast: torch.dtype | None, scalings: tuple[float, ...],
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(scalings)
        weights_a, weights_b, ys = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        device = x.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ranks = [int(a.shape[0]) for a in weights_a]
        u_dtypes = []
        with torch.autocast(device, enabled=False):
            t = F.linear(_input(x, cast, autocast), torch.cat([_weight(a, autocast) for a in weights_a]))
            for t_i, b, y, scaling in zip(t.split(ranks, dim=-1), weights_b, ys, scalings, strict=True):
                u = F.linear(t_i, _weight(b, autocast)) * scaling
                y.add_(u)
                u_dtypes.append(u.dtype)
        ctx.mark_dirty(*ys)
        keep_x = any(ctx.needs_input_grad[3:3 + 2 * n])
        ctx.save_for_backward(x if keep_x else None, *weights_a, *weights_b)
        ctx.cast, ctx.autocast, ctx.scalings, ctx.ranks, ctx.u_dtypes = cast, autocast, scalings, ranks, u_dtypes
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return ys

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        n = len(ctx.scalings)
        weights_a, weights_b = weights[:n], weights[n:]
        need = ctx.needs_input_grad
        need_x, need_a, need_b = need[0], need[3:3 + n], need[3 + n:3 + 2 * n]
        a = torch.cat([_weight(w, ctx.autocast) for w in weights_a])
        bs = [_weight(w, ctx.autocast) for w in weights_b]
        gus = [(g.to(dtype) * scaling).reshape(-1, b.shape[0])
               for g, dtype, scaling, b in zip(grads, ctx.u_dtypes, ctx.scalings, bs, strict=True)]
        xs = _input(x, ctx.cast, ctx.autocast).reshape(-1, a.shape[1]) if x is not None else None
        grads_a: list[torch.Tensor | None] = [None] * n
        grads_b: list[torch.Tensor | None] = [None] * n
        if any(need_b):
            ts = xs.mm(a.t()).split(ctx.ranks, dim=1)  # recomputed, as the per-layer function does
            grads_b = [gu.t().mm(t).to(w.dtype) if need else None
                       for gu, t, w, need in zip(gus, ts, weights_b, need_b, strict=True)]
        grad_x = None
        if need_x or any(need_a):
            grad_t = torch.cat([gu.mm(b) for gu, b in zip(gus, bs, strict=True)], dim=1)
            if any(need_a):
                grads_a = [g.to(w.dtype) if need else None for g, w, need in
                           zip(grad_t.t().mm(xs).split(ctx.ranks), weights_a, need_a, strict=True)]
            if need_x:
                grad_x = grad_t.mm(a).reshape(ctx.x_shape).to(ctx.x_dtype)
        return grad_x, None, None, *grads_a, *grads_b, *grads


class FusedLoraLinear(LoraLinear):
    """PEFT's LoRA Linear whose forward adds the adapter with `LoraAddFunction` (or its group's
    `LoraGroupFunction`) when it can; PEFT's otherwise."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = None if args or kwargs else self._fusable_adapter()
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x)
        group: LoraGroup | None = self.__dict__.get("lora_group")
        if group is not None and (out := group.output(self, x, adapter)) is not None:
            return out
        weight_a, weight_b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return LoraAddFunction.apply(self.base_layer(x), x, weight_a, weight_b, self.scaling[adapter],
                                     self.input_cast(x, adapter))

    def input_cast(self, x: torch.Tensor, adapter: str) -> torch.dtype | None:
        """The dtype PEFT casts this layer's input to before the adapter (None: no cast)."""
        dtype = self.lora_A[adapter].weight.dtype
        cast_on = getattr(self, "cast_input_dtype_enabled", True)  # skip_adapter_input_casts turns it off
        return dtype if cast_on and x.dtype != dtype else None

    def _fusable_adapter(self) -> str | None:
        """The one active plain LoRA adapter this call can fuse, or None for PEFT's forward."""
        if self.disable_adapters or self.merged:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1 or unfusable(self, active[0]) is not None:
            return None
        return active[0]


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections that transformer blocks (Llama, Qwen and their kin) call one after another on one input."""


class LoraGroup:
    """Fused LoRA Linears of one block that the model calls on the same input, one after another: the first call
    computes every member's output (`LoraGroupFunction`) and keeps the others' until their own calls take them.

    Not a Module: parameters, names and state stay the members'. A member called on another input than the one
    its siblings were computed on (a model that does not share it) ends the grouping for good: each member then
    runs alone, with the same numbers (logged once)."""

    def __init__(self, name: str, members: list[FusedLoraLinear]) -> None:
        self.name, self.members, self.grouping = name, members, True
        self.x: torch.Tensor | None = None
        self.pending: dict[int, torch.Tensor] = {}

    def output(self, member: FusedLoraLinear, x: torch.Tensor, adapter: str) -> torch.Tensor | None:
        """`member`'s output for `x`, or None where it runs alone."""
        if self.x is x and id(member) in self.pending:
            out = self.pending.pop(id(member))
            if not self.pending:
                self.x = None
            return out
        if self.pending:
            log.warning("fused LoRA: %s are not called on one input; each runs alone from now on", self.name)
            self.grouping = False
        self.x, self.pending = None, {}
        cast = member.input_cast(x, adapter)
        if not self.grouping or any(m._fusable_adapter() != adapter or m.input_cast(x, adapter) != cast
                                    for m in self.members):
            return None
        ys = [m.base_layer(x) for m in self.members]
        outs = LoraGroupFunction.apply(
            x, cast, tuple(m.scaling[adapter] for m in self.members),
            *(m.lora_A[adapter].weight for m in self.members), *(m.lora_B[adapter].weight for m in self.members),
            *ys)
        self.x = x
        self.pending = {id(m): out for m, out in zip(self.members, outs, strict=True) if m is not member}
        return outs[self.members.index(member)]


def unfusable(layer: LoraLinear, adapter: str) -> str | None:
    """Why `adapter` of `layer` cannot be fused (None when it can)."""
    if type(layer.base_layer) is not nn.Linear:
        return f"its base is a {type(layer.base_layer).__name__}, not a torch Linear"
    if adapter in getattr(layer, "lora_variant", {}) or layer.use_dora.get(adapter, False):
        return "it is a DoRA (or other PEFT variant) adapter"
    if layer.lora_B[adapter].bias is not None:
        return "its adapter has a bias (lora_bias)"
    if not isinstance(layer.lora_dropout[adapter], nn.Identity):
        return "LoRA dropout is on (lora.dropout > 0)"
    return None


ZERO3_REFUSAL = ("lora.fused is on but this run uses DeepSpeed ZeRO-3, which gathers each LoRA weight in its own "
                 "module's forward, a call the fused layers skip. Set lora.fused: off (or auto), or use another "
                 "strategy (fsdp, zero2).")


def check_fused_lora(mode: str, strategy: str) -> None:
    """Fail in seconds, before the data work and the weights, where `lora.fused: on` cannot run (`strategy`: the
    launch's, as `toolkit.strategies.strategy_name` names it)."""
    if mode == "on" and strategy.startswith("zero3"):
        raise ToolkitError(ZERO3_REFUSAL)


class FusedLora(NamedTuple):
    """What `lora.fused` ran: the number of LoRA Linears fused, of those PEFT built, and why (for the log)."""

    fused: int
    layers: int
    why: str
    groups: int = 0


def install_fused_lora(model: nn.Module, mode: str, *, group: bool = True) -> FusedLora:
    """Apply `lora.fused: mode` to a PEFT LoRA model (after `get_peft_model`, before `accelerator.prepare`): swap
    each LoRA Linear's class for `FusedLoraLinear` (``on``), or keep PEFT's (``auto`` for now, ``off``, or LoRA
    dropout), and tie the layers that share an input into groups (`group`). ``on`` where a layer cannot be fused
    exactly is refused in one line. Logs and returns what ran."""
    if mode not in FUSED_LORA:
        raise ToolkitError(f"lora.fused is '{mode}'; choose one of {', '.join(FUSED_LORA)}.")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLinear)]
    others = sum(isinstance(m, LoraLayer) and not isinstance(m, LoraLinear) for m in model.modules())
    choice = _decide(model, mode, layers)
    groups = 0
    if choice.fused:
        for _, layer in layers:
            layer.__class__ = FusedLoraLinear  # the same object: parameters, names, hooks and state stay PEFT's
        groups = _group(model) if group else 0
    rest = f"; {others} other LoRA layer(s) stay PEFT's" if others else ""
    grouped = f", {groups} groups sharing an input (q/k/v, gate/up)" if groups else ""
    log.info("fused LoRA: %d of %d LoRA Linear layers%s (%s%s)", choice.fused, choice.layers, grouped, choice.why,
             rest)
    return choice._replace(groups=groups)


def _group(model: nn.Module) -> int:
    """Tie each block's fused q/k/v and gate/up (`GROUPS`, all adapted, one input size) into a `LoraGroup`;
    returns how many."""
    count = 0
    for parent_name, parent in model.named_modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, FusedLoraLinear) for m in members) and \
                    len({m.in_features for m in members}) == 1:  # type: ignore[union-attr]
                group = LoraGroup(f"{parent_name}.{'/'.join(names)}", members)  # type: ignore[arg-type]
                for m in members:
                    m.__dict__["lora_group"] = group  # a plain attribute: no submodule, no state
                count += 1
    return count


def _decide(model: nn.Module, mode: str, layers: list[tuple[str, LoraLinear]]) -> FusedLora:
    """Whether `mode` fuses `layers` here, and why; a refusal for ``on`` where they cannot run."""
    if mode == "off":
        return FusedLora(0, len(layers), "lora.fused: off, PEFT's layers")
    if mode == "auto":
        return FusedLora(0, len(layers), "lora.fused: auto runs PEFT's layers until a GPU has measured the fused "
                         "ones; lora.fused: on fuses them")
    if not layers:
        raise ToolkitError("lora.fused is on but the model has no LoRA Linear layers to fuse; set lora.fused: off "
                           "(or auto), or target Linear layers with lora.target_modules.")
    for name, layer in layers:
        why = next((w for a in layer.lora_A if (w := unfusable(layer, a)) is not None), None)
        if why == "LoRA dropout is on (lora.dropout > 0)":  # the rule: dropout falls back, with this line
            log.warning("lora.fused is on but LoRA dropout is on (lora.dropout > 0): a fused layer cannot replay "
                        "the dropout mask, so PEFT's layers run; set lora.dropout: 0 to fuse them")
            return FusedLora(0, len(layers), "lora.dropout > 0, PEFT's layers")
        if why is not None:
            raise ToolkitError(f"lora.fused is on but LoRA layer {name} cannot be fused: {why}. Set lora.fused: "
                               "off (or auto) to train with PEFT's layers.")
    if zero3_partitions(model):
        raise ToolkitError(ZERO3_REFUSAL)
    return FusedLora(len(layers), len(layers), "lora.fused: on; lora.fused: off runs PEFT's")
