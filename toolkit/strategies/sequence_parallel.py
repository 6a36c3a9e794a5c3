"""Ulysses sequence parallelism (DeepSpeed's ALST), chosen by the accelerate config file's `parallelism_config`.

With `parallelism_config_sp_size: N` each row's tokens are split between N consecutive processes (DeepSpeed's
sequence-parallel group: ranks N*i ... N*i + N-1). Every layer but attention runs on the process's T/N tokens;
DeepSpeed's wrapper around the attention kernel swaps sequence for heads with an all-to-all, so the kernel sees all
T tokens over heads/N heads, and swaps back. accelerate registers that wrapper (`UlyssesSPAttentionHF`) over the
kernel named by `parallelism_config_sp_attn_implementation` and hands DeepSpeed the process groups; this module
owns what the toolkit adds around it:

* `Layout`: processes, data-parallel replicas (`processes / sp_size`) and this process's place in both. The
  curriculum's global batch, the sampler and exact resume are defined over replicas: the N processes of a group
  draw the same micro-batches (the same rows) and each trains its own slice of the tokens.
* `check_launch`: the launch shapes refused in one line before anything loads (DDP or FSDP with sp_size, cp_size,
  sizes that do not multiply to the processes, a fixed sequence length).
* `attention_request` / `use_kernel`: the kernel family the config names (sdpa, flash_attention_2) runs as the
  toolkit's packed-row kernel of that family, so the wrapper intercepts the kernel the model really calls.
* `follow_batch_size`: DeepSpeed's wrapper fixes the batch size at registration (the DeepSpeed config's micro
  batch); the toolkit's micro-batches are 1 packed row or `micro_batch_size` padded rows, per stage. Evaluation
  (the model in eval mode) calls the kernel itself, with its mask: whole rows on every process.
* `shard_batch`: a micro-batch's slice for this process. Labels are shifted over the whole row first (the token
  after a slice's last one lives on the next process), the row is padded to a multiple of N (pad tokens form a
  span of their own in a packed row, and carry no label), `position_ids` always come with it (the wrapper
  all-gathers them), and a packed row's boundaries stay those of the whole row: the kernel runs on all T tokens.
  Why not DeepSpeed's `UlyssesSPDataLoaderAdapter`, which accelerate applies to loaders passed to `prepare`: it
  all-gathers one batch from each process of a group and replays them over sp_size steps, so a step would no longer
  be the curriculum's step (stages, pacing and exact resume count steps over replicas), and every batch would cost
  a collective. Here the processes of a group draw the same rows from the memory-mapped token store and slice them
  locally: no collective, and the data position stays a function of the step.

The loss: each process divides its slice's summed token losses by the label tokens of the whole global batch
(every process, every micro-step) and multiplies by what DeepSpeed divides the summed gradients by
(`gradient_divisor`), so the update is the token-weighted mean over slices, and a slice with no label token adds
zero, not NaN.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from toolkit.errors import ToolkitError

KERNEL_FAMILIES = ("sdpa", "flash_attention_2")
"""The `sp_attn_implementation` values the toolkit runs: each has a packed-row kernel that takes the whole row's
boundaries (toolkit/model/attention.py). eager builds T x T masks, which Ulysses discards."""


@dataclass(frozen=True)
class Layout:
    """Where this process sits: `processes` in all, groups of `sp_size` consecutive ones share each row."""

    processes: int = 1
    rank: int = 0
    sp_size: int = 1

    @property
    def sequence_parallel(self) -> bool:
        return self.sp_size > 1

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the processes that draw different rows."""
        return self.processes // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        """This process's slice of each row (DeepSpeed's rank in its sequence-parallel group)."""
        return self.rank % self.sp_size


def layout(accelerator: Any) -> Layout:
    """The live run's layout (sp_size 1 without a `parallelism_config` that asks for Ulysses)."""
    config = getattr(accelerator, "parallelism_config", None)
    sp = int(getattr(config, "sp_size", 1) or 1) if config is not None else 1
    return Layout(processes=accelerator.num_processes, rank=accelerator.process_index, sp_size=sp)


