"""Attention kernels: which one runs, and packed rows without a T x T mask.

A packed row (`data.packing: true`) is one `[1, T]` sequence of several samples whose `position_ids` restart at 0.
transformers keeps the samples apart by itself, but the stock sdpa and eager paths do it with a dense boolean mask
of T x T elements (`masking_utils.create_causal_mask` -> `find_packed_sequence_indices`): 1 GiB per row at 32k
tokens, no causal fast path, no `enable_gqa` (sdpa expands the key/value heads by hand, `repeat_kv`), and attention
computed over the whole row. So the toolkit registers its own kernels through transformers' `AttentionInterface`
(and `AttentionMaskInterface` for their masks):

* ``sdpa_packed``: for a packed row, exact attention per sample span: PyTorch's varlen flash kernel
  (`torch.nn.attention.varlen.varlen_attn`) on CUDA in 16-bit, else `scaled_dot_product_attention` once per span
  with `is_causal=True` and `enable_gqa=True`. Nothing of T x T is built and each sample attends only to itself,
  as it would alone. Any other batch (padded rows, a KV cache, a sliding window) takes the stock sdpa path with
  the stock mask, unchanged to the bit.
* ``eager_packed``: the same span split around the model's own eager attention (a causal mask per span); the
  exact reference, for tests.
* ``fa4_packed``: ``sdpa_packed`` with FlashAttention-4 (the `flash-attn-4` package, `flash_attn.cute`, compiled
  just in time for sm90 / sm100) as the varlen kernel of packed rows, called directly with the collator's
  boundaries. Not through torch's `activate_flash_attention_impl("FA4")`: that swaps the flash kernels of every
  sdpa call in the process, and raises instead of falling back where FA4 cannot run (dropout, an unsupported
  head size); here everything but a packed row keeps the stock sdpa path. Not transformers' `flash_attention_4`
  either, which runs every batch (padded evals, generation) through FA4. No "flash" in the name: transformers
  treats such names as flash kernels of its own.
* ``flash_attention_2`` is transformers' own and already varlen: it gets the boundaries from the batch.

The boundaries come with the batch: the packing collator adds `cu_seq_lens_q/k` (int32 offsets) and
`max_length_q/k` (Python ints, so no kernel reads them back from the device) from `flash_boundaries`. They flow
through the model's `**kwargs` to every attention call. transformers still looks for position-id restarts when it
builds the mask (one host read per forward, `masking_utils.find_packed_sequence_indices`); the toolkit's mask
functions turn what it finds into the marker `PACKED_ROW` instead of a T x T mask. Without collator boundaries (a
packed row built elsewhere) the kernels read the restarts off `position_ids`, once per forward.

`model.attn_implementation: auto` takes the fastest exact kernel present: ``fa4_packed`` (flash4) on an sm90 / sm100
GPU with flash-attn-4, else flash_attention_2 on CUDA with flash-attn, else ``sdpa_packed`` (torch's varlen kernel on
CUDA, sdpa per span elsewhere); `sdpa` and `eager` name the toolkit's kernels too (identical on unpacked batches). A
recipe that names a kernel this machine cannot run is refused in one line (`choose_attention`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import itertools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from toolkit.data.packing import flash_boundaries
from toolkit.errors import ToolkitError

log = logging.getLogger(__name__)

SDPA_PACKED = "sdpa_packed"
EAGER_PACKED = "eager_packed"
FA4_PACKED = "fa4_packed"
RECIPE_TO_KERNEL = {"sdpa": SDPA_PACKED, "eager": EAGER_PACKED, "flash_attention_2": "flash_attention_2",
                    "flash4": FA4_PACKED}
FA4_DISTRIBUTION = "flash-attn-4"  # installs the `flash_attn.cute` package (flash-attn, FA2, ships a `cute` folder too)
FA4_MAJORS = (9, 10)  # compute capabilities FA4's kernels are written for: sm90 (Hopper), sm100 (Blackwell)
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# ------------------------------------------------------------------------------------------- the kernels


def _varlen_attn() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def _fa4_varlen() -> Callable[..., Any] | None:
    """FlashAttention-4's varlen function, or None without flash-attn-4 (an installed package that fails to import
    raises: `fa4_unavailable` reports it before a model loads)."""
    if not _installed(FA4_DISTRIBUTION):
        return None
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def _installed(distribution: str) -> bool:
    """Whether a distribution is installed. By distribution, not import name: flash-attn (FA2) and flash-attn-4 both
    install under `flash_attn`."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@functools.cache
