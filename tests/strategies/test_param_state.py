"""Portable LoRA state, in this process: Adam state created as the optimizer's first step would, and a portable
resume on the single-process layout that must reproduce the uninterrupted run bit for bit.

The multi-process half of the matrix is in tests/e2e/test_portability.py and tests/e2e/test_strategies.py: every layout
writes the same portable file for the same training, and every layout family reads one written by another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import REPO
from tests.helpers.inprocess import Call, invoke
from toolkit.checkpoint.manager import META_FILE
from toolkit.checkpoint.portable import portable_lora_file
from toolkit.checkpoint.resume import reseed_for_layout
from toolkit.metrics.log import read_metrics
from toolkit.strategies import param_state

CURRICULUM = str(REPO / "recipes" / "smoke_curriculum.yaml")  # LoRA, then only model.norm, then both
SINGLE = ("train.micro_batch_size=4", "stages.2.micro_batch_size=2")  # the 2-process runs' global batches


def two_groups() -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    return model, torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)


def test_created_adam_state_is_the_one_the_first_step_creates() -> None:
    """`ensure_adam_state` before a step that updates only the first layer: the same weights and state as without
    it, and the second layer (no gradient, as a frozen group) holds Adam's start: zero moments at step 0."""
    accelerator = Accelerator(cpu=True)
    runs = []
    for ensure in (True, False):
        model, optimizer = two_groups()
        if ensure:
            param_state.ensure_adam_state(accelerator, optimizer)
        model(torch.ones(2, 4)).sum().backward()
        for p in model[1].parameters():
            p.grad = None
        optimizer.step()
        runs.append((model, optimizer))
    (ensured, opt_ensured), (lazy, opt_lazy) = runs
    for (n, p), q in zip(ensured.named_parameters(), lazy.parameters(), strict=True):
        assert torch.equal(p, q), n
        if n.startswith("0."):
            assert all(torch.equal(opt_ensured.state[p][k], opt_lazy.state[q][k]) for k in opt_lazy.state[q])
        else:
            state = opt_ensured.state[p]
            assert not opt_lazy.state[q] and int(state["step"]) == 0
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_reseed_for_layout_is_deterministic_and_never_the_starting_stream() -> None:
    def draw(seed: int, step: int, rank: int) -> float:
        reseed_for_layout(seed, step, rank)
        return torch.rand(()).item()

    assert draw(7, 6, 0) == draw(7, 6, 0)
    assert len({draw(7, 6, 0), draw(7, 6, 1), draw(7, 8, 0), draw(8, 6, 0)}) == 4
    torch.manual_seed(7)  # the stream rank 0 started with (train.seed + rank)
    assert torch.rand(()).item() != draw(7, 6, 0)


def losses_and_lrs(out: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["lr"]) for r in read_metrics(out / "metrics.jsonl", "train")}