def gradient_divisor(accelerator: Any) -> int:
    """The number DeepSpeed divides each summed gradient by: the loop scales each process's loss by it, so that the
    update is the mean over the global batch's label tokens.

    Without Ulysses every strategy averages over the processes. Under Ulysses DeepSpeed means to sum over the
    processes of a sequence-parallel group and average over replicas (divide by processes / sp_size), and its
    ZeRO-1/2 reductions do (deepspeed/runtime/zero/stage_1_and_2.py, `average_tensor`, `allreduce_bucket`); ZeRO-3's
    default reduce-scatter path divides by all the processes instead (stage3.py, `__avg_scatter_grads`; only its
    `reduce_scatter: false` path divides by processes / sp_size). The strategy matrix compares gradient norms with a
    single process's under both, so a DeepSpeed release that changes either fails there, not silently."""
    place = layout(accelerator)
    if not place.sequence_parallel:
        return place.processes
    from toolkit.strategies import ds_config

    zero = (ds_config(accelerator) or {}).get("zero_optimization", {})
    if int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter", True) is not False:
        return place.processes
    return place.dp_size


# ------------------------------------------------------------------------------------------ the launch


def _env_int(name: str, default: int = 1) -> int:
    value = os.environ.get(f"PARALLELISM_CONFIG_{name}", "")
    return int(value) if value not in ("", "None") else default


def check_launch() -> int:
    """Refuse the parallelism shapes this toolkit cannot train, from what `accelerate launch` put in the
    environment (before the Accelerator and the process group exist). Returns sp_size."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1
    sp, cp, tp = _env_int("SP_SIZE"), _env_int("CP_SIZE"), _env_int("TP_SIZE")
    replicate, shard = _env_int("DP_REPLICATE_SIZE"), _env_int("DP_SHARD_SIZE")
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if cp > 1:
        raise ToolkitError(
            f"parallelism_config_cp_size is {cp}: FSDP2 context parallelism is not supported here (it rejects "
            "packed rows and only covers CUDA attention kernels, so it cannot be proven on this toolkit's CPU "
            "tests). For long rows use Ulysses sequence parallelism: parallelism_config_sp_size with DeepSpeed "
            "(accelerate_configs/zero3_sp2.yaml).")
    if tp > 1:
        raise ToolkitError(f"parallelism_config_tp_size is {tp}: tensor parallelism is not supported; remove it "
                           "from the accelerate config (for long rows: parallelism_config_sp_size).")
    if sp <= 1:
        return 1
    if not deepspeed:
        raise ToolkitError(
            f"parallelism_config_sp_size is {sp} under {'FSDP' if fsdp else 'DDP'}: Ulysses sequence parallelism "
            "runs under DeepSpeed ZeRO-2 or ZeRO-3 only. Launch with accelerate_configs/zero3_sp2.yaml (or set "
            "distributed_type: DEEPSPEED), or remove parallelism_config_sp_size.")
    backend = os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    if backend != "deepspeed":
        raise ToolkitError(f"parallelism_config_sp_backend is {backend!r}; the only backend is deepspeed.")
    if os.environ.get("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", "true").lower() not in ("true", "1"):
        raise ToolkitError(
            "parallelism_config_sp_seq_length_is_variable is false: the toolkit's micro-batches vary in length "
            "(curriculum stages, packing, padding to the longest row). Set it to true.")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if replicate * shard * sp != world:
        fix = (f"set dp_shard_size to {world // sp} (processes / sp_size)" if world % sp == 0 else
               f"launch a multiple of sp_size {sp} processes")
        raise ToolkitError(
            f"parallelism_config: dp_replicate_size {replicate} x dp_shard_size {shard} x sp_size {sp} = "
            f"{replicate * shard * sp}, but the launch has {world} process(es): {fix}, or launch "
            f"{replicate * shard * sp} processes (--num_processes).")
    return sp


def check_model(sp_size: int, *, heads: int, kv_heads: int, vision: bool, max_seq_lens: list[int]) -> None:
    """Refuse a model or rows that Ulysses cannot split `sp_size` ways (before data or weights load)."""
    if sp_size <= 1:
        return
    if vision:
        raise ToolkitError(
            f"parallelism_config_sp_size is {sp_size} with a vision-language model: its image tokens are merged "
            "with the vision tower's output before the decoder, and a row split across processes would split an "
            "image's tokens from its pixels. Train VL models without sp_size (ZeRO-3: accelerate_configs/zero3.yaml).")
    if heads % sp_size:
        raise ToolkitError(f"parallelism_config_sp_size is {sp_size} but the model has {heads} attention heads: "
                           f"Ulysses gives each process heads / sp_size of them. Use an sp_size that divides {heads}.")
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ToolkitError(f"parallelism_config_sp_size is {sp_size} but the model has {kv_heads} key/value heads: "
                           "one must divide the other. Use an sp_size that divides "
                           f"{kv_heads} or a multiple of it that divides {heads}.")
    if (short := min(max_seq_lens)) < sp_size:
        raise ToolkitError(f"data.max_seq_len is {short}, shorter than parallelism_config_sp_size {sp_size}: each "
                           "process needs at least one token of every row. Raise max_seq_len or lower sp_size.")


# ------------------------------------------------------------------------------------------ the kernel


def attention_request(recipe_attention: str, sp_attention: str | None) -> str:
    """The recipe-level kernel to load the model with under Ulysses: the config's `sp_attn_implementation`
    when the recipe says auto, the recipe's when both agree; anything else is refused."""
    family = sp_attention or "sdpa"
    if family not in KERNEL_FAMILIES:
        raise ToolkitError(
            f"parallelism_config_sp_attn_implementation is {family!r}; the toolkit runs Ulysses over "
            f"{' or '.join(KERNEL_FAMILIES)} (eager needs T x T masks, which Ulysses drops; flex and "
            "flash_attention_3 have no packed-row kernel here). Set it to sdpa, or flash_attention_2 with flash-attn.")
    if recipe_attention not in ("auto", family):
        raise ToolkitError(
            f"model.attn_implementation is {recipe_attention} but the accelerate config's "
            f"parallelism_config_sp_attn_implementation is {family}: set one to the other (or the recipe's to auto).")
    return family


