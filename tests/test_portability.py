"""Checkpoints across strategies and world sizes, export, and refusal of bad checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import REPO, run_env, train
from toolkit.metrics import read_metrics

pytestmark = pytest.mark.slow

LONGER = ("stages.0.max_steps=10", "stages.1.max_steps=6", "checkpoint.save_steps=5", "checkpoint.keep_last=5")
SINGLE_SAME_BATCH = "train.micro_batch_size=4"  # 4 x 2 accum x 1 = 2 x 2 accum x 2 processes


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")}


def ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("portability")


@pytest.fixture(scope="module")
def zero3_lora(runs: Path) -> Path:
    train("zero3", 2, runs / "zero3", *LONGER)
    return runs / "zero3"


@pytest.fixture(scope="module")
def zero3_full(runs: Path) -> Path:
    train("zero3", 2, runs / "zero3-full", "lora.enabled=false", *LONGER)
    return runs / "zero3-full"


def test_zero3_x2_resumes_on_one_process(zero3_lora: Path, runs: Path) -> None:
    out = runs / "zero3-to-single"
    proc = train("single", 1, out, *LONGER, SINGLE_SAME_BATCH, f"checkpoint.resume={ckpt(zero3_lora, 10)}")
    assert "resumed (portable)" in proc.stderr
    got, ref = losses(out), losses(zero3_lora)
    assert sorted(got) == list(range(11, 17))
    assert [got[s] for s in got] == pytest.approx([ref[s] for s in got], rel=1e-4)


def test_one_process_resumes_on_fsdp_x2(runs: Path) -> None:
    single, out = runs / "single", runs / "single-to-fsdp"
    train("single", 1, single, *LONGER, SINGLE_SAME_BATCH)
    proc = train("fsdp", 2, out, *LONGER, f"checkpoint.resume={ckpt(single, 10)}")
    assert "resumed (portable)" in proc.stderr
    got, ref = losses(out), losses(single)
    assert [got[s] for s in got] == pytest.approx([ref[s] for s in got], rel=1e-4)


CURRICULUM = "recipes/smoke_curriculum.yaml"  # LoRA in stage 1, only model.norm in stage 2, both in stage 3


@pytest.fixture(scope="module")
def curriculum_zero3(runs: Path) -> Path:
    train("zero3", 2, runs / "curriculum-zero3", "checkpoint.save_steps=2", "checkpoint.keep_last=10",
          recipe=CURRICULUM)
    return runs / "curriculum-zero3"


def test_portable_resume_inside_a_stage_that_freezes_lora(curriculum_zero3: Path, runs: Path) -> None:
    """smoke_curriculum: LoRA trains in stage 1, only the norm in stage 2. At step 6 the adapters have 4 Adam
    updates and the norm 2, not 6: the portable state carries each parameter's own count into the new layout."""
    src, out = curriculum_zero3, runs / "curriculum-to-single"
    proc = train("single", 1, out, SINGLE_SAME_BATCH, "stages.2.micro_batch_size=2",
                 f"checkpoint.resume={ckpt(src, 6)}", recipe=CURRICULUM)
    assert "resumed (portable)" in proc.stderr
    with safe_open(ckpt(src, 6) / "portable" / "lora_state.safetensors", "pt") as f:
        steps = json.loads(f.metadata()["adam_steps"])
    assert {n: s for n, s in steps.items() if "norm" in n} == {
        "base_model.model.model.norm.modules_to_save.default.weight": 2}
    assert {s for n, s in steps.items() if "lora_" in n} == {4}
    got, ref = losses(out), losses(src)
    assert sorted(got) == list(range(7, 12))
    assert [got[s] for s in got] == pytest.approx([ref[s] for s in got], rel=1e-4)


