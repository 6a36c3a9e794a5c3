"""`toolkit score`: a stage's rows scored by the recipe's base model, as the scoring pass scores them; the report's
histogram and easiest / hardest rows; every row's score in parquet; a named --out is never replaced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

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
                                        "difficulty": {"by": "ifd", "model": "current"}}]}
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
    assert report.splitlines()[1].startswith("  (training orders this stage by the policy as it enters it")
    assert report.split("easiest 4:\n")[1].splitlines()[0].endswith(f"{data}:{easiest + 1}")
    assert "scores: " in report and report.count("|") == 10  # the histogram's bins
    shown = inspect_data(recipe, stage="only", rows=2, colour=False)  # each row with its score
    assert f"--- {data}:2 (" in shown and f"ifd {table['ifd'][1]:.4g}) ---" in shown
    named = tmp_path / "mine.parquet"
    named.write_text("the user's")
    with pytest.raises(ToolkitError, match="exists; name a new file"):
        score(recipe, stage="only", out=named)
    assert named.read_text() == "the user's"
    with pytest.raises(ToolkitError, match="is not a stage of the recipe"):
        score(recipe, stage="nope", out=None)