def use_kernel(accelerator: Any, kernel: str) -> None:
    """Make accelerate wrap `kernel` (the attention the model was loaded with, e.g. sdpa_packed) in Ulysses."""
    handler = accelerator.parallelism_config.sp_handler
    handler.sp_attn_implementation = kernel


def follow_batch_size(kernel: str) -> None:
    """After `accelerator.prepare`: let DeepSpeed's wrapper of `kernel` take any batch size, and evaluation (eval
    mode) call the kernel itself with its mask.

    DeepSpeed sizes its reshapes by the micro batch it was registered with and keeps the wrapper object in the
    registered function's closure; it updates only the sequence length per call (`seq_length_is_variable`). Its
    own `disable_in_eval` would still drop the attention mask (left-padded generation would attend to padding)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    wrapper = ALL_ATTENTION_FUNCTIONS[kernel]
    cells = [cell.cell_contents for cell in (getattr(wrapper, "__closure__", None) or ())]
    ulysses = next((c for c in cells if isinstance(c, UlyssesSPAttentionHF)), None)
    if ulysses is None:
        raise ToolkitError(f"DeepSpeed's Ulysses wrapper was not found around the {kernel} kernel after prepare: "
                           "this DeepSpeed version registers it differently. Report it with `pip list`.")
    core: Callable[..., Any] = ulysses.attn

    def ulysses_any_batch(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if not module.training:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        batch = query.shape[0]
        if batch != ulysses.batch_size:
            ulysses.batch_size = batch
            for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                shape = getattr(ulysses, name)
                setattr(ulysses, name, torch.Size([shape[0], batch, *shape[2:]]))
        return wrapper(module, query, key, value, attention_mask, *args, **kwargs)

    ulysses_any_batch.ulysses = ulysses  # type: ignore[attr-defined]  # tests read its settings
    ALL_ATTENTION_FUNCTIONS[kernel] = ulysses_any_batch


# ------------------------------------------------------------------------------------------ the data


PER_ROW_KEYS = ("pair_index",)
"""Keys of a micro-batch that are not along the sequence (a pair batch's stage-global pair numbers): every process of
a group keeps them whole."""


def shard_segments(seg: torch.Tensor, place: Layout) -> torch.Tensor:
    """This process's slice of a whole micro-batch's segment ids (``[B, T]``, toolkit/evals/scoring.py
    `segment_ids`), shifted over the whole row as `shard_batch` shifts the labels (position t's loss belongs to the
    segment of token t + 1, which may live on the next process) and padded with -1 (no segment) as it pads."""
    shifted = F.pad(seg, (0, 1), value=-1)[:, 1:]
    pad = -seg.shape[1] % place.sp_size
    if pad:
        shifted = F.pad(shifted, (0, pad), value=-1)
    chunk = shifted.shape[1] // place.sp_size
    return shifted[:, place.sp_rank * chunk:(place.sp_rank + 1) * chunk].contiguous()


def group_sum(tensor: torch.Tensor, place: Layout) -> torch.Tensor:
    """`tensor` summed over this process's sequence-parallel group, differentiably: per-segment sums of the group's
    slices become the whole segments' (a preference pair's log-prob). The backward all-reduces the gradient too
    (torch.distributed.nn), so each process's slice receives the group's summed gradient: a loss computed alike on
    every process of the group counts sp_size times, which the pair normalisers (counted on whole batches by every
    process of the group, toolkit/train/loop.py) divide out again. Identity without Ulysses."""
    if not place.sequence_parallel:
        return tensor
    import torch.distributed.nn.functional as dist_nn
    from deepspeed.utils import groups

    group = groups._get_sequence_parallel_group()
    if not tensor.requires_grad:
        out = tensor.clone()
        torch.distributed.all_reduce(out, group=group)
        return out
    return dist_nn.all_reduce(tensor, group=group)


def shard_batch(batch: dict[str, Any], place: Layout, *, ignore_index: int = -100) -> tuple[dict[str, Any], int]:
    """(this process's slice of a collated micro-batch, its real tokens) under Ulysses.

    The slice holds `input_ids`, the original `labels` (the loop counts label tokens with them, as without
    Ulysses), `shift_labels` (the loss's targets, shifted over the whole row), `position_ids` and, for a packed
    row, the whole row's `cu_seq_lens_q/k` and `max_length_q/k`. No `attention_mask`: Ulysses discards masks and
    keeps a padded row apart by position; padding is on the right, where causal attention never looks."""
    ids, labels = batch["input_ids"], batch["labels"]
    rows, length = ids.shape
    mask = batch.get("attention_mask")
    real_rows = mask if mask is not None else torch.ones_like(ids)
    pad = -length % place.sp_size
    total = length + pad
    shift = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    positions = batch.get("position_ids")
    if positions is None:  # padded rows: 0..T-1 on every row (their padding sits at the right end)
        positions = torch.arange(total, dtype=torch.long).expand(rows, total)
    elif pad:  # a packed row: the padding is a sample of its own, restarting at 0
        positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype).expand(rows, pad)], dim=1)
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        labels, shift = (F.pad(t, (0, pad), value=ignore_index) for t in (labels, shift))
        real_rows = F.pad(real_rows, (0, pad), value=0)
    chunk = total // place.sp_size
    part = slice(place.sp_rank * chunk, (place.sp_rank + 1) * chunk)
    out: dict[str, Any] = {"input_ids": ids[:, part], "labels": labels[:, part], "shift_labels": shift[:, part],
                           "position_ids": positions[:, part].contiguous()}
    if "cu_seq_lens_q" in batch:
        cu = batch["cu_seq_lens_q"]
        if pad:
            cu = torch.cat([cu, torch.tensor([total], dtype=cu.dtype)])
        longest = max(int(batch["max_length_q"]), pad)
        out |= {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    out |= {key: batch[key] for key in PER_ROW_KEYS if key in batch}
    for key in batch.keys() - {"input_ids", "labels", "attention_mask", "position_ids", "cu_seq_lens_q",
                               "cu_seq_lens_k", "max_length_q", "max_length_k", *PER_ROW_KEYS}:
        raise ToolkitError(f"a micro-batch under sequence parallelism carries {key!r}, which cannot be split "
                           "along the sequence (only text rows train under parallelism_config_sp_size).")
    return out, int(real_rows[:, part].sum())
