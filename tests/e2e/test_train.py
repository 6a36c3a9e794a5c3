"""Single-process training runs: loss normalisation, full fine-tuning, LR scaling and run outputs.

The runs are forked from the session's relauncher (conftest.train_forked): these tests are about what trains, and
each run is a few seconds of training after ~10 s of imports that a launch would repeat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.conftest import train_forked
from toolkit.metrics.log import read_metrics

pytestmark = pytest.mark.slow


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]


def test_loss_and_update_do_not_depend_on_how_the_global_batch_is_split(tmp_path: Path) -> None:
    """micro 8 x accum 1, 4 x 2 and 1 x 8 see the same global batches of unequal-length, unequally-labelled
    samples; normalising by the global label-token count makes the losses and the trained adapter equal."""
    splits = {"8x1": (8, 1), "4x2": (4, 2), "1x8": (1, 8)}
    for name, (micro, accum) in splits.items():
        train_forked("single", 1, tmp_path / name, f"train.micro_batch_size={micro}", f"train.grad_accum={accum}")
    ref, ref_adapter = losses(tmp_path / "8x1"), load_file(tmp_path / "8x1" / "final" / "adapter_model.safetensors")
    for name in ("4x2", "1x8"):
        assert losses(tmp_path / name) == pytest.approx(ref, rel=1e-5)
        got = load_file(tmp_path / name / "final" / "adapter_model.safetensors")
        assert max((got[k] - ref_adapter[k]).abs().max().item() for k in ref_adapter) < 1e-6


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke recipe as it is (micro 2 x accum 2), named: test_run_outputs reads its outputs and
    test_linear_lr_scaling its lrs (a run name changes nothing that trains)."""
    out = tmp_path_factory.mktemp("plain") / "run"
    train_forked("single", 1, out, "run_name=my-run")
    return out


def test_run_outputs(plain_run: Path) -> None:
    out = plain_run
    records = read_metrics(out / "metrics.jsonl", "train")
    assert set(records[0]) >= {"step", "stage", "loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "samples"}
    assert [r["tokens"] for r in records] == sorted({r["tokens"] for r in records})  # cumulative, increasing
    run = json.loads((out / "run.json").read_text())
    assert run["run_name"] == "my-run" and run["effective_batch"] == 4 and run["strategy"] == "single"
    assert [s["steps"] for s in run["stages"]] == [4, 3]
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert saved["stages"][0]["lr"] == 2e-3 and saved["optimizer"]["max_grad_norm"] == 1.0  # defaults filled in
    assert (out / "final" / "adapter_config.json").is_file() and (out / "final" / "tokenizer.json").is_file()


def test_linear_lr_scaling(plain_run: Path, tmp_path: Path) -> None:
    """effective batch 4 (micro 2 x accum 2) against a reference of 2: every lr doubles."""
    plain, scaled = plain_run, tmp_path / "scaled"
    train_forked("single", 1, scaled, "optimizer.lr_scaling=linear", "optimizer.reference_batch_size=2")
    for a, b in zip(read_metrics(plain / "metrics.jsonl", "train"), read_metrics(scaled / "metrics.jsonl", "train"),
                    strict=True):
        assert b["lr"] == pytest.approx(2 * a["lr"])


def test_group_by_length_cuts_padding_without_changing_the_step(tmp_path: Path) -> None:
    plain, grouped = tmp_path / "plain", tmp_path / "grouped"
    train_forked("single", 1, plain, "train.micro_batch_size=2", "train.grad_accum=4")
    train_forked("single", 1, grouped, "train.micro_batch_size=2", "train.grad_accum=4", "data.group_by_length=true")
    a, b = read_metrics(plain / "metrics.jsonl", "train"), read_metrics(grouped / "metrics.jsonl", "train")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    assert sum(r["padding_fraction"] for r in b) < 0.8 * sum(r["padding_fraction"] for r in a)