def _parameters(function: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def _causal_varlen(varlen: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu: torch.Tensor, longest: int, scale: float | None) -> torch.Tensor:
    """Causal varlen attention over `[T, heads, d]` tensors in the form this torch's `varlen_attn` takes: causal
    through `window_size=(-1, 0)` (torch 2.11 on) or `is_causal=True` (2.10, which had no window); grouped heads
    through `enable_gqa` where it exists, else key/value heads repeated to the query's."""
    params = _parameters(varlen)
    options: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return varlen(q, k, v, cu, cu, longest, longest, **options)


def _causal_fa4(flash: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                longest: int, scale: float | None) -> torch.Tensor:
    """Causal varlen attention of FlashAttention-4 over `[T, heads, d]` tensors: grouped key/value heads go in as
    they are (FA4 packs the query heads of a group itself), `longest` as the host int it is, where this version's
    function takes it (transformers checks the same: not every FA4 release has max_seqlen parameters)."""
    lengths = {"max_seqlen_q": longest, "max_seqlen_k": longest} if "max_seqlen_q" in _parameters(flash) else {}
    out = flash(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **lengths, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out  # (out, lse) from the 4.0 betas


class _HostCache:
    """One value per tensor object, recomputed when the object changes. Every layer of a forward gets the same
    `cu_seq_lens` (or `position_ids`) tensor, so only the first layer reads it back to the host: one device sync per
    forward on a GPU, none on the CPU where the collator built the boundaries."""

    def __init__(self, compute: Callable[[torch.Tensor], Any]) -> None:
        self.compute, self.source, self.value = compute, None, None

    def __call__(self, tensor: torch.Tensor) -> Any:
        if tensor is not self.source:
            self.source, self.value = tensor, self.compute(tensor)
        return self.value


def _spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    """The non-empty sample spans: `train.compile` pads cu_seq_lens with repeats of its last offset
    (toolkit/model/compile.py), empty spans that attend to nothing."""
    return [(a, b) for a, b in itertools.pairwise(cu.tolist()) if b > a]


def _boundaries_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens, max_length) of a packed row from its restarting position_ids (one host read per forward)."""
    if position_ids.ndim != 2 or position_ids.shape[0] != 1 or int(position_ids[0, 0]) != 0:
        raise ValueError("packed rows with sdpa_packed / eager_packed must come as one row whose position_ids start "
                         "at 0 (toolkit.data.packing.PackedCollator's layout)")
    found = flash_boundaries(position_ids.cpu())
    return found["cu_seq_lens_q"].to(position_ids.device), found["max_length_q"]


_SPANS = _HostCache(_spans)
_FROM_POSITIONS = _HostCache(_boundaries_from_positions)


@torch.compiler.disable
def _from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`_FROM_POSITIONS`, out of any compiled layer: it reads position_ids back to the host."""
    return _FROM_POSITIONS(position_ids)


PACKED_ROW = torch.empty(0)
"""The mask the toolkit's mask functions give a row whose position_ids restart: transformers has found the
restarts itself (`find_packed_sequence_indices`, which then turns off `allow_is_causal_skip`), so the kernel splits
the row at its sample boundaries instead of receiving a T x T mask. A marker, not a mask: only these kernels read
it, and anything that tried to use it as a mask would fail on its shape."""


def _packed_boundaries(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                       kwargs: dict[str, Any]) -> tuple[torch.Tensor, int] | None:
    """(cu_seq_lens, max_length) when this call is one packed row: the batch's boundaries (the collator's) or,
    failing those, its position_ids' restarts; None for every other call (padding, a KV cache, a window)."""
    cu = kwargs.get("cu_seq_lens_q")  # self-attention: the key boundaries are the query ones
    if attention_mask is PACKED_ROW:
        if cu is not None:
            return cu, int(kwargs["max_length_q"])
        position_ids = kwargs.get("position_ids")
        if not isinstance(position_ids, torch.Tensor):
            raise ValueError("a packed row reached the attention kernel without position_ids or cu_seq_lens_q")
        return _from_positions(position_ids)
    if attention_mask is None and cu is not None and query.shape[0] == 1 and key.shape[2] == query.shape[2]:
        return cu, int(kwargs["max_length_q"])  # boundaries given without restarting position_ids
    return None


def varlen_runs(query: torch.Tensor, dropout: float) -> bool:
    """Whether PyTorch's varlen flash kernel takes this call: CUDA, 16-bit, no dropout (it has none)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0


@torch.compiler.disable
def _per_span(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], query: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """`attend(q, k, v)` (each `[1, heads, s, d]`, output `[1, s, heads, d]`) on every sample span, concatenated
    along the sequence: the exact block-diagonal causal attention, with no T x T tensor anywhere.

    Left out of a compiled layer (`train.compile`, a graph break): the split reads the boundaries on the host and
    loops over them, which no graph can hold; the layer's other work is compiled around it."""
    outs = [attend(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]) for a, b in _SPANS(cu)]
    return torch.cat(outs, dim=1)


