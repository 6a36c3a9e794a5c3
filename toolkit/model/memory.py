"""Per-GPU memory of a fine-tuning run, estimated before launch.

The estimate answers "which strategy fits on these GPUs?" without loading weights: the model skeleton is built
on the meta device (exact parameter shapes, LoRA included) and each strategy's layout is applied to it.
`toolkit.strategies.measure.measure_rank_state_bytes` counts what a rank really holds after an optimizer step,
so the estimate can be checked against reality (tests/model/test_memory.py does so for DDP, ZeRO-2, ZeRO-3 and
FSDP2, LoRA and full fine-tuning).

Accounting (bytes per GPU; W = number of GPUs, the data-parallel and sharding degree; "trainable" are the
parameters the optimizer updates, "frozen" the rest):

* weights: frozen weights take ``param_bytes`` each. Trainable weights too, except LoRA adapters, which PEFT
  keeps in fp32 (4 bytes) over a 16-bit base; under DeepSpeed with 16-bit weights the engine casts the whole
  module, adapters included, to 16 bits.
* gradients: one per trainable weight, in the weight's dtype.
* optimizer: AdamW's exp_avg and exp_avg_sq, 8 bytes per trainable weight, plus a 4-byte fp32 master copy
  under DeepSpeed, which keeps one even when the weights are already fp32 (measured with deepspeed 0.19):
  ZeRO-1/2 always clone the partition they update (``single_partition_of_fp32_groups``), and ZeRO-3's
  ``fp32_partitioned_groups_flat`` would alias fp32 weight partitions only if a ``torch.device`` compared
  equal to the device *string* it is checked against, which it never does, so it clones too. Plain torch
  (single, DDP, FSDP2) steps the weights in place: no master.
* sharding: ``single``/``ddp`` replicate everything; ``zero2`` shards gradients and optimizer state (1/W);
  ``zero3`` and ``fsdp`` (FSDP2) shard weights too. ZeRO-3 keeps parameters with at most
  ``persistence_threshold`` elements (accelerate's "auto": 10 * hidden) whole on every rank, in addition to
  their partition. ``zero3_offload`` moves weight partitions, gradient partitions, masters and optimizer
  state to CPU RAM (``cpu_offload``, summed over the node's W ranks); only persistent weights stay on the GPU.
  ``zero2_offload`` (ZeRO-2 with ``offload_optimizer`` on the CPU) keeps the whole weights on the GPU and moves
  each rank's fp32 gradient partition, master and optimizer state to CPU RAM.
* buffers (working set outside the persistent state): DDP's reducer keeps a bucketed copy of all gradients
  (``gradient_as_bucket_view`` is off by default); ZeRO-2/3 keep a reduce bucket of hidden^2 elements
  (accelerate's "auto" ``reduce_bucket_size``); ZeRO-3 also gathers the largest single weight plus a prefetch
  bucket of 2e8 elements (the shipped configs' ``stage3_prefetch_bucket_size``, at most the whole model);
  FSDP2 gathers the root module (embeddings, head, final norm: kept unsharded through forward and backward)
  plus two decoder layers (current and prefetched) and one layer's unsharded gradients.
* activations, for T = micro_batch * seq_len tokens and ``activation_bytes`` b per element (2 under bf16 autocast or a
  bf16 model, the shipped launch configs), after Korthikanti et al. 2022 for GQA + SwiGLU with an SDPA/flash kernel
  (no seq^2 score matrix is stored), checked per term against the tensors autograd saves
  (tests/model/test_activation_memory.py, 1k-16k tokens, within 15%). One decoder layer saves per token
      (2*h + 3*a*d + 2*k*d + 4*i) * b  +  (2*h + qk) * 4  bytes
  (the matmul inputs (two norm outputs, the attention output), q, k, v and the kernel's output, the MLP's gate, up,
  silu(gate) and product; RMSNorm normalises in fp32 and keeps that fp32 input, as do Qwen3's per-head q/k norms, qk =
  a*d + k*d). With Liger's fused layers (toolkit/model/fused_layers.py) the norms keep their input in b and SwiGLU
  recomputes silu(gate): (2*h + 3*a*d + 2*k*d + 3*i) * b + (2*h + qk) * b. A frozen Linear keeps no input (its weight
  needs no gradient): the matmul inputs are kept by the LoRA adapters (or the trained weights) beside it, once per
  input in b. fp32 LoRA adapters over a 16-bit base without autocast keep (5*h + a*d + i) * 4 instead of (2*h + a*d +
  i) * b: PEFT casts each adapted Linear's input to fp32 and each keeps its own copy, q, k and v three of the same
  input (under autocast the toolkit turns the cast off: toolkit.model.load.skip_adapter_input_casts). Without
  checkpointing all L layers are kept: L*T*e. With checkpointing only each layer's input is kept, L*T*h*r (r: bytes of
  the hidden states, the weights' dtype), plus one layer recomputed in backward, T*e; with N of L layers checkpointed
  (``model.gradient_checkpointing: N``, the first N) N*T*h*r + (L-N)*T*e (backward recomputes the first N after
  the others are freed). Under Ulysses sequence parallelism
  (``sp_size``) each process holds T/sp_size tokens of every layer (attention's all-to-all gives it all T tokens of
  heads/sp_size heads: as many elements), and its loss head only its slice's. Shared by all layers: rotary
  cos/sin (2*d*r) and the final norm's fp32 input (4*h). The loss head adds C*V*(b + 8) (the logits, and the fp32
  log-softmax and gradient the cross-entropy makes) for C tokens: all T with ``model.loss_head: standard``; one chunk,
  C = min(T, loss_chunk_size), with the chunked head (toolkit/model/loss_head.py, the default), plus T*h*4 for the
  gradient of the hidden states it selects. On CPU the whole step matches a measured one within 7% up to 4096 tokens
  (bench/loss_head_memory.py, tests/model/test_memory.py; at 16384 the measured step is 25% larger, outside what
  autograd saves: docs/benchmarks.md). Vision-tower activations of VL models depend on the images and are not included.

The estimate counts persistent state exactly; activations and buffers are first-order approximations (the
allocator's fragmentation and the CUDA context come on top: see ``format_table``'s headroom).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError
from toolkit.model.params import param_table

MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"
SHIPPED_CONFIGS: dict[str, str] = {
    "qwen3-8b": "qwen3-8b.json",
    "qwen/qwen3-8b": "qwen3-8b.json",
    "qwen/qwen3-8b-base": "qwen3-8b.json",
    "qwen2_5-vl-7b": "qwen2_5-vl-7b.json",
    "qwen2.5-vl-7b": "qwen2_5-vl-7b.json",
    "qwen/qwen2.5-vl-7b-instruct": "qwen2_5-vl-7b.json",
    "qwen3-vl-8b": "qwen3-vl-8b.json",
    "qwen/qwen3-vl-8b-instruct": "qwen3-vl-8b.json",
    "qwen/qwen3-vl-8b-thinking": "qwen3-vl-8b.json",
}
"""Model names (lower case) that resolve to a config shipped in toolkit/model/model_configs (no download needed)."""

STRATEGIES = ("single", "ddp", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp")
# Preference when several strategies fit: fewer and cheaper collectives first. DDP all-reduces gradients once
# per step; ZeRO-2 replaces that with a reduce-scatter plus a weight all-gather; FSDP2 and ZeRO-3 all-gather
# every layer's weights in forward and again in backward; offload adds PCIe traffic and a CPU optimizer step.
# FSDP2 goes before ZeRO-3: same sharding, but per-layer collectives instead of DeepSpeed's per-module fetches.
# ZeRO-2 with optimizer offload is estimated (an accelerate config of the user's may select it) but never
# recommended: no config of ours selects it.
PREFERENCE = ("single", "ddp", "zero2", "fsdp", "zero3", "zero3_offload")
GIB = 1024**3
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weight
FP32_GRAD_BYTES = 4  # ZeRO-2 optimizer offload accumulates gradients into an fp32 partition on the CPU
ZERO3_PREFETCH_BUCKET = 200_000_000  # ds_configs/zero3*.json's stage3_prefetch_bucket_size (the reason is there)

_LAYER_RE = re.compile(r"\.(?:layers|blocks|h)\.(\d+)\.")


# --------------------------------------------------------------------------------------------- model configs


def load_model_config(name_or_path: str | Path) -> Any:
    """A transformers config: a shipped name (``Qwen/Qwen3-8B``, ``qwen3-8b``, ...) or a local model directory."""
    from transformers import AutoConfig

    key = str(name_or_path).strip().lower()
    if key in SHIPPED_CONFIGS:
        data = json.loads((MODEL_CONFIG_DIR / SHIPPED_CONFIGS[key]).read_text(encoding="utf-8"))
        return AutoConfig.for_model(**data)
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path)
    raise ToolkitError(
        f"Unknown model '{name_or_path}': not a shipped config and not a directory with config.json. "
        f"Known names: {', '.join(sorted(SHIPPED_CONFIGS))}; or give a local model directory.")


# ------------------------------------------------------------------------------------------------- estimate


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _norm_input_bytes(activation_bytes: int, fused_layers: bool) -> int:
    """Bytes per element of the input an RMSNorm keeps: stock ones normalise in fp32 and keep that fp32 input,
    Liger's keep the 16-bit one."""
    return activation_bytes if fused_layers else 4