def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: Path, *overrides: str) -> str:
    rc, stderr = invoke(Call(["--config", CURRICULUM, "--create_dummy_data", "--num_dummy_samples", "64",
                              f"output_dir={out}", *SINGLE, *overrides], out), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    return stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The curriculum smoke on one process, a checkpoint every 2 steps (and at the end)."""
    root = tmp_path_factory.mktemp("portable")
    with pytest.MonkeyPatch.context() as monkeypatch:
        train(root, monkeypatch, root / "run", "checkpoint.save_steps=2", "checkpoint.keep_last=20")
    return root / "run"


def as_if_written_by(ckpt: Path, dest: Path, strategy: str, world_size: int) -> Path:
    """A copy of `ckpt` whose meta.json says another layout wrote it, so a resume takes the portable path. The
    portable file is the same whatever layout wrote it (checked across every strategy by test_strategies.py)."""
    shutil.copytree(ckpt, dest)
    meta = json.loads((dest / META_FILE).read_text())
    (dest / META_FILE).write_text(json.dumps(meta | {"strategy": strategy, "world_size": world_size}))
    return dest


def test_portable_resume_reproduces_the_run_bit_for_bit(uninterrupted: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """From step 6 (stage 2 trains only the norm, 2 updates; LoRA frozen with 4 updates of Adam state), read on the
    single-process layout: every later loss and lr, and the later checkpoints' portable state, are the
    uninterrupted run's exactly. So the reader restores all the file holds (weights, both groups' moments, their
    own step counts), and the scheduler position including the lr of the next step (it used to train step 7 at the
    lr of step 1)."""
    source = as_if_written_by(uninterrupted / "checkpoints" / "step-00000006", tmp_path / "ckpt", "zero3", 2)
    out = tmp_path / "resumed"
    train(tmp_path, monkeypatch, out, f"checkpoint.resume={source}", "checkpoint.save_steps=2",
          "checkpoint.keep_last=20")
    after_run = torch.rand(4)  # the run drew nothing from the stream it was reseeded with (no dropout)
    reseed_for_layout(7, 6, 0)  # recipe seed 7, step 6, rank 0
    assert torch.equal(after_run, torch.rand(4)), "the resume did not reseed the RNG from (seed, step, rank)"
    ref, got = losses_and_lrs(uninterrupted), losses_and_lrs(out)
    assert sorted(got) == list(range(7, 12))
    assert {s: got[s] for s in got} == {s: ref[s] for s in got}
    assert "resumed (portable (zero3 x 2 -> single x 1; RNG reseeded per rank from the step)) from" in caplog.text
    for step in (8, 11):  # LoRA still frozen at 8 (bit-identical to the file read at 6), everything trained at 11
        expected = load_file(portable_lora_file(uninterrupted / "checkpoints" / f"step-{step:08d}"))
        written = load_file(portable_lora_file(out / "checkpoints" / f"step-{step:08d}"))
        assert written.keys() == expected.keys()
        assert [k for k in expected if not torch.equal(written[k], expected[k])] == []


def test_portable_file_holds_every_parameter_moments_and_step_counts(uninterrupted: Path) -> None:
    """At step 2 the norm (trained from stage 2 on) was never updated: zero moments and step 0 are written for it,
    as every layout writes them, whether or not its optimizer created the state yet."""
    with safe_open(portable_lora_file(uninterrupted / "checkpoints" / "step-00000002"), "pt") as f:
        steps = json.loads(f.metadata()["adam_steps"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    norm = "base_model.model.model.norm.modules_to_save.default.weight"
    assert steps[norm] == 0 and {s for n, s in steps.items() if n != norm} == {2}
    assert set(tensors) == {f"{k}/{n}" for n in steps for k in ("param", "exp_avg", "exp_avg_sq")}
    assert not tensors[f"exp_avg/{norm}"].any() and not tensors[f"exp_avg_sq/{norm}"].any()


def test_a_file_without_moments_resets_them_and_says_so(uninterrupted: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A portable file without a trained parameter's moments (an earlier version's writer skipped a state it could
    not find) still resumes: that parameter's Adam state starts afresh, and the resume line, a warning, names it."""
    source = as_if_written_by(uninterrupted / "checkpoints" / "step-00000010", tmp_path / "ckpt", "ddp", 2)
    path = portable_lora_file(source)
    with safe_open(path, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    lora = next(k.removeprefix("param/") for k in tensors if k.startswith("param/") and "lora_A" in k)
    save_file({k: v for k, v in tensors.items() if not k.startswith("exp_avg") or not k.endswith(lora)}, path,
              metadata=metadata)
    meta = json.loads((source / META_FILE).read_text())
    (source / META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))  # digests
    train(tmp_path, monkeypatch, tmp_path / "resumed", f"checkpoint.resume={source}")
    lines = [r for r in caplog.records if r.getMessage().startswith("resumed (portable")]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"
    assert f"Adam state of 1 parameter(s) the checkpoint holds none for (e.g. {lora}) reset" in lines[0].getMessage()