def _packed_or_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, kwargs: dict[str, Any],
                    *, fa4: bool) -> tuple[torch.Tensor, None]:
    """transformers' sdpa for every batch but a packed row; for a packed row, a varlen kernel (CUDA, 16-bit: FA4 when
    `fa4` and it is installed, else torch's) or sdpa per span with `is_causal` and `enable_gqa` (key/value heads are
    never repeated by hand)."""
    packed = _packed_boundaries(query, key, attention_mask, kwargs)
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    cu, longest = packed
    if varlen_runs(query, dropout):
        flash = _fa4_varlen() if fa4 else None
        varlen = _varlen_attn() if flash is None else None
        if flash is not None or varlen is not None:
            cu = cu.to(device=query.device, dtype=torch.int32)
            q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, d]
            out = (_causal_fa4(flash, q, k, v, cu, longest, scaling) if flash is not None
                   else _causal_varlen(varlen, q, k, v, cu, longest, scaling))
            return out.unsqueeze(0), None
    gqa = key.shape[1] != query.shape[1]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling,
                                                               is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2)

    return _per_span(attend, query, key, value, cu).contiguous(), None


def sdpa_packed_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa for every batch but a packed row; a packed row through torch's varlen kernel (CUDA,
    16-bit) or sdpa per span."""
    return _packed_or_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs, fa4=False)


def fa4_packed_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`sdpa_packed_forward` with FlashAttention-4 as the varlen kernel of packed rows (CUDA, 16-bit)."""
    return _packed_or_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs, fa4=True)


def _model_eager(module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The model's own eager attention: every transformers modeling file defines `eager_attention_forward`."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ToolkitError(f"{type(module).__name__} has no eager_attention_forward; use attn_implementation sdpa.")
    return eager


def eager_packed_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The model's eager attention; a packed row goes through it span by span, each with its own causal mask."""
    eager = _model_eager(module)
    packed = _packed_boundaries(query, key, attention_mask, kwargs)
    if packed is None:
        if attention_mask is None and query.shape[2] > 1:  # eager needs the causal mask spelt out
            attention_mask = _causal(query.shape[2], key.shape[2], query)
        return eager(module, query, key, value, attention_mask, **kwargs)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return eager(module, q, k, v, _causal(q.shape[2], k.shape[2], q), **kwargs)[0]

    return _per_span(attend, query, key, value, packed[0]), None


def _causal(q_len: int, kv_len: int, like: torch.Tensor) -> torch.Tensor:
    """An additive causal mask `[1, 1, q_len, kv_len]` (bottom-right aligned) in `like`'s dtype."""
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=like.device).tril(kv_len - q_len)
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(allowed, zero, torch.finfo(like.dtype).min)[None, None]


# ------------------------------------------------------------------------------------------- the masks


def _unpadded_causal_row(kwargs: dict[str, Any]) -> bool:
    """A causal mask (`create_causal_mask` passes allow_is_causal_skip; bidirectional ones do not) over rows with no
    padding, no cache offset, no window and no custom overlay (use_vmap): the kernel needs no mask for it."""
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    return ("allow_is_causal_skip" in kwargs and not kwargs.get("use_vmap") and kwargs.get("local_size") is None
            and kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length")
            and isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0)


def sdpa_packed_mask(**kwargs: Any) -> torch.Tensor | None:
    """For an unpadded causal row: None (causal, sdpa's `is_causal`), or PACKED_ROW when transformers found
    position-id restarts (it then forbids the causal skip). The stock sdpa mask for everything else."""
    if _unpadded_causal_row(kwargs):
        return None if kwargs["allow_is_causal_skip"] else PACKED_ROW
    return sdpa_mask(**kwargs)


def eager_packed_mask(**kwargs: Any) -> torch.Tensor | None:
    """As `sdpa_packed_mask`, with the stock eager (additive) mask where one is needed."""
    if _unpadded_causal_row(kwargs):
        return None if kwargs["allow_is_causal_skip"] else PACKED_ROW
    return eager_mask(**kwargs)


def register_kernels() -> None:
    """Make the toolkit's kernels known to transformers (idempotent; before a model is loaded with one)."""
    AttentionInterface.register(SDPA_PACKED, sdpa_packed_forward)
    AttentionInterface.register(EAGER_PACKED, eager_packed_forward)
    AttentionInterface.register(FA4_PACKED, fa4_packed_forward)
    AttentionMaskInterface.register(SDPA_PACKED, sdpa_packed_mask)
    AttentionMaskInterface.register(FA4_PACKED, sdpa_packed_mask)  # the same masks: only packed rows differ
    AttentionMaskInterface.register(EAGER_PACKED, eager_packed_mask)


