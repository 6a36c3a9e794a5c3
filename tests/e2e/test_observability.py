"""Metrics, evaluation, stability guards, trackers, preflight and plots."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, train_forked
from tests.helpers.inprocess import Call, invoke, toolkit_run
from toolkit.metrics.log import Meter, read_metrics, sample_lengths

SHORT = ("stages.0.max_steps=4", "stages.1.max_steps=3")


def train_records(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def eval_records(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]


class _OneProcess:
    num_processes = 1

    @staticmethod
    def reduce(t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return t


def test_meter_counts_non_pad_tokens_only() -> None:
    meter = Meter(torch.device("cpu"))
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])}
    meter.add_batch(batch, flops=1e9, samples=2)
    meter.add_step(2.0, skipped=False)
    record = meter.record(_OneProcess(), peak_flops=1e12)
    assert record["tokens"] == 7 and record["padding_fraction"] == pytest.approx(3 / 10)
    assert record["loss"] == 2.0 and record["mfu"] > 0 and record["skipped"] == 0
    packed = {"input_ids": torch.ones(1, 9, dtype=torch.long)}  # padding-free: every token is real
    meter.add_batch(packed, flops=0.0, samples=3)
    assert meter.record(_OneProcess(), peak_flops=None)["tokens"] == 7 + 9


def test_sample_lengths_of_packed_rows() -> None:
    assert sample_lengths({"input_ids": [5, 6, 7]}) == [3]
    assert sample_lengths({"input_ids": [0] * 7, "position_ids": [0, 1, 2, 0, 1, 0, 1]}) == [3, 2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_poisoned_batch_on_one_rank_skips_the_step_on_all(strategy: str, tmp_path: Path) -> None:
    out = tmp_path / strategy
    train_forked(strategy, 2, out, *SHORT, "checkpoint.save_steps=1", "checkpoint.keep_last=10",
                 env={"TOOLKIT_FAULT_NONFINITE": "3:1"})  # rank 1's loss is NaN at step 3
    records = train_records(out)
    assert [r["skipped"] for r in records] == [0, 0, 1, 0, 0, 0, 0]
    # The skipped step's NaN loss is written as JSON null (bare NaN is not JSON).
    assert records[2]["loss"] is None and all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)
    assert "NaN" not in (out / "metrics.jsonl").read_text()

    def state(step: int) -> dict[str, torch.Tensor]:
        return load_file(out / "checkpoints" / f"step-{step:08d}" / "portable" / "lora_state.safetensors")

    before, skipped, after = state(2), state(3), state(4)
    assert all(torch.equal(before[k], skipped[k]) for k in before), "the vetoed step changed weights or Adam state"
    assert any(not torch.equal(skipped[k], after[k]) for k in before), "training did not continue"


@pytest.mark.slow
def test_too_many_consecutive_skips_stops_naming_the_last_good_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "diverged"
    proc = train_forked("single", 1, out, *SHORT, "checkpoint.save_steps=2", "stability.max_consecutive_skips=2",
                        "train.micro_batch_size=4", check=False, env={"TOOLKIT_FAULT_NONFINITE": "3:0,4:0"})
    assert proc.returncode != 0
    assert "2 consecutive steps skipped up to step 4 in stage 'short'" in proc.stderr
    assert "step-00000002" in proc.stderr


@pytest.mark.slow
def test_eval_loss_from_two_processes_equals_one_process(tmp_path: Path) -> None:
    evals = ("eval.data=[dummy:stage2]", "eval.every_steps=2")
    train_forked("single", 1, tmp_path / "one", *SHORT, *evals, "train.micro_batch_size=4", "eval.micro_batch_size=3")
    train_forked("zero3", 2, tmp_path / "two", *SHORT, *evals, "eval.micro_batch_size=3")
    one, two = eval_records(tmp_path / "one"), eval_records(tmp_path / "two")
    assert [r["step"] for r in one] == [2, 4, 6, 7] == [r["step"] for r in two]
    assert [r["eval_loss"] for r in two] == pytest.approx([r["eval_loss"] for r in one], rel=1e-5)
    assert one[0]["eval_tokens"] == two[0]["eval_tokens"] > 0
    assert one[-1]["eval_ppl"] == pytest.approx(math.exp(one[-1]["eval_loss"]))


@pytest.mark.slow
def test_live_metrics_and_mfu(tmp_path: Path, toolkit: Callable) -> None:
    out = tmp_path / "run"
    train_forked("single", 1, out, *SHORT, "logging.peak_tflops=0.5", "logging.trackers=[tensorboard]")
    records = train_records(out)
    for key in ("tokens_per_sec", "samples_per_sec", "step_time", "mfu", "peak_memory_gb", "padding_fraction"):
        assert all(r[key] is not None and r[key] >= 0 for r in records), key
    assert all(0 < r["mfu"] < 1 for r in records)
    assert any((out / "trackers").rglob("events.out.tfevents.*")), "no TensorBoard event file"
    proc = toolkit("plot", str(out))
    assert proc.returncode == 0, proc.stderr
    png = out / "training.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize(("trackers", "fix"), [
    ("[mlflow]", "pip install 'curriculum-toolkit[mlflow]'"),
    ("[tensorboard, wandb, trackio]", "pip install tensorboard 'curriculum-toolkit[wandb,trackio]'")])
def test_missing_tracker_names_the_package(trackers: str, fix: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("tensorboard", "wandb", "mlflow", "trackio"):  # as Python marks a module that cannot be imported
        monkeypatch.setitem(sys.modules, name, None)
    rc, stderr = invoke(Call([f"output_dir={tmp_path / 'o'}", f"logging.trackers={trackers}"], tmp_path / "o"), REPO,
                        monkeypatch)  # train_curriculum.py's main, in this process
    assert rc == 2 and f"{fix} (or remove it from logging.trackers)" in stderr, stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture
def toolkit(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
            ) -> Callable[..., subprocess.CompletedProcess]:
    """`toolkit(*args)`: the `toolkit` command, run in this process (tests/helpers/inprocess.py)."""
    return lambda *args: toolkit_run(list(args), monkeypatch, capsys)


def test_preflight_table_recommendation_and_data_scan(tmp_path: Path, toolkit: Callable) -> None:
    proc = toolkit("preflight", "--accelerate-config", "accelerate_configs/zero3.yaml", "--num-gpus", "2",
                    "--gpu-memory-gb", "24", "--no-data")
    assert proc.returncode == 0, proc.stderr
    for strategy in ("ddp", "zero2", "zero3", "zero3_offload", "fsdp"):
        assert f"\n{strategy} " in proc.stdout
    assert "selected by accelerate_configs/zero3.yaml: zero3" in proc.stdout and "recommended:" in proc.stdout
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [{{name: s, data: [{data}]}}]\ndata: {{max_seq_len: 7}}\n")
    proc = toolkit("preflight", "--config", str(recipe), "--accelerate-config", "accelerate_configs/ddp.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "s: 2 rows" in proc.stdout and "1 over max_seq_len, 1 without trainable tokens" in proc.stdout


def test_preflight_unknown_model_is_a_clear_error(toolkit: Callable) -> None:
    proc = toolkit("preflight", "--no-data", "model.name_or_path=acme/unknown-13b")
    assert proc.returncode == 2 and "Unknown model 'acme/unknown-13b'" in proc.stderr and "qwen3-8b" in proc.stderr


@pytest.mark.parametrize("recipe", ["recipes/smoke_vl.yaml", "recipes/qwen2_5_vl_7b_curriculum.yaml"])
def test_preflight_of_vision_language_recipes(recipe: str, toolkit: Callable) -> None:
    """Memory table from the VL config (tiny built locally, 7B from the shipped config); the stages' rows read as
    training reads them where the data and the processor are here (the smoke recipe's dummy data is not generated
    yet; the 7B processor is read from the local cache only)."""
    proc = toolkit("preflight", "--config", recipe, "--accelerate-config", "accelerate_configs/zero3.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "\nzero3 " in proc.stdout
    assert "\n  align: data not found" in proc.stdout if "smoke" in recipe else (
        "is not in the local Hugging Face cache (preflight does not download)" in proc.stdout
        or "stage data (the rows training reads" in proc.stdout)
