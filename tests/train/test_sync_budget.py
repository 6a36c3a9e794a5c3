"""Host syncs in the training step: one per optimizer step from the loop, outside logging steps.

On a GPU every read of a device value on the host (`.item()`, `.tolist()`, `.cpu()`, `bool(t)`, `float(t)`,
`nonzero()`, ...) waits for the queue to drain and stalls the pipeline. Every such call on a tensor is counted here,
by call site, during each step and what follows it (toolkit/train/loop.py's run_step and after_step), on a packed and a
padded run:

* the loop's own: exactly one per step outside logging steps (the all-reduce of the step's loss and flags, read
  back for the stability guard's verdict), in a preference stage's steps too;
* inside each micro-batch's forward (transformers' mask creation: its position-id restart check, or the padding
  check; the chunked loss head's selection of label positions): at most two per micro-batch, none from the
  attention kernels when the collator hands over the boundaries, and none per layer: the packed row's max_seqlen
  reaches the varlen kernel (torch's, or FlashAttention-4's) as the host int the collator computed;
* torch's own optimizer reads its step counters, host tensors even in a GPU run (fused AdamW, used on CUDA, keeps
  them on the device and reads none): not counted.

toolkit/train/loop.py's module docstring lists the syncs of logging, evaluation and checkpoint steps.
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.train.test_loop import _kept, build_run  # noqa: F401  (the fixture keeps signal handlers off the runner)
from toolkit.data.packing import PackedCollator
from toolkit.model import attention
from toolkit.train import preference
from toolkit.train.loop import after_step, enter_stage, run_step

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
STEPS, LOGGING_STEPS, GRAD_ACCUM = 6, 3, 2
PER_FORWARD = ("toolkit/model/loss_head.py", "toolkit/model/attention.py", "transformers/")


@contextmanager
def counting_syncs() -> Iterator[Counter]:
    """Count host reads of tensor values by the file:line that asked for them ("torch" when torch itself did)."""
    sites: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    real_nonzero = torch.nonzero

    def site() -> str:
        caller = sys._getframe(2).f_code.co_filename
        if f"{Path(torch.__file__).parent}" in caller:
            return "torch"
        line = sys._getframe(2).f_lineno
        return f"{caller.split('site-packages/')[-1].removeprefix(str(REPO) + '/')}:{line}"

    def wrap(real):  # type: ignore[no-untyped-def]
        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            sites[site()] += 1
            return real(*args, **kwargs)
        return counted

    for name, real in originals.items():
        setattr(torch.Tensor, name, wrap(real))
    torch.nonzero = wrap(real_nonzero)
    try:
        yield sites
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)
        torch.nonzero = real_nonzero


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_one_loop_sync_per_step_outside_logging_steps(tmp_path: Path, packing: bool) -> None:
    run = build_run(tmp_path, f"stages.0.max_steps={STEPS}", f"logging.logging_steps={LOGGING_STEPS}",
                    f"train.grad_accum={GRAD_ACCUM}", "train.micro_batch_size=1", "data.max_seq_len=96",
                    "checkpoint.save_on_stage_end=false", f"data.packing={str(packing).lower()}")
    stage = run.curriculum.stages[0]
    enter_stage(run, stage, 0)
    per_step = []
    for step in range(STEPS):
        with counting_syncs() as sites:
            result = run_step(run, stage, step, step)
            after_step(run, stage, step, step + 1, result)
        per_step.append(sites)
    quiet = [s for i, s in enumerate(per_step, start=1) if i % LOGGING_STEPS and i != STEPS]
    assert len(quiet) == 4  # steps 1, 2, 4, 5
    for sites in quiet:
        loop = {k: n for k, n in sites.items() if k != "torch" and not k.startswith(PER_FORWARD)}
        forward = {k: n for k, n in sites.items() if k.startswith(PER_FORWARD)}
        assert sum(loop.values()) == 1 and next(iter(loop)).startswith("toolkit/train/loop.py"), loop
        assert sum(forward.values()) <= 2 * GRAD_ACCUM, forward  # per micro-batch, never per layer
        assert not any(k.startswith("toolkit/model/attention.py") for k in forward), forward
    logging = per_step[LOGGING_STEPS - 1]
    assert sum(n for k, n in logging.items() if k.startswith("toolkit/")) > 1  # the counter sees the logging reads


def test_a_preference_step_reads_the_host_once_too(tmp_path: Path) -> None:
    """A dpo stage's quiet steps: the loop's one read as an sft step's, the pair and chosen-token normalisers kept on
    the device (`global_normalisers`; read back, they were a second sync before each step's first forward). Its
    `pair_counts` reads the host batch (a host tensor, no sync), so it is not counted."""
    run = build_run(tmp_path, "stages.0.max_steps=3", "logging.logging_steps=3", f"train.grad_accum={GRAD_ACCUM}",
                    "train.micro_batch_size=1", "data.max_seq_len=96", "checkpoint.save_on_stage_end=false",
                    "stages.0.objective=dpo", "stages.0.data=[dummy:pairs]")
    stage = run.curriculum.stages[0]
    enter_stage(run, stage, 0)
    lines, first = inspect.getsourcelines(preference.pair_counts)
    host_batch = {f"toolkit/train/preference.py:{n}" for n in range(first, first + len(lines))}
    for step in range(2):  # steps 1 and 2: neither logs
        with counting_syncs() as sites:
            result = run_step(run, stage, step, step)
            after_step(run, stage, step, step + 1, result)
        loop = {k: n for k, n in sites.items()
                if k != "torch" and not k.startswith(PER_FORWARD) and k not in host_batch}
        assert sum(loop.values()) == 1 and next(iter(loop)).startswith("toolkit/train/loop.py"), loop


def masked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None,
                  gqa: bool) -> torch.Tensor:
    """Exact causal attention within each span of `[T, heads, d]` tensors, with no host read (a stand-in kernel
    that reads the offsets back would be counted): a block-diagonal causal mask built on the device."""
    tokens = q.shape[0]
    span = torch.searchsorted(cu, torch.arange(tokens, dtype=cu.dtype, device=cu.device), right=True)
    allowed = (span[:, None] == span[None, :]) & torch.ones(tokens, tokens, dtype=torch.bool).tril()
    out = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("kernel", ["torch-varlen", "flash4"])
def test_packed_rows_reach_the_varlen_kernel_with_host_ints_and_no_sync(tmp_path: Path, kernel: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed row's max_seqlen goes from the collator (a host int) through the loader, the loop's copy and the
    model to the varlen kernel (torch's, or FlashAttention-4's through attn_implementation flash4), a Python int
    all the way: no layer reads the boundaries back, and the step keeps its one loop sync. The kernels are CPU
    stand-ins that record what they receive."""
    received: list[tuple[type, torch.dtype, bool]] = []

    def torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, *, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                     enable_gqa: bool = False) -> torch.Tensor:
        received.append((type(max_q), cu_q.dtype, window_size == (-1, 0) and enable_gqa))
        return masked_varlen(q, k, v, cu_q, scale, enable_gqa)

    def fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None,
                   causal: bool) -> tuple[torch.Tensor, None]:
        received.append((type(max_seqlen_q), cu_seqlens_q.dtype, causal and k.shape[1] < q.shape[1]))
        return masked_varlen(q, k, v, cu_seqlens_q, softmax_scale, True), None

    monkeypatch.setattr(attention, "varlen_runs", lambda query, dropout: True)  # CUDA, 16-bit
    monkeypatch.setattr(attention, "_varlen_attn", lambda: torch_varlen)
    monkeypatch.setattr(attention, "_fa4_varlen", lambda: fa4_varlen)
    monkeypatch.setattr(attention, "fa4_unavailable", lambda: None)  # flash-attn-4 on an sm90 GPU
    steps = 2  # the first is a quiet step, the last logs
    run = build_run(tmp_path, f"stages.0.max_steps={steps}", "logging.logging_steps=100", "train.micro_batch_size=1",
                    f"train.grad_accum={GRAD_ACCUM}", "data.max_seq_len=96", "checkpoint.save_on_stage_end=false",
                    "data.packing=true", f"model.attn_implementation={'flash4' if kernel == 'flash4' else 'sdpa'}")
    run.batches.collate = PackedCollator()  # a real run's (build_run pads, with position_ids restarting)
    stage = run.curriculum.stages[0]
    enter_stage(run, stage, 0)
    for step in range(steps):
        with counting_syncs() as sites:
            after_step(run, stage, step, step + 1, run_step(run, stage, step, step))
        if step + 1 < steps:  # the last step logs
            # The collator's reads are of host tensors, in the loader's worker processes in a run (here in-process).
            loop = {k: n for k, n in sites.items()
                    if k != "torch" and not k.startswith((*PER_FORWARD, "toolkit/data/packing.py"))}
            assert sum(loop.values()) == 1, loop
            assert not any(k.startswith("toolkit/model/attention.py") for k in sites), sites
    layers = run.text_config.num_hidden_layers
    assert len(received) == steps * GRAD_ACCUM * layers
    assert set(received) == {(int, torch.int32, True)}
