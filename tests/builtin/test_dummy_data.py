"""Tests for the deterministic dummy curriculum datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.builtin.dummy_data import write_dummy_data

ROLES = {"system", "user", "assistant"}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_writes_both_stages(tmp_path: Path) -> None:
    paths = write_dummy_data(tmp_path / "data", 50)
    assert set(paths) == {"stage1", "stage2"}
    assert paths["stage1"] == tmp_path / "data" / "stage1.jsonl"
    assert paths["stage2"] == tmp_path / "data" / "stage2.jsonl"
    for path in paths.values():
        assert path.is_file()
        assert len(_rows(path)) == 50


def test_single_sample(tmp_path: Path) -> None:
    paths = write_dummy_data(tmp_path, 1)
    assert [len(_rows(p)) for p in paths.values()] == [1, 1]


def test_deterministic(tmp_path: Path) -> None:
    a = write_dummy_data(tmp_path / "a", 40, seed=3)
    b = write_dummy_data(tmp_path / "b", 40, seed=3)
    c = write_dummy_data(tmp_path / "c", 40, seed=4)
    for stage in ("stage1", "stage2"):
        assert a[stage].read_bytes() == b[stage].read_bytes()
        assert a[stage].read_bytes() != c[stage].read_bytes()


def test_row_schema(tmp_path: Path) -> None:
    paths = write_dummy_data(tmp_path, 200)
    for path in paths.values():
        for row in _rows(path):
            assert set(row) == {"messages", "difficulty"}
            assert isinstance(row["difficulty"], float)
            messages = row["messages"]
            assert all(set(m) == {"role", "content"} and m["role"] in ROLES for m in messages)
            assert all(isinstance(m["content"], str) and m["content"] for m in messages)
            assert any(m["role"] == "assistant" for m in messages)
            assert messages[-1]["role"] == "assistant"
            assert all(m["role"] != "system" for m in messages[1:])


def test_stage_shapes(tmp_path: Path) -> None:
    paths = write_dummy_data(tmp_path, 300)
    stage1, stage2 = _rows(paths["stage1"]), _rows(paths["stage2"])
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in stage1)
    assert any(len([m for m in r["messages"] if m["role"] == "assistant"]) > 1 for r in stage2)
    assert any(r["messages"][0]["role"] == "system" for r in stage2)

    def length(row: dict) -> int:
        return sum(len(m["content"]) for m in row["messages"])

    lengths = sorted(length(r) for r in stage2)
    assert lengths[-1] > 3 * lengths[len(lengths) // 2]  # long tail
    assert max(length(r) for r in stage1) < lengths[len(lengths) // 2]


def test_arithmetic_answers_are_correct(tmp_path: Path) -> None:
    for row in _rows(write_dummy_data(tmp_path, 100)["stage1"]):
        a, op, b, _, value = row["messages"][1]["content"].rstrip(".").split(" ")
        assert (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(value)


@pytest.mark.parametrize("bad", [0, -1])
def test_rejects_non_positive(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ValueError, match="num_samples"):
        write_dummy_data(tmp_path, bad)


def test_pairs_are_trl_explicit_conversational_and_plainly_ranked(tmp_path: Path) -> None:
    """`dummy:pairs`: as many pairs as the other files have rows, deterministic by seed, each a question with its
    right answer chosen and a wrong one rejected."""
    from toolkit.builtin.dummy_data import write_dummy_pairs

    path = write_dummy_pairs(tmp_path / "a", 40, seed=3)
    rows = _rows(path)
    assert path.name == "pairs.jsonl" and len(rows) == 40
    assert path.read_text() == write_dummy_pairs(tmp_path / "b", 40, seed=3).read_text()
    assert path.read_text() != write_dummy_pairs(tmp_path / "c", 40, seed=4).read_text()
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected", "difficulty"}
        [user], [chosen], [rejected] = row["prompt"], row["chosen"], row["rejected"]
        assert (user["role"], chosen["role"], rejected["role"]) == ("user", "assistant", "assistant")
        a, op, b = user["content"].removeprefix("What is ").rstrip("?").split()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert chosen["content"] == f"{a} {op} {b} = {right}."
        wrong = int(rejected["content"].rsplit("= ", 1)[1].rstrip("."))
        assert rejected["content"].startswith(f"{a} {op} {b} = ") and wrong != right


def test_use_dummy_data_gives_preference_stages_the_pairs() -> None:
    from toolkit.builtin.dummy_data import use_dummy_data
    from toolkit.config.schema import StageConfig

    stages = [StageConfig(name="sft", data=["x.jsonl"]), StageConfig(name="dpo", data=["y.jsonl"], objective="dpo"),
              StageConfig(name="more", data=["z.jsonl"])]
    use_dummy_data(stages, vision=False)
    assert [s.paths for s in stages] == [["dummy:stage1"], ["dummy:pairs"], ["dummy:stage2"]]


def test_letters_are_prompt_only_rows_whose_pass_rate_the_tiny_model_spreads(tmp_path: Path,
                                                                             models: dict[str, str]) -> None:
    """`dummy:letters`: deterministic prompt-only rows with a letter for reference; on the tiny random Qwen3, sampled
    completions (the RL rollout, scored by the `contains` reward) hold a common letter far more often than a rare
    one: a task with pass rates to learn from and to order by."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.builtin.dummy_data import LETTERS_BY_FREQUENCY, write_dummy_letters
    from toolkit.evals.rewards import build_rewards
    from toolkit.evals.rollout import rollout

    path = write_dummy_letters(tmp_path / "a", 50, seed=1)
    rows = _rows(path)
    assert path.name == "letters.jsonl" and len(rows) == 50
    assert path.read_text() == write_dummy_letters(tmp_path / "b", 50, seed=1).read_text()
    assert path.read_text() != write_dummy_letters(tmp_path / "c", 50, seed=2).read_text()
    for row in rows:
        [user] = row["prompt"]
        assert set(row) == {"prompt", "reference", "difficulty"} and user["role"] == "user"
        assert row["reference"] in user["content"] and row["reference"] in LETTERS_BY_FREQUENCY
    assert len({r["reference"] for r in rows}) > 10

    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    (contains,) = build_rewards([{"scorer": {"kind": "contains", "lower": True}}], key="stages.0.rewards",
                                recipe_dir=tmp_path, max_completion_length=4)
    common, rare = (next(r for r in rows if r["reference"] == c) for c in ("e", "z"))
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in (common, rare)]
    out = rollout(model, prompts, [0, 1], num_generations=32, max_completion_length=4, temperature=1.0, top_p=1.0,
                  seed=0, step=0, eos_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id,
                  prompts_per_batch=2)
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    scores = contains(["p"] * 64, texts, out.completion_ids, {"reference": ["e"] * 32 + ["z"] * 32},
                      [f"letters.jsonl:{i}" for i in range(64)])
    common_rate, rare_rate = sum(scores[:32]) / 32, sum(scores[32:]) / 32  # type: ignore[arg-type]
    assert common_rate > rare_rate + 0.25 and 0 < common_rate < 1, (common_rate, rare_rate)


def test_use_dummy_data_gives_rl_stages_the_letters() -> None:
    from types import SimpleNamespace

    from toolkit.builtin.dummy_data import use_dummy_data

    stages = [SimpleNamespace(paths=["x.jsonl"], data=["x.jsonl"], objective=o) for o in ("sft", "grpo", "dpo")]
    use_dummy_data(stages, vision=False)  # type: ignore[arg-type]
    assert [s.data for s in stages] == [["dummy:stage1"], ["dummy:letters"], ["dummy:pairs"]]
