"""A stage's rows by difficulty (toolkit/data/stages.py:load_stage): `difficulty.by` (a named row field, or token
length over a `difficulty` key the rows also carry), `drop` of the easiest and hardest shares ranked over all the
stage's sources together, counted in the stage's data line, and packed rows built from what is left."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from transformers import AutoTokenizer

from toolkit.config.identity import resume_invariants
from toolkit.config.load import load_recipe
from toolkit.config.schema import Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.stages import load_stage, run_stores, stage_summary


def _rows(path: Path, n: int, offset: int) -> None:
    """n rows: `score` counts down, `difficulty` up, and the answer grows with the row (its length)."""
    rows = [{"messages": [{"role": "user", "content": f"q{offset + i}"},
                          {"role": "assistant", "content": "a " * (1 + offset + i)}],
             "difficulty": float(offset + i), "score": float(100 - offset - i)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _recipe(tmp_path: Path, model: str, **stage: Any) -> Recipe:
    _rows(tmp_path / "a.jsonl", 6, 0)
    _rows(tmp_path / "b.jsonl", 4, 6)
    tree = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": model},
            "data": {"max_seq_len": 512, "num_proc": 1, **stage.pop("data", {})},
            "stages": [{"name": "s", "data": [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "max_steps": 1,
                        **stage}]}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    return load_recipe(tmp_path / "recipe.yaml")


def _load(recipe: Recipe, model: str) -> tuple[Any, str]:
    [stage] = resolve_stages(recipe)
    stores = run_stores([stage], recipe.data, AutoTokenizer.from_pretrained(model), None, Path("unused"), None)
    src = load_stage(stage, recipe.data, stores)
    return src, stage_summary(stage, src, recipe.data)


def _questions(src: Any) -> list[int]:
    """Which rows (by the number in their question) the stage kept, in stage order."""
    out = []
    for part in src.samples.parts:
        out += [int(part.store.where(int(i)).split(":")[-1]) - 1 + (6 if part.store.source.entry.path.endswith(
            "b.jsonl") else 0) for i in part.selection.index]
    return out


def test_drop_ranks_all_sources_together_and_says_how_many(tmp_path: Path, models: dict[str, str]) -> None:
    recipe = _recipe(tmp_path, models["text"], order="easy_to_hard", difficulty={"by": "field", "field": "score"},
                     drop={"easiest": 0.2, "hardest": 0.1})
    src, line = _load(recipe, models["text"])
    # score = 100 - row: the easiest (lowest score) are the last rows of b.jsonl, the hardest row 0 of a.jsonl
    assert _questions(src) == [1, 2, 3, 4, 5, 6, 7]
    np.testing.assert_array_equal(src.difficulty, [99, 98, 97, 96, 95, 94, 93])
    assert "10 rows, 7 kept" in line and "3 dropped by difficulty (drop)" in line


def test_a_drop_by_a_models_score_keeps_every_row_and_plans_its_counts(tmp_path: Path,
                                                                      models: dict[str, str]) -> None:
    """The scores exist only at training: the stage keeps all its rows (the model ranks them all) and carries
    how many the drop will leave out at each end, which the data line says."""
    recipe = _recipe(tmp_path, models["text"], difficulty={"by": "ifd", "model": "current"},
                     drop={"easiest": 0.2, "hardest": 0.15})
    src, line = _load(recipe, models["text"])
    assert _questions(src) == list(range(10)) and src.difficulty is None
    assert src.dropped_by_score == (2, 1) and src.planned_rows == 7
    assert "drop by ifd of the current model: 2 easiest and 1 hardest of 10 rows once scored, 7 kept" in line


def test_by_length_ignores_the_rows_difficulty_and_hard_to_easy_keeps_it_descending(
        tmp_path: Path, models: dict[str, str]) -> None:
    recipe = _recipe(tmp_path, models["text"], order="hard_to_easy", difficulty={"by": "length"},
                     drop={"hardest": 0.5})
    src, line = _load(recipe, models["text"])
    assert src.difficulty is None  # the sampler sorts by length
    assert _questions(src) == [0, 1, 2, 3, 4]  # the five longest answers (rows 5-9) dropped
    assert "5 dropped by difficulty" in line


def test_packed_rows_are_built_from_the_kept_rows(tmp_path: Path, models: dict[str, str]) -> None:
    recipe = _recipe(tmp_path, models["text"], order="easy_to_hard", drop={"easiest": 0.3},
                     data={"packing": True, "max_seq_len": 64})
    src, _ = _load(recipe, models["text"])
    kept = {(j, m) for j, part in enumerate(src.samples.parts) for k in range(len(part))
            for m in part.selection.index[part.members(k)].tolist()}
    assert sum(len(p.selection.index) for p in src.samples.parts) == 7 and len(kept) == 7
    assert len(src.difficulty) == len(src.samples)  # a packed row's difficulty: its hardest member's


def test_the_new_keys_bind_a_checkpoint_only_when_set(tmp_path: Path, models: dict[str, str]) -> None:
    plain = resume_invariants(_recipe(tmp_path, models["text"]))
    assert "difficulty" not in plain["stages"][0] and "drop" not in plain["stages"][0]  # earlier hashes unchanged
    assert not {"identical_pairs", "completion_newline", "renderer"} & plain["data"].keys()  # defaults: unbound
    assert resume_invariants(_recipe(tmp_path, models["text"], data={"identical_pairs": "skip"}))["data"][
        "identical_pairs"] == "skip"  # dropping pairs changes what trains: bound when set
    dropped = resume_invariants(_recipe(tmp_path, models["text"], drop={"easiest": 0.1}))
    assert dropped["stages"][0]["drop"] == {"easiest": 0.1, "hardest": 0.0}
    by_field = resume_invariants(_recipe(tmp_path, models["text"], order="easy_to_hard",
                                         difficulty={"by": "field", "field": "score"}))
    assert by_field["stages"][0]["difficulty"] == {"by": "field", "field": "score"}  # as before difficulty.model
    scored = resume_invariants(_recipe(tmp_path, models["text"], order="easy_to_hard",
                                       difficulty={"by": "ifd", "model": "current"}))
    assert scored["stages"][0]["difficulty"] == {"by": "ifd", "field": None, "model": "current"}  # the scorer binds


@pytest.mark.parametrize("stage, message", [
    ({"order": "easy_to_hard", "difficulty": {"by": "loss"}}, "name the scorer with difficulty.model"),
    ({"order": "easy_to_hard", "difficulty": {"by": "loss", "model": "Base"}}, "Did you mean: base"),
    ({"order": "easy_to_hard", "difficulty": {"by": "field", "field": "x", "model": "base"}},
     "difficulty.model scores rows only with"),
    ({"order": "easy_to_hard", "difficulty": {"by": "length", "field": "x"}}, "read only with by: field"),
    ({"order": "easy_to_hard", "drop": {"easiest": -0.1}}, "drop.easiest"),
    ({"order": "easy_to_hard", "drop": {"hardest": 1}}, "drop.hardest"),
    ({"order": "easy_to_hard", "drop": {"hardest": 0.1, "oldest": 0.1}}, "oldest"),
])
def test_bad_values_name_the_key(tmp_path: Path, models: dict[str, str], stage: dict[str, Any],
                                 message: str) -> None:
    from toolkit.errors import ToolkitError

    with pytest.raises(ToolkitError, match=message):
        _recipe(tmp_path, models["text"], **stage)
