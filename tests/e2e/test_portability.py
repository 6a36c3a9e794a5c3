"""Checkpoints across strategies and world sizes, export, and refusal of bad checkpoints.

The runs here are forked from the session's relauncher (conftest.train_forked; the launches users make are the
shared curriculum runs they resume from) and `toolkit export` runs in this process (tests/helpers/inprocess.py): each
test is about what a checkpoint holds and how a run or an export reads it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import (
    CURRICULUM,
    EVERY_CHECKPOINT,
    NO_THINK,
    REPO,
    SINGLE_CURRICULUM,
    processes_for,
    train_forked,
)
from tests.helpers.inprocess import Call, invoke
from tests.helpers.portable import check_portable_files, portable_state
from toolkit.builtin.models import TINY_MODEL, builtin_dir
from toolkit.metrics.log import read_metrics

pytestmark = pytest.mark.slow

LONGER = ("stages.0.max_steps=10", "stages.1.max_steps=6", "checkpoint.save_steps=5", "checkpoint.keep_last=5")
SINGLE_SAME_BATCH = "train.micro_batch_size=4"  # 4 x 2 accum x 1 = 2 x 2 accum x 2 processes


def records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl", "train")}


def ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("portability")


@pytest.fixture(scope="module")
def zero3_lora(runs: Path) -> Path:
    train_forked("zero3", 2, runs / "zero3", *LONGER)
    return runs / "zero3"


@pytest.fixture(scope="module")
def zero3_full(runs: Path) -> Path:
    train_forked("zero3", 2, runs / "zero3-full", "lora.enabled=false", *LONGER)
    return runs / "zero3-full"


# --- Portable resume: the second half of the matrix. ---
# The portable file is the same whatever layout writes it (tests/e2e/test_strategies.py compares every strategy's
# checkpoints with the one-process run's), so every pair of layouts is covered once each layout reads such a file
# correctly: the one-process reader bit for bit in tests/strategies/test_param_state.py, each strategy family here
# with one launch that resumes another layout's shared curriculum run at step 6. There stage 2 trains only the norm
# (2 Adam updates) with LoRA frozen since stage 1 (4 updates), at an lr mid-schedule. Then:
#   * LoRA's weights and moments written at step 8, after the frozen rest of stage 2, are the file read at step 6
#     bit for bit: the reader restored exactly what the file holds (and this layout's writer wrote it back);
#   * every later checkpoint holds the source run's portable state (the strategy matrix's tolerance) and Adam step
#     counts: the norm's moments and every Adam step count came through as well (a wrong one moves the weights);
#   * the lr of every step is the source run's exactly, and the losses are within 1e-5.
# Why 1e-5 where the strategy matrix allows 1e-4: after the resume the same maths runs in another reduction order
# (per-rank partial sums and the all-reduce, DeepSpeed's flat buffers, another micro-batch split), which moves each
# loss by a few fp32 ulps (6e-8 relative), and Adam carries that on; measured across ddp, zero2, zero3, offload,
# FSDP2 and one process: at most 7e-8 after 9 steps, so 1e-5 leaves over 100x for other CPUs' kernels. The
# matrix's 1e-4 also absorbs another loss chunking (its 2-process runs use 16-token chunks); these runs share one.
# Losses alone could not prove the Adam state: on this near-random tiny model, step 7 trained at a wrong lr moved
# the later losses by only 1e-5. The file checks prove the state; the losses prove the data position.

PORTABLE_RESUMES = [  # (reader, its processes, the layout whose checkpoint it reads)
    ("ddp", 2, "zero3_offload"),  # single / DDP (one process: strategies/test_param_state), from CPU Adam's state
    ("fsdp", 2, "single"),  # FSDP2 shards, from one process
    ("zero2", 2, "ddp"),  # ZeRO-2: Adam state created and linked before the first step (was a TypeError)
    ("zero3", 1, "zero3"),  # ZeRO-3 x 1 from ZeRO-3 x 2 (was a KeyError, as was DDP into ZeRO-3)
    ("zero3_offload", 1, "fsdp"),  # ZeRO-3 offload: DeepSpeed's CPU Adam state created before the first step
]
RESUME_AT = 6


@pytest.mark.parametrize(("reader", "processes", "writer"), PORTABLE_RESUMES,
                         ids=[f"{w}-to-{r}x{n}" for r, n, w in PORTABLE_RESUMES])
def test_portable_resume_into_another_layout(reader: str, processes: int, writer: str,
                                             curriculum_runs: Callable[[str], Path], runs: Path) -> None:
    source, out = curriculum_runs(writer), runs / f"{writer}-to-{reader}x{processes}"
    proc = train_forked(reader, processes, out, *(SINGLE_CURRICULUM if processes == 1 else ()), *EVERY_CHECKPOINT,
                        *NO_THINK, f"checkpoint.resume={ckpt(source, RESUME_AT)}", recipe=CURRICULUM)
    layouts = f"{strategy_name(writer)} x {processes_for(writer)} -> {strategy_name(reader)} x {processes}"
    assert (f"INFO resumed (portable ({layouts}; RNG reseeded per rank from the step)) from "
            f"{ckpt(source, RESUME_AT)}: step {RESUME_AT} of 11") in proc.stderr, proc.stderr[-3000:]
    read, frozen = portable_state(source, RESUME_AT), portable_state(out, 8)
    lora = [k for k in read if "lora_" in k]
    assert lora and [k for k in lora if not torch.equal(frozen[k], read[k])] == []
    check_portable_files(out, source, f"{reader} x {processes}", steps=tuple(range(RESUME_AT + 1, 12)))
    got, ref = records(out), records(source)
    assert sorted(got) == list(range(RESUME_AT + 1, 12))
    assert {s: got[s]["lr"] for s in got} == {s: ref[s]["lr"] for s in got}
    assert [got[s]["loss"] for s in got] == pytest.approx([ref[s]["loss"] for s in got], rel=1e-5)


def strategy_name(config: str) -> str:
    """The strategy name a shipped accelerate config trains under (as logs and meta.json spell it)."""
    return {"fsdp": "fsdp2"}.get(config, config)


def test_full_finetuning_on_another_world_size_names_both_layouts(zero3_full: Path, runs: Path) -> None:
    out = runs / "full-to-single"
    proc = train_forked("single", 1, out, "lora.enabled=false", *LONGER, SINGLE_SAME_BATCH,
                        f"checkpoint.resume={ckpt(zero3_full, 10)}", check=False)
    assert proc.returncode != 0 and "loading" not in proc.stderr, proc.stderr[-2000:]  # before the model
    assert "zero3 x 2" in proc.stderr and "single x 1" in proc.stderr and "toolkit export" in proc.stderr


def _export(monkeypatch: pytest.MonkeyPatch, *args: str) -> subprocess.CompletedProcess:
    """`toolkit export ARGS`, its main called in this process (tests/helpers/inprocess.py: the command's code and exit
    code, without a fresh process's imports)."""
    rc, stderr = invoke(Call(["export", *args], REPO, tool="toolkit"), REPO, monkeypatch)
    return subprocess.CompletedProcess(["toolkit", "export", *args], rc, "", stderr)


def _no_empty_tensors(path: Path) -> None:
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            assert all(f.get_slice(k).get_shape() and min(f.get_slice(k).get_shape()) > 0 for k in f.keys())  # noqa: SIM118


def test_export_lora_adapter_and_merged_model_agree(zero3_lora: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    source = ckpt(zero3_lora, 15)
    for args in ([str(source), "--out", str(tmp_path / "adapter")],
                 [str(source), "--out", str(tmp_path / "merged"), "--merge"]):
        proc = _export(monkeypatch, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _no_empty_tensors(tmp_path / "adapter")
    _no_empty_tensors(tmp_path / "merged")
    assert "| short | 10 |" in (tmp_path / "adapter" / "README.md").read_text()
    base_dir = builtin_dir(TINY_MODEL, zero3_lora.parent / ".toolkit-cache")
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(3, 900, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, rtol=1e-4, atol=1e-4)
        # the adapter is not a no-op: the exported LoRA changes the base model's logits
        assert not torch.allclose(adapter(ids).logits, AutoModelForCausalLM.from_pretrained(base_dir)(ids).logits)


def test_export_carries_modules_trained_by_stage_patterns(curriculum_runs: Callable[[str], Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm trains only through stages[].trainable (a PEFT modules_to_save): an export from a checkpoint must
    rebuild it as training did and carry its trained weight, as the final adapter does."""
    curriculum_zero3 = curriculum_runs("zero3")
    proc = _export(monkeypatch, str(ckpt(curriculum_zero3, 10)), "--out", str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(ckpt(curriculum_zero3, 10) / "portable" / "lora_state.safetensors", "pt") as f:
        trained = f.get_tensor("param/base_model.model.model.norm.modules_to_save.default.weight")
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    torch.testing.assert_close(exported["base_model.model.model.norm.weight"], trained, rtol=0, atol=0)
    base = AutoModelForCausalLM.from_pretrained(builtin_dir(TINY_MODEL, curriculum_zero3.parent / ".toolkit-cache"))
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    norm = dict(model.named_parameters())["base_model.model.model.norm.modules_to_save.default.weight"]
    assert torch.equal(norm.detach(), trained)


def test_export_vision_language_checkpoint_merged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A VL run (projector trained through `trainable`) exports merged, with its processor, loadable as it is."""
    from transformers import AutoModelForImageTextToText, ProcessorMixin

    from toolkit.model.load import load_processor

    run = tmp_path / "vl"
    train_forked("single", 1, run, "train.micro_batch_size=4", recipe="recipes/smoke_vl.yaml")
    proc = _export(monkeypatch, str(ckpt(run, 8)), "--out", str(tmp_path / "merged"), "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    # through the toolkit's loader: a bare AutoProcessor returns the tokenizer when the tiny class is not registered
    processor = load_processor(str(tmp_path / "merged"), trust_remote_code=False, chat_template=None)
    assert isinstance(processor, ProcessorMixin) and processor.image_processor is not None
    with safe_open(ckpt(run, 8) / "portable" / "lora_state.safetensors", "pt") as f:
        merger = f.get_tensor("param/base_model.model.model.visual.merger.modules_to_save.default.mlp.0.weight")
    assert torch.equal(dict(model.named_parameters())["model.visual.merger.mlp.0.weight"].detach(), merger)


def test_export_full_finetuning_from_zero3_shards(zero3_full: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The last checkpoint's consolidated ZeRO-3 shards equal the run's gathered final model."""
    proc = _export(monkeypatch, str(ckpt(zero3_full, 16)), "--out", str(tmp_path / "full"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full").state_dict()
    final = AutoModelForCausalLM.from_pretrained(zero3_full / "final").state_dict()
    for k in final:
        torch.testing.assert_close(exported[k], final[k], rtol=1e-5, atol=1e-6)


# --- Bad checkpoints: each a clear error, nothing loaded. ---

@pytest.fixture()
def damaged(zero3_lora: Path, tmp_path: Path) -> Path:
    """A copy of the zero3 run whose checkpoints the tests damage; resumed with 2 processes on zero3."""
    copy = tmp_path / "run"
    shutil.copytree(zero3_lora, copy, ignore=shutil.ignore_patterns("final"))
    return copy


def _resume(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return train_forked("zero3", 2, out, *LONGER, *extra, check=False)


def test_resume_path_that_does_not_exist(damaged: Path) -> None:
    proc = _resume(damaged, f"checkpoint.resume={damaged}/checkpoints/step-00000099")
    assert proc.returncode != 0 and "step-00000099' does not exist" in proc.stderr


def test_resume_with_changed_training_settings_needs_force(damaged: Path) -> None:
    proc = _resume(damaged, "optimizer.weight_decay=0.1")
    assert proc.returncode != 0 and "different training settings" in proc.stderr
    assert "resume_force" in proc.stderr


def test_truncated_weight_file_is_refused(damaged: Path) -> None:
    shard = ckpt(damaged, 16) / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"  # resume: auto
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = _resume(damaged)
    # meta.json recorded the file's size and sha256 at commit (the unpickling checks behind it have unit tests)
    assert proc.returncode != 0 and "does not hold what was committed" in proc.stderr and shard.name in proc.stderr


def test_pickle_payload_is_refused_without_running_it(damaged: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    torch.save({"last_epoch": Payload()}, ckpt(damaged, 16) / "custom_checkpoint_0.pkl")  # resume: auto
    # A forged meta.json (or one of an earlier version) carries no digests to stop it: the unpickling check must.
    meta = json.loads((ckpt(damaged, 16) / "meta.json").read_text())
    del meta["files"]
    (ckpt(damaged, 16) / "meta.json").write_text(json.dumps(meta))
    proc = _resume(damaged)
    assert proc.returncode != 0 and "Refusing to load checkpoint" in proc.stderr
    assert "custom_checkpoint_0.pkl" in proc.stderr and not marker.exists()
