"""Fused transformer layers: Liger-Kernel's Triton RMSNorm, rotary embedding and SwiGLU in place of the model's
own (`model.fused_layers`).

Why: in a LoRA step of Qwen3-8B on an H100 the stock layers are a kernel per elementwise operation (RMSNorm's
fp32 upcast, variance, scale; RoPE's rotate-and-add; SiLU times up): 35% of the GPU's busy time went to multiplies,
adds and casts, against 44% to the matmuls. Liger fuses each layer into one kernel and keeps less for backward
(RMSNorm its 16-bit input instead of an fp32 copy, SwiGLU gate and up without silu(gate)): 8805 -> 10974 tokens/s
(+24.6%), 43.8 -> 36.7 GiB at 4096 tokens, the same loss (docs/benchmarks.md). Liger is the field's library for
these kernels; the toolkit only decides when to use them and keeps its own loss head (`model.loss_head`).

``auto`` (the default) fuses on CUDA when liger-kernel is installed (the ``liger`` extra) and Liger supports the
model type; ``liger`` requires it (refused before the weights load where it cannot run); ``none`` keeps the
model's own layers. Liger's Triton kernels do not run in Triton's CPU interpreter (its RMSNorm and SwiGLU fail
there), so on the CPU ``auto`` is ``none`` and ``liger`` is refused; the GPU runs of docs/benchmarks.md are their
test. Liger patches the model's modules in place and its modelling module's functions for the process (one model
per training process).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from toolkit.errors import ToolkitError
from toolkit.model.loss_head import liger_available

log = logging.getLogger(__name__)

FUSED_LAYERS = ("auto", "liger", "none")
VERIFIED = ("qwen3",)
"""Model types `auto` fuses: those measured with Liger's layers on a GPU (docs/benchmarks.md). Liger 0.8.5's
Qwen2.5-VL and Qwen3-VL patches do not even import with transformers 5.24; `liger` tries any type Liger lists."""
FUSED = {"rope": True, "rms_norm": True, "swiglu": True}
NOT_THE_HEAD = {"cross_entropy": False, "fused_linear_cross_entropy": False}  # the loss head is model.loss_head's


def _liger_patches() -> dict[str, Callable[..., None]]:
    """Liger's apply function per transformers model_type."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return dict(MODEL_TYPE_TO_APPLY_LIGER_FN)


def check_fused_layers(kind: str) -> None:
    """Fail in seconds, before the model loads, where `model.fused_layers: liger` cannot run."""
    if kind not in FUSED_LAYERS:
        raise ToolkitError(f"model.fused_layers is '{kind}'; choose one of {', '.join(FUSED_LAYERS)}.")
    if kind == "liger" and not torch.cuda.is_available():
        raise ToolkitError("model.fused_layers is liger but there is no CUDA device: Liger's fused RMSNorm and "
                           "SwiGLU run on GPUs only; use auto (fused where it can run) or none.")
    if kind == "liger" and not liger_available():
        raise ToolkitError("model.fused_layers is liger but liger-kernel is not installed: pip install "
                           "'curriculum-toolkit[liger]', or use auto (fused where it can run) or none.")


class FusedLayers(NamedTuple):
    """What `model.fused_layers` runs for one model on this machine: ``liger`` or ``none``, and why (for the log)."""

    runs: str
    why: str


def resolve_fused_layers(kind: str, model_type: str) -> FusedLayers:
    """What `model.fused_layers: kind` runs on this machine for a model of `model_type`. Training (before the
    weights load) and preflight's memory estimate both decide with it."""
    check_fused_layers(kind)
    if kind == "none":
        return FusedLayers("none", "the model's own RMSNorm, RoPE and SwiGLU")
    if kind == "auto" and not (torch.cuda.is_available() and liger_available()):
        return FusedLayers("none", "model.fused_layers: auto fuses with Liger on CUDA when liger-kernel is installed")
    if model_type not in _liger_patches():
        if kind == "liger":
            raise ToolkitError(f"model.fused_layers is liger but Liger-Kernel has no fused layers for model type "
                               f"'{model_type}'; use auto or none.")
        return FusedLayers("none", f"Liger-Kernel has none for model type '{model_type}'")
    if kind == "auto" and model_type not in VERIFIED:
        return FusedLayers("none", f"auto fuses the model types measured with them, {', '.join(VERIFIED)}; "
                           f"model.fused_layers: liger tries Liger's for '{model_type}'")
    if kind == "liger":
        try:  # Liger's patch imports its modelling module first; one that cannot load fails here, before weights
            importlib.import_module(f"liger_kernel.transformers.model.{model_type}")
        except ModuleNotFoundError:
            pass  # patched without a module of its own
        except ImportError as e:
            raise ToolkitError(f"model.fused_layers is liger but Liger-Kernel's layers for '{model_type}' do not load "
                               f"with this transformers ({e}); use auto or none.") from None
    return FusedLayers("liger", f"{', '.join(FUSED)}; model.fused_layers: none turns them off")


def install_fused_layers(model: nn.Module, choice: FusedLayers) -> str:
    """Apply `choice` (`resolve_fused_layers` for this model's type) to the loaded base model, before LoRA and
    `accelerator.prepare`: Liger's kernels for its RMSNorm, rotary embedding and SwiGLU, or nothing. Logs and
    returns what runs: ``liger`` or ``none``."""
    if choice.runs == "liger":
        apply = _liger_patches()[str(model.config.model_type)]
        accepted = inspect.signature(apply).parameters
        apply(model=model, **{k: v for k, v in (FUSED | NOT_THE_HEAD).items() if k in accepted})
    log.info("fused layers: %s (%s)", choice.runs, choice.why)
    return choice.runs
