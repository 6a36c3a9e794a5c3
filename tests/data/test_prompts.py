"""An RL stage's prompt rows (toolkit/data/prompts.py), on real rows (tests/assets/wild/, origins in its README):
TRL's prompt-only rows, standard and conversational, read as they are; GSM8K and NuminaMath refused with the data
entry that reads them, which read as prompt and reference once applied; the rewards' reference checked."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import AutoTokenizer

from toolkit.config.schema import DataSource, DifficultyConfig, RewardConfig, RlConfig
from toolkit.config.stages import ResolvedStage, difficulty_entries
from toolkit.data.prompts import PromptRow, prompt_set, read_prompt_rows
from toolkit.data.sources import resolve_source
from toolkit.errors import ToolkitError

WILD = Path(__file__).parents[1] / "assets" / "wild"
ENTRY = re.compile(r"data entry: (\{.*\})")


@pytest.fixture(scope="module")
def tok(models: dict[str, str]) -> Any:
    return AutoTokenizer.from_pretrained(models["text"])


def rows_of(path: Path, columns: dict[str, str] | None = None) -> list[PromptRow]:
    entry = DataSource(path=str(path), columns=columns).entry()
    return list(read_prompt_rows(resolve_source(entry, path.parent)))


def read_after_fix(path: Path) -> tuple[list[PromptRow], dict[str, str]]:
    """The file's prompt rows, after applying the data entry its refusal gives (parsed as a recipe gives it)."""
    with pytest.raises(ToolkitError) as refused:
        rows_of(path)
    fix = ENTRY.search(str(refused.value))
    assert fix is not None, refused.value
    given = yaml.safe_load(fix.group(1))
    assert given["path"] == str(path)
    return rows_of(path, given["columns"]), given["columns"]


def test_trl_prompt_only_rows_read_as_they_are(tmp_path: Path) -> None:
    path = shutil.copy(WILD / "trl_prompt_only.jsonl", tmp_path)
    standard, conversational = rows_of(Path(path))
    assert standard.prompt == "The sky is" and not standard.conversational and standard.reference is None
    assert conversational.prompt == [{"role": "user", "content": "What color is the sky?"}]
    assert conversational.conversational and conversational.where.endswith("trl_prompt_only.jsonl:2")


@pytest.mark.parametrize(("name", "columns", "answer"), [
    ("gsm8k.jsonl", {"prompt": "question", "reference": "answer"}, "#### 72"),
    ("numinamath_tir.jsonl", {"prompt": "problem", "reference": "solution"}, "\\boxed{\\frac{63}{400}}"),
])
def test_math_datasets_read_through_the_columns_their_refusal_gives(tmp_path: Path, name: str,
                                                                    columns: dict[str, str], answer: str) -> None:
    path = Path(shutil.copy(WILD / name, tmp_path))
    original = json.loads(path.read_text().splitlines()[0])
    (row,), applied = read_after_fix(path)
    assert applied == columns
    assert row.prompt == original[columns["prompt"]] and answer in row.reference
    extra = set(original) - set(columns.values())
    assert set(row.columns) == extra  # every other column goes to the rewards (NuminaMath's messages)


def stage(paths: list[Path], rewards: list[str], *, max_seq_len: int = 256) -> ResolvedStage:
    entries = tuple(DataSource(path=str(p)).entry() for p in paths)
    return ResolvedStage(index=1, name="rl", paths=tuple(str(p) for p in paths), entries=entries, weights=None,
                         mixture_replacement=False, order="shuffle", pacing=None, max_seq_len=max_seq_len,
                         micro_batch_size=4, epochs=None, max_steps=1, lr=1e-4, warmup_ratio=0.0, min_lr_ratio=0.0,
                         schedule="constant", decay_ratio=0.1, eval=(), eval_micro_batch_size=4, trainable=None,
                         trainable_key="train.trainable", patience=None, patience_min_delta=0.0, objective="grpo",
                         rl=RlConfig(max_completion_length=16), rewards=tuple(RewardConfig(scorer=r) for r in rewards))