def test_full_finetuning_on_another_world_size_names_both_layouts(zero3_full: Path, runs: Path) -> None:
    out = runs / "full-to-single"
    proc = train("single", 1, out, "lora.enabled=false", *LONGER, SINGLE_SAME_BATCH,
                 f"checkpoint.resume={ckpt(zero3_full, 10)}", check=False)
    assert proc.returncode != 0 and "loading" not in proc.stderr, proc.stderr[-2000:]  # before the model
    assert "zero3 x 2" in proc.stderr and "single x 1" in proc.stderr and "toolkit export" in proc.stderr


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit.cli", "export", *args], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)


def _no_empty_tensors(path: Path) -> None:
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            assert all(f.get_slice(k).get_shape() and min(f.get_slice(k).get_shape()) > 0 for k in f.keys())  # noqa: SIM118


def test_export_lora_adapter_and_merged_model_agree(zero3_lora: Path, tmp_path: Path) -> None:
    source = ckpt(zero3_lora, 15)
    for args in ([str(source), "--out", str(tmp_path / "adapter")],
                 [str(source), "--out", str(tmp_path / "merged"), "--merge"]):
        proc = _export(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _no_empty_tensors(tmp_path / "adapter")
    _no_empty_tensors(tmp_path / "merged")
    assert "| short | 10 |" in (tmp_path / "adapter" / "README.md").read_text()
    base_dir = zero3_lora.parent / ".toolkit-cache" / "tiny-qwen3"
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(3, 900, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, rtol=1e-4, atol=1e-4)
        # the adapter is not a no-op: the exported LoRA changes the base model's logits
        assert not torch.allclose(adapter(ids).logits, AutoModelForCausalLM.from_pretrained(base_dir)(ids).logits)


def test_export_carries_modules_trained_by_stage_patterns(curriculum_zero3: Path, tmp_path: Path) -> None:
    """The norm trains only through stages[].trainable (a PEFT modules_to_save): an export from a checkpoint must
    rebuild it as training did and carry its trained weight, as the final adapter does."""
    proc = _export(str(ckpt(curriculum_zero3, 10)), "--out", str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(ckpt(curriculum_zero3, 10) / "portable" / "lora_state.safetensors", "pt") as f:
        trained = f.get_tensor("param/base_model.model.model.norm.modules_to_save.default.weight")
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    torch.testing.assert_close(exported["base_model.model.model.norm.weight"], trained, rtol=0, atol=0)
    base = AutoModelForCausalLM.from_pretrained(curriculum_zero3.parent / ".toolkit-cache" / "tiny-qwen3")
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    norm = dict(model.named_parameters())["base_model.model.model.norm.modules_to_save.default.weight"]
    assert torch.equal(norm.detach(), trained)


def test_export_vision_language_checkpoint_merged(tmp_path: Path) -> None:
    """A VL run (projector trained through `trainable`) exports merged, with its processor, loadable as it is."""
    from transformers import AutoModelForImageTextToText, ProcessorMixin

    from toolkit.model import load_processor

    run = tmp_path / "vl"
    train("single", 1, run, "train.micro_batch_size=4", recipe="recipes/smoke_vl.yaml")
    proc = _export(str(ckpt(run, 8)), "--out", str(tmp_path / "merged"), "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    # through the toolkit's loader: a bare AutoProcessor returns the tokenizer when the tiny class is not registered
    processor = load_processor(str(tmp_path / "merged"), trust_remote_code=False, chat_template=None)
    assert isinstance(processor, ProcessorMixin) and processor.image_processor is not None
    with safe_open(ckpt(run, 8) / "portable" / "lora_state.safetensors", "pt") as f:
        merger = f.get_tensor("param/base_model.model.model.visual.merger.modules_to_save.default.mlp.0.weight")
    assert torch.equal(dict(model.named_parameters())["model.visual.merger.mlp.0.weight"].detach(), merger)


def test_export_full_finetuning_from_zero3_shards(zero3_full: Path, tmp_path: Path) -> None:
    """The last checkpoint's consolidated ZeRO-3 shards equal the run's gathered final model."""
    proc = _export(str(ckpt(zero3_full, 16)), "--out", str(tmp_path / "full"))
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
    return train("zero3", 2, out, *LONGER, *extra, check=False)


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