def layer_activation_bytes(config: Any, *, activation_bytes: int, adapter_input_copies: bool = False,
                           fused_layers: bool = False) -> int:
    """Bytes one decoder layer saves for backward per token (see the module docstring; counted against autograd's
    saved tensors in tests/model/test_activation_memory.py). ``fused_layers``: Liger's RMSNorm keeps its 16-bit input
    instead of an fp32 copy, its SwiGLU gate and up without silu(gate) (toolkit/model/fused_layers.py; 1% under the
    measured H100 peak of Qwen3-8B LoRA at 4096 tokens, docs/benchmarks.md)."""
    c = config.get_text_config()
    h, inter = c.hidden_size, c.intermediate_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    qk_norm = q + kv if "qwen3" in str(getattr(c, "model_type", "")) else 0  # Qwen3's per-head q/k RMSNorms
    matmul_inputs = 2 * h + q + inter  # the two norms' outputs, the attention output, the MLP product
    rest = 2 * q + 2 * kv + (2 if fused_layers else 3) * inter  # the kernel's q, k, v and output; gate, up (and
    # silu(gate), which Liger's SwiGLU recomputes)
    norm_inputs = 2 * h + qk_norm  # the two RMSNorms' inputs, and Qwen3's q/k norms'
    norm_bytes = _norm_input_bytes(activation_bytes, fused_layers)
    if adapter_input_copies:  # PEFT's fp32 cast: each adapted Linear keeps its own copy (q, k, v: three of one)
        return rest * activation_bytes + norm_inputs * norm_bytes + (5 * h + q + inter) * 4
    return (matmul_inputs + rest) * activation_bytes + norm_inputs * norm_bytes


