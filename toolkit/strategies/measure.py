"""What a rank really holds after an optimizer step: bytes of weights, gradients and optimizer state, read from
the strategy's own structures (DDP / single, FSDP2 DTensor shards, DeepSpeed ZeRO-1/2/3 partitions and offload).

toolkit/model/memory.py estimates the same quantities before launch; tests/model/test_memory.py checks one against the
other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from toolkit.strategies import optimizer_chain
from toolkit.strategies.fsdp import local_part


class _Ledger:
    """Adds up tensor bytes per category, counting each byte of memory once (views and aliases share storage:
    ZeRO-2 weights are views into a flat buffer; ZeRO-3 fp32 masters alias the weight partitions)."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "cpu_offload": 0}
        self._spans: dict[str, list[tuple[int, int]]] = {}
        self._compute_on_cpu = not torch.accelerator.is_available()

    def add(self, category: str, tensor: Any, *, offloaded: bool = False) -> None:
        if tensor is None:
            return
        t = local_part(tensor)
        if t.device.type == "meta" or t.numel() == 0:
            return
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        spans = self._spans.setdefault(str(t.device), [])
        new = end - start - sum(max(0, min(end, e) - max(start, s)) for s, e in spans)
        spans.append((start, end))
        # A scalar on the CPU (AdamW's step counter) is bookkeeping, not offloaded state.
        if offloaded or (t.device.type == "cpu" and not self._compute_on_cpu and t.numel() > 1):
            category = "cpu_offload"
        self.totals[category] += max(new, 0)


def _optimizer_state_tensors(opt: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in opt.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def measure_rank_state_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state that this rank holds (call after an optimizer step).

    Returns ``params``, ``grads``, ``optimizer`` (device-resident) and ``cpu_offload`` (offloaded to CPU RAM).
    Works on what the training loop holds after ``accelerator.prepare``: a DDP/FSDP2/DeepSpeed-wrapped model
    and an AcceleratedOptimizer around a torch or DeepSpeed ZeRO optimizer.

    * weights: local tensors (a DTensor's shard under FSDP2; under ZeRO-3 the partition ``p.ds_tensor`` plus
      ``p.data`` when gathered, e.g. persistent small weights).
    * grads: the gradient storage of trainable weights at step time. Plain torch and FSDP2: the ``.grad``
      tensors (if ``zero_grad`` already released them, their size is taken from the trainable local weights,
      as a gradient always has its weight's shape and dtype). ZeRO-1/2 free gradients inside their step; the
      flat per-rank gradient partition has the shape of ``single_partition_of_fp32_groups`` and the model's
      dtype. ZeRO-3 keeps a persistent flat ``grad_partitions_flat_buffer``.
    * optimizer: the inner optimizer's state tensors (exp_avg, exp_avg_sq, step) plus DeepSpeed's fp32
      masters (``single_partition_of_fp32_groups`` / ``fp32_partitioned_groups_flat``) where they are not
      the weights themselves.
    """
    ledger = _Ledger()
    chain = optimizer_chain(optimizer)
    # the DeepSpeed ZeRO optimizer (it wraps the torch optimizer holding exp_avg/exp_avg_sq), else the torch one
    opt = next((o for o in chain if hasattr(o, "fp32_partitioned_groups_flat")
                or hasattr(o, "single_partition_of_fp32_groups")), chain[-1])
    stage3 = hasattr(opt, "fp32_partitioned_groups_flat")
    stage12 = hasattr(opt, "single_partition_of_fp32_groups")
    offload_param = bool(getattr(opt, "offload_param", False))
    offload_opt = bool(getattr(opt, "offload_optimizer", False) or getattr(opt, "cpu_offload", False))

    for p in model.parameters():
        if stage3 and hasattr(p, "ds_tensor"):
            ledger.add("params", p.ds_tensor, offloaded=offload_param and not getattr(p, "ds_persist", False))
            ledger.add("params", p.data)
        else:
            ledger.add("params", p)
    if stage12:
        for flat in getattr(opt, "bit16_groups_flat", []):  # the buffer the weights view into (with padding)
            ledger.add("params", flat)

    if stage3:
        ledger.add("grads", getattr(opt, "grad_partitions_flat_buffer", None), offloaded=offload_opt)
    elif stage12:
        flats = getattr(opt, "bit16_groups_flat", [])
        for i, part in enumerate(opt.single_partition_of_fp32_groups):
            if offload_opt:  # the fp32 gradient partition lives on the CPU for the whole run
                ledger.add("grads", part.grad, offloaded=True)
            else:
                elem = flats[i].element_size() if i < len(flats) else part.element_size()
                ledger.totals["grads"] += part.numel() * elem
    else:
        for p in model.parameters():
            if p.grad is not None:
                ledger.add("grads", p.grad)
            elif p.requires_grad:
                local = local_part(p)
                ledger.totals["grads"] += local.numel() * local.element_size()

    masters = getattr(opt, "fp32_partitioned_groups_flat", None) or getattr(opt, "single_partition_of_fp32_groups",
                                                                            None) or []
    for master in masters:
        ledger.add("optimizer", master, offloaded=offload_opt)
    for t in _optimizer_state_tensors(chain[-1]):
        ledger.add("optimizer", t, offloaded=offload_opt)
    return dict(ledger.totals)