register_kernels()


# ------------------------------------------------------------------------------------------- the choice


def fa4_unavailable() -> str | None:
    """Why FlashAttention-4 cannot run in this process (one clause, with what to install or use), or None when it
    can: flash-attn-4 installed and importable, a CUDA GPU of compute capability 9.x or 10.x."""
    if not _installed(FA4_DISTRIBUTION):
        return f"{FA4_DISTRIBUTION} is not installed: pip install 'curriculum-toolkit[flash4]' (sm90 / sm100 GPUs)"
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs a CUDA GPU (sm90 Hopper or sm100 Blackwell) and there is none"
    major, minor = torch.cuda.get_device_capability()
    if major not in FA4_MAJORS:
        return (f"FlashAttention-4 runs on sm90 (Hopper) and sm100 (Blackwell) GPUs; {torch.cuda.get_device_name()} "
                f"is sm{major}{minor}")
    try:
        _fa4_varlen()
    except ImportError as e:  # a missing or mismatched dependency (nvidia-cutlass-dsl, cuda-bindings)
        return f"{FA4_DISTRIBUTION} is installed but does not import ({e}); reinstall it"
    return None


def choose_attention(requested: str) -> str:
    """The kernel a recipe's `model.attn_implementation` runs, logged with why; a kernel that cannot run here is
    refused in one line (before the weights load).

    `auto`: the fastest exact kernel present, FlashAttention-4 (``fa4_packed``) on an sm90 / sm100 GPU with
    flash-attn-4, else flash_attention_2 when flash-attn is installed and CUDA is present (varlen by design), else
    ``sdpa_packed`` (on CUDA its packed rows use PyTorch's varlen flash kernel in 16-bit; elsewhere sdpa per sample
    span). `sdpa` / `eager` are the toolkit's span-exact versions of transformers' kernels.
    """
    flash2 = _installed("flash-attn")
    if requested == "flash_attention_2" and not flash2:
        raise ToolkitError("model.attn_implementation is flash_attention_2 but flash-attn is not installed: "
                           "pip install 'curriculum-toolkit[flash]' (needs CUDA), or use auto or sdpa.")
    if requested == "flash_attention_2" and not torch.cuda.is_available():
        raise ToolkitError("model.attn_implementation is flash_attention_2 but there is no CUDA device: use auto or "
                           "sdpa.")
    fa4_why = fa4_unavailable() if requested in ("auto", "flash4") else None
    if requested == "flash4" and fa4_why is not None:
        raise ToolkitError(f"model.attn_implementation is flash4 but {fa4_why}; or use auto or sdpa.")
    if requested == "auto":
        if fa4_why is None:
            requested = "flash4"
        else:
            requested = "flash_attention_2" if flash2 and torch.cuda.is_available() else "sdpa"
            if _installed(FA4_DISTRIBUTION):
                # Not "attention: ...": bench/gpu_qwen3_8b.py reads the kernel from that line.
                log.info("FlashAttention-4 is installed but not used: %s", fa4_why)
    kernel = RECIPE_TO_KERNEL[requested]
    torch_varlen = torch.cuda.is_available() and _varlen_attn() is not None
    packed_rows = {FA4_PACKED: "FlashAttention-4 varlen in 16-bit, else sdpa per sample",
                   "flash_attention_2": "flash-attn varlen",
                   SDPA_PACKED: ("PyTorch varlen flash in 16-bit, else sdpa per sample" if torch_varlen
                                 else "sdpa per sample"),
                   EAGER_PACKED: "eager per sample"}[kernel]
    log.info("attention: %s (packed rows: %s, no T x T mask)", kernel, packed_rows)
    return kernel


# Attention implementations that honour position-id restarts (see the module docstring).
PACKING_ATTENTION = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                               SDPA_PACKED, EAGER_PACKED, FA4_PACKED})


def check_packing_support(model: torch.nn.Module) -> None:
    """Raise ValueError unless `model` (plain or PEFT-wrapped) will keep packed samples apart.

    transformers only splits a flattened row at position-id restarts when there is no KV cache, so
    `config.use_cache` must be False, and the attention implementation must be one that uses the restarts.
    """
    config = model.config
    attn = getattr(config, "_attn_implementation", None)
    if attn not in PACKING_ATTENTION:
        raise ValueError(f"packing needs one of {sorted(PACKING_ATTENTION)} attention, the model uses {attn!r}")
    if getattr(config, "use_cache", False) or getattr(config.get_text_config(), "use_cache", False):
        raise ValueError("packing needs model.config.use_cache = False: with a KV cache transformers ignores the "
                         "position-id restarts and packed samples attend to each other")