def activation_memory(config: Any, *, tokens: int, grad_ckpt: bool | int, activation_bytes: int,
                      loss_head: str = "chunked", loss_chunk_size: int | None = None,
                      residual_bytes: int | None = None, adapter_input_copies: bool = False,
                      fused_layers: bool = False) -> int:
    """Activation bytes of one micro-batch of ``tokens`` tokens: the decoder layers' (see the module docstring)
    plus the loss head's working set, ``loss_bytes``. ``residual_bytes``: the hidden states between layers (the
    weights' dtype; default ``activation_bytes``); ``adapter_input_copies``: fp32 LoRA adapters on a 16-bit base
    without autocast, where PEFT casts every adapted layer's input to fp32 (all-linear targets)."""
    c = config.get_text_config()
    h, layers = c.hidden_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    res = residual_bytes or activation_bytes
    per_layer = layer_activation_bytes(config, activation_bytes=activation_bytes,
                                       adapter_input_copies=adapter_input_copies, fused_layers=fused_layers)
    final_norm = _norm_input_bytes(activation_bytes, fused_layers) * h
    shared = 2 * head_dim * res + final_norm  # rotary cos and sin (all layers share them); the final norm's input
    # Checkpointed layers keep their input (the residual stream) and one of them is recomputed at a time in backward;
    # the others keep everything. `model.gradient_checkpointing: N` checkpoints the first N: backward reaches them
    # after the later, whole layers are freed, so their recomputation never adds to the peak at backward's start.
    recomputed = layers if grad_ckpt is True else min(int(grad_ckpt), layers)
    kept = recomputed * h * res + (layers - recomputed) * per_layer + (per_layer if recomputed == layers else 0)
    return tokens * (kept + shared) + loss_bytes(config, tokens=tokens, activation_bytes=activation_bytes,
                                                 loss_head=loss_head, loss_chunk_size=loss_chunk_size)


def loss_bytes(config: Any, *, tokens: int, activation_bytes: int, loss_head: str = "chunked",
               loss_chunk_size: int | None = None) -> int:
    """The loss head's working set. Standard: the ``[tokens x V]`` logits (``activation_bytes`` each) plus their
    fp32 log-softmax and its gradient, for every token. Chunked (``auto`` and ``liger`` are counted alike): the
    same for one chunk of at most ``loss_chunk_size`` tokens (default ``loss_head.default_chunk_tokens``), plus
    the gradient of the selected hidden states (fp32, ``tokens x hidden``)."""
    c = config.get_text_config()
    vocab, hidden = int(c.vocab_size), int(c.hidden_size)
    per_token = vocab * (activation_bytes + 8)
    if loss_head == "standard":
        return tokens * per_token
    from toolkit.model.loss_head import default_chunk_tokens

    chunk = min(tokens, loss_chunk_size or default_chunk_tokens(vocab))
    return chunk * per_token + tokens * hidden * 4


