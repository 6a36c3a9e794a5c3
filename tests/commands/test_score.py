"""`toolkit score`: a stage's rows scored by the recipe's base model, as the scoring pass scores them; the report's
histogram and easiest / hardest rows; every row's score in parquet; the scores training takes kept for it (a stage
scored at step 0), those it cannot take (`current` after training steps) said so and not kept; a named --out is never
replaced. Under `accelerate launch`: tests/e2e/test_scored_curriculum.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import train_curriculum
from tests.helpers.inprocess import process_state_kept
from toolkit.commands.inspect_data import inspect_data
from toolkit.commands.score import score
from toolkit.config.load import load_recipe
from toolkit.data.plan import encode_files
from toolkit.errors import ToolkitError

ROWS = [("What is 2 + 2?", "4."), ("Name a colour.", "Blue, like the sky over the sea at noon."),
        ("Spell cat.", "c a t"), ("Count to five.", "one two three four five")]


@torch.no_grad()
def test_score_reports_and_writes_each_rows_score(tmp_path: Path, models: dict[str, str]) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n" for q, a in ROWS))
    tree: dict[str, Any] = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": models["text"]},
                            "lora": {"enabled": False}, "data": {"max_seq_len": 128, "num_proc": 1},
                            "stages": [{"name": "only", "data": [str(data)], "max_steps": 1, "order": "easy_to_hard",
                                        "difficulty": {"by": "ifd", "model": "current"}},
                                       {"name": "../../mine", "data": [str(data)], "max_steps": 1,  # a name, not a path
                                        "order": "easy_to_hard",
                                        "difficulty": {"by": "loss", "model": "current"}}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tree))
    recipe = load_recipe(tmp_path / "r.yaml")
    report = score(recipe, stage=None, out=None)
    table = pq.read_table(tmp_path / "run" / "scores" / "only.parquet").to_pydict()
    assert table["row"] == [f"{data}:{i}" for i in range(1, 5)]
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32).eval()
    rows = encode_files([data], tokenizer, max_seq_len=128, overlength="drop", train_on="assistant",
                        thinking=recipe.data.thinking).samples
    loss = np.array([float(model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]])).loss)
                     for r in rows])  # a plain full-logits mean over the row's label tokens
    np.testing.assert_allclose(np.array(table["loss_sum"]) / np.array(table["tokens"]), loss, atol=1e-5)
    ifd = (np.array(table["loss_sum"]) / table["tokens"]) / (np.array(table["alone_loss_sum"]) / table["alone_tokens"])
    np.testing.assert_allclose(table["ifd"], ifd, rtol=1e-12)
    easiest = int(np.argmin(table["ifd"]))
    assert "of the policy as it enters the stage at step 0: the model before training" in report.splitlines()[0]
    assert report.splitlines()[1].startswith("  (the scores training takes: kept in")
    kept = sorted(p.name for p in (tmp_path / "run" / "scores").glob("scores-*.npz"))
    assert len(kept) == 2  # the rows as trained and their responses alone (ifd), under training's keys
    named = tmp_path / "mine.parquet"  # where the stage name `../../mine` would lead, taken as a path
    named.write_text("the user's")
    later = score(recipe, stage="../../mine", out=None)  # scored by the policy at step 1, known only in training
    assert later.splitlines()[1].startswith("  (training orders this stage by the policy as it enters it, at step 1")
    assert sorted(p.name for p in (tmp_path / "run" / "scores").glob("scores-*.npz")) == kept
    assert named.read_text() == "the user's"  # the name became one component inside scores/ (path_component)
    np.testing.assert_array_equal(pq.read_table(tmp_path / "run" / "scores" / "_._.._mine.parquet")["loss_sum"],
                                  table["loss_sum"])  # the model before training, as it says
    assert report.split("easiest 4:\n")[1].splitlines()[0].endswith(f"{data}:{easiest + 1}")
    assert "scores: " in report and report.count("|") == 10  # the histogram's bins
    shown = inspect_data(recipe, stage="only", rows=2, colour=False)  # each row with its score
    assert f"--- {data}:2 (" in shown and f"ifd {table['ifd'][1]:.4g}) ---" in shown
    with pytest.raises(ToolkitError, match="exists; name a new file"):
        score(recipe, stage="only", out=named)
    assert named.read_text() == "the user's"
    with pytest.raises(ToolkitError, match="is not a stage of the recipe"):
        score(recipe, stage="nope", out=None)


def test_training_reads_the_scores_toolkit_score_kept(tmp_path: Path, models: dict[str, str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A stage ordered by the policy as it enters it, at step 0 (the model before training): `toolkit score` takes
    training's own scores, under training's key (the run's identity, its state and batches included), and the
    training run then reads them instead of scoring. (`base`, under a 2-process launch: tests/e2e.)"""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in ROWS * 2))
    tree: dict[str, Any] = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": models["text"]},
                            "data": {"max_seq_len": 128, "num_proc": 1},
                            "stages": [{"name": "first", "data": [str(data)], "max_steps": 1, "order": "easy_to_hard",
                                        "difficulty": {"by": "loss", "model": "current"}}],
                            "train": {"micro_batch_size": 2, "grad_accum": 2},
                            "logging": {"progress_bar": False, "trackers": []}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tree))
    report = score(load_recipe(tmp_path / "r.yaml"), stage=None, out=None)
    assert report is not None and "the scores training takes" in report
    (kept,) = (tmp_path / "run" / "scores").glob("scores-*.npz")
    with process_state_kept(), caplog.at_level(logging.INFO, logger="toolkit"):
        assert train_curriculum.main(["--config", str(tmp_path / "r.yaml")]) == 0
    assert f"stage 'first' scored by the current model at step 0: read from {kept}" in caplog.text
    assert "8/8 rows" not in caplog.text  # no pass: its progress line would say so
