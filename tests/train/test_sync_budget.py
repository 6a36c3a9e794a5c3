"""Host syncs in the training step: one per optimizer step from the loop, outside logging steps.

On a GPU every read of a device value on the host (`.item()`, `.tolist()`, `.cpu()`, `bool(t)`, `float(t)`,
`nonzero()`, ...) waits for the queue to drain and stalls the pipeline. Every such call on a tensor is counted here,
by call site, during each step and what follows it (toolkit/train/loop.py's run_step and after_step), on a packed and a
padded run:

* the loop's own: exactly one per step outside logging steps (the all-reduce of the step's loss and flags, read
  back for the stability guard's verdict);
* inside each micro-batch's forward (transformers' mask creation: its position-id restart check, or the padding
  check; the chunked loss head's selection of label positions): at most two per micro-batch, none from the
  attention kernels when the collator hands over the boundaries, and none per layer;
* torch's own optimizer reads its step counters, host tensors even in a GPU run (fused AdamW, used on CUDA, keeps
  them on the device and reads none): not counted.

toolkit/train/loop.py's module docstring lists the syncs of logging, evaluation and checkpoint steps.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.train.test_loop import _kept, build_run  # noqa: F401  (the fixture keeps signal handlers off the runner)
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