def test_a_reward_that_compares_needs_a_reference_in_every_row(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 2 =", "solution": "4"}) + "\n")
    sources = [resolve_source(e, tmp_path) for e in stage([path], ["contains"]).entries]
    with pytest.raises(ToolkitError) as e:
        prompt_set(stage([path], ["contains"]), sources, tok, thinking="auto")
    assert "p.jsonl:1: reward stages.1.rewards.0 (contains) compares each completion with the row's reference" \
        in str(e.value)
    fix = re.search(r"map it: (\{.*\})\.$", str(e.value))
    assert fix is not None
    mapped = DataSource(**yaml.safe_load(fix.group(1))).entry()
    (kept,) = prompt_set(stage([path], ["contains"]), [resolve_source(mapped, tmp_path)], tok,
                         thinking="auto").samples
    assert kept["reference"] == "4" and kept["columns"] == {}
    # A reward that does not compare takes the row as it is.
    assert len(prompt_set(stage([path], ["json_valid"]), sources, tok, thinking="auto").samples) == 1


def test_prompts_render_with_the_template_and_drop_those_leaving_no_room(tmp_path: Path, tok: Any) -> None:
    path = Path(shutil.copy(WILD / "trl_prompt_only.jsonl", tmp_path))
    src = prompt_set(stage([path], ["json_valid"]), [resolve_source(e, tmp_path) for e in
                                                     stage([path], ["json_valid"]).entries], tok, thinking="auto")
    standard, chat = src.samples
    assert standard["prompt_ids"] == tok("The sky is")["input_ids"]  # raw text, as TRL completes it
    rendered = tok.decode(chat["prompt_ids"])
    # Qwen3's non-thinking format, as the answers trained (data.thinking: auto), or the template's own with none.
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "What color is the sky?" in rendered
    own = prompt_set(stage([path], ["json_valid"]), [resolve_source(e, tmp_path) for e in
                                                     stage([path], ["json_valid"]).entries], tok, thinking="none")
    assert tok.decode(own.samples[1]["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert list(src.lengths) == [len(standard["prompt_ids"]), len(chat["prompt_ids"])]
    room = len(standard["prompt_ids"]) + 16  # the standard prompt fits with its 16 completion tokens, the chat not
    tight = prompt_set(stage([path], ["json_valid"], max_seq_len=room),
                       [resolve_source(e, tmp_path) for e in stage([path], ["json_valid"]).entries], tok,
                       thinking="auto")
    assert len(tight.samples) == 1 and tight.stats.dropped_overlength == 1


def test_rows_without_a_prompt_or_with_images_are_refused_naming_the_row(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    cases = [({"messages": [{"role": "user", "content": "hi"}]}, "an RL stage's row needs a 'prompt'"),
             ({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
              "the prompt's messages end with a 'assistant' turn"),
             ({"prompt": "hi", "images": ["a.png"]}, "the prompt has images")]
    for row, says in cases:
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(ToolkitError, match=re.escape(says)) as e:
            rows_of(path)
        assert str(e.value).startswith(f"{path}:1: ")


def test_prompts_carry_their_rows_difficulty_and_by_field_needs_it_in_every_row(tmp_path: Path, tok: Any) -> None:
    """A prompt's `difficulty` (dummy:letters' letter rarity, or `by: field`'s column) orders the stage as any
    row's does; `by: field` with a row without a number there is refused naming the row."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "level": lvl}) + "\n" for i, lvl in enumerate([0.5, 0.1])))
    ordered = replace(stage([path], ["json_valid"]), order="easy_to_hard",
                      difficulty=DifficultyConfig(by="field", field="level"))
    entries = difficulty_entries(list(ordered.entries), ordered.difficulty)
    src = prompt_set(ordered, [resolve_source(e, tmp_path) for e in entries], tok, thinking="auto")
    assert src.difficulty.tolist() == [0.5, 0.1]
    plain = replace(stage([path], ["json_valid"]), order="easy_to_hard")
    assert prompt_set(plain, [resolve_source(e, tmp_path) for e in entries], tok,
                      thinking="auto").difficulty.tolist() == [0.5, 0.1]  # unset: the rows' difficulty, as for rows
    path.write_text(json.dumps({"prompt": "q0", "level": 0.5}) + "\n" + json.dumps({"prompt": "q1", "level": "hard"})
                    + "\n")
    with pytest.raises(ToolkitError, match=r"p.jsonl:2: stage 'rl' orders its prompts by difficulty.field 'level', "
                                           r"and this row has no number there"):
        prompt_set(ordered, [resolve_source(e, tmp_path) for e in entries], tok, thinking="auto")
    assert prompt_set(plain, [resolve_source(e, tmp_path) for e in entries], tok,
                      thinking="auto").difficulty is None  # not every row has a number: token length orders


def test_the_role_table_names_a_prompt_rows_prompt_and_reference(tmp_path: Path) -> None:
    """A prompt row's prompt and reference are told by the role table (toolkit/data/roles.py), not a list of its
    own: names the table holds (`user_prompt`, `ground_truth`, as RLVR sets name them) give the entry that reads the
    file, and a reward that compares names the reference column a row left unmapped."""
    from toolkit.data.prompts import check_references

    path = tmp_path / "rlvr.jsonl"
    path.write_text(json.dumps({"user_prompt": "What is 2 + 2?", "ground_truth": "4", "source": "toy"}) + "\n")
    (row,), applied = read_after_fix(path)
    assert applied == {"prompt": "user_prompt", "reference": "ground_truth"}
    assert row.prompt == "What is 2 + 2?" and row.reference == "4" and row.columns == {"source": "toy"}
    (bare,) = rows_of(path, {"prompt": "user_prompt"})
    with pytest.raises(ToolkitError, match=r"has none; map it: \{path: rlvr\.jsonl, columns: \{reference: "
                                           r"ground_truth\}\}"):
        check_references([bare], [("exact", "exact")], "rlvr.jsonl")