def kv_cache_bytes(config: Any, *, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """Bytes of the KV cache one `generate` call holds at its end: `sequences` rows of `tokens` positions each
    (left-padded prompt + completion: at most the stage's max_seq_len), every decoder layer keeping a key and a
    value of kv_heads x head_dim per position, in the dtype the k/v projections compute in (`dtype_bytes`: 2 under
    bf16 autocast or a 16-bit base, else 4). transformers' DynamicCache grows to exactly this, padding included."""
    c = config.get_text_config()
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return sequences * tokens * int(c.num_hidden_layers) * 2 * kv_heads * head_dim * dtype_bytes


def estimate(config: Any, *, strategy: str, num_gpus: int, lora_r: int | None, param_bytes: int,
             micro_batch: int, seq_len: int, grad_ckpt: bool | int, lora_targets: str | Iterable[str] = "all-linear",
             activation_bytes: int = 2, persistence_threshold: int | None = None, loss_head: str = "chunked",
             loss_chunk_size: int | None = None, residual_bytes: int | None = None,
             adapter_input_copies: bool = False, fused_layers: bool = False, sp_size: int = 1) -> dict[str, int]:
    """Bytes per GPU of ``params``, ``grads``, ``optimizer``, ``activations``, ``buffers`` and their ``total``,
    plus ``cpu_offload`` (CPU RAM of the whole node), for one strategy; see the module docstring. ``sp_size``:
    Ulysses sequence parallelism (DeepSpeed strategies only): each GPU's activations are its slice's.

    ``param_bytes`` is the size of a weight as held during training: 4 for fp32 weights (DDP / FSDP2 under
    autocast, or no mixed precision), 2 for bf16 weights (a bf16 LoRA base, or DeepSpeed with bf16 enabled,
    which casts the model to bf16).
    """
    if strategy not in STRATEGIES:
        raise ToolkitError(f"Unknown strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}.")
    world = 1 if strategy == "single" else int(num_gpus)
    if world < 1:
        raise ToolkitError(f"num_gpus must be at least 1, got {num_gpus}.")
    text = config.get_text_config()
    hidden = int(text.hidden_size)
    table = param_table(config, lora_r, lora_targets)
    deepspeed = strategy.startswith("zero")
    offload = strategy.endswith("_offload")
    lora = bool(lora_r)
    t_bytes = param_bytes if (not lora or (deepspeed and param_bytes < 4)) else 4
    g_bytes = t_bytes
    master = MASTER_BYTES if deepspeed else 0

    trainable = sum(n for _, n, t in table if t)
    weight_bytes = sum(n * (t_bytes if t else param_bytes) for _, n, t in table)
    reduce_bucket = hidden * hidden  # accelerate's "auto" reduce_bucket_size
    cpu = 0
    if strategy in ("single", "ddp"):
        params, grads = weight_bytes, trainable * g_bytes
        optimizer = trainable * (ADAM_BYTES + master)
        buffers = grads if strategy == "ddp" and world > 1 else 0
    elif strategy.startswith("zero2"):
        shard = _ceil_div(trainable, world)
        buffers = min(reduce_bucket, trainable) * g_bytes
        if offload:  # the fp32 gradient partition, master and Adam state live on the CPU for the whole run
            params, grads, optimizer = weight_bytes, 0, 0
            cpu = world * shard * (FP32_GRAD_BYTES + ADAM_BYTES + master)
        else:
            params, grads = weight_bytes, shard * g_bytes
            optimizer = shard * (ADAM_BYTES + master)
    elif strategy.startswith("zero3"):
        threshold = 10 * hidden if persistence_threshold is None else persistence_threshold
        persistent = partitions = 0
        for _, n, t in table:
            nbytes = t_bytes if t else param_bytes
            part = _ceil_div(n, world) * nbytes
            if n <= threshold:
                persistent += n * nbytes + part  # whole weight on every rank, plus its partition
            else:
                partitions += part
        shard = sum(_ceil_div(n, world) for _, n, t in table if t)
        largest = max(n for _, n, _ in table)
        prefetch = min(ZERO3_PREFETCH_BUCKET, sum(n for _, n, _ in table))
        buffers = (largest + prefetch) * param_bytes + min(reduce_bucket, trainable) * g_bytes
        if offload:
            params, grads, optimizer = persistent, 0, 0
            cpu = world * (partitions + shard * (g_bytes + ADAM_BYTES + master))
        else:
            params, grads = persistent + partitions, shard * g_bytes
            optimizer = shard * (ADAM_BYTES + master)
    else:  # fsdp: FSDP2 shards every parameter along dim 0 (padded to a multiple of W)
        params = sum(_ceil_div(n, world) * (t_bytes if t else param_bytes) for _, n, t in table)
        shard = sum(_ceil_div(n, world) for _, n, t in table if t)
        grads, optimizer = shard * g_bytes, shard * ADAM_BYTES
        units: dict[str, list[int]] = {}
        for name, n, t in table:
            match = _LAYER_RE.search(name)
            unit = name[: match.end()] if match else "<root>"
            units.setdefault(unit, [0, 0])
            units[unit][0] += n * (t_bytes if t else param_bytes)
            units[unit][1] += n * g_bytes if t else 0
        root_bytes, root_grads = units.pop("<root>", [0, 0])
        layer_bytes = max((u[0] for u in units.values()), default=0)
        layer_grads = max((u[1] for u in units.values()), default=0)
        buffers = root_bytes + 2 * layer_bytes + max(layer_grads, root_grads) if world > 1 else 0
    sliced = sp_size if deepspeed else 1  # DDP and FSDP2 have no Ulysses (refused at launch)
    activations = activation_memory(config, tokens=_ceil_div(micro_batch * seq_len, sliced), grad_ckpt=grad_ckpt,
                                    activation_bytes=activation_bytes, loss_head=loss_head,
                                    loss_chunk_size=loss_chunk_size, residual_bytes=residual_bytes,
                                    adapter_input_copies=adapter_input_copies, fused_layers=fused_layers)
    total = params + grads + optimizer + activations + buffers
    return {"params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
            "buffers": buffers, "total": total, "cpu_offload": cpu}


def estimate_all(config: Any, *, num_gpus: int, strategies: Iterable[str] = STRATEGIES, **kwargs: Any
                 ) -> dict[str, dict[str, int]]:
    """`estimate` for several strategies (``single`` only when num_gpus is 1), keyed by strategy."""
    return {s: estimate(config, strategy=s, num_gpus=num_gpus, **kwargs)
            for s in strategies if s != "single" or num_gpus == 1}


Rows = Mapping[str, Mapping[str, int]] | Iterable[tuple[str, Mapping[str, int]]]


def recommend(rows: Rows, gpu_memory_gb: float, *, usable_fraction: float = 0.9) -> str | None:
    """The first strategy in PREFERENCE whose total fits in ``usable_fraction`` of the GPU memory, or None."""
    table = dict(rows)
    budget = gpu_memory_gb * GIB * usable_fraction
    return next((s for s in PREFERENCE if s in table and table[s]["total"] <= budget), None)


def format_table(rows: Rows, *, gpu_memory_gb: float = 80.0, usable_fraction: float = 0.9) -> str:
    """Plain-text table of `estimate` rows (strategy -> estimate; GiB per GPU, CPU offload for the node) with a
    fits column and the recommended strategy for GPUs of ``gpu_memory_gb`` GiB (default: an 80 GB H100/A100).

    A strategy fits when its total stays under ``usable_fraction`` of the GPU memory: the CUDA context, NCCL
    and allocator fragmentation take the rest.
    """
    rows = dict(rows)
    budget = gpu_memory_gb * GIB * usable_fraction
    cols = ("params", "grads", "optimizer", "activations", "buffers", "total", "cpu_offload")
    header = ["strategy", *cols, "fits?"]
    lines = [header]
    for name, est in rows.items():
        lines.append([name, *(f"{est[c] / GIB:.2f}" for c in cols), "yes" if est["total"] <= budget else "no"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    best = recommend(rows, gpu_memory_gb, usable_fraction=usable_fraction)
    unit = f"GiB per GPU (cpu_offload: GiB of CPU RAM per node); budget {budget / GIB:.1f} of {gpu_memory_gb:g} GiB"
    verdict = (f"recommended: {best} (the cheapest in communication that fits)" if best
               else "recommended: none fits; add GPUs, use LoRA, enable gradient checkpointing or shorten seq_len")
    return "\n".join([*text, unit, verdict])
