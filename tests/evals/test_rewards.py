"""Rewards of RL stages (toolkit/evals/rewards.py): the scorers as rewards, the math verifier, think format and soft
overlong punishment against TRL's own reward functions, TRL's functions run unchanged as `module:function`, None
skipping, and bad rewards refused in one line naming the key or the row."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

from toolkit.errors import ToolkitError
from toolkit.evals.rewards import Reward, build_rewards, check_references, score_completions

WILD = Path(__file__).resolve().parents[1] / "assets" / "wild"


def rewards(*entries: Any, recipe_dir: Path = WILD, max_len: int = 10) -> list[Reward]:
    """The rewards of `entries` (a bare scorer stands for {scorer: it})."""
    entries = tuple(e if isinstance(e, dict) else {"scorer": e} for e in entries)
    return build_rewards(list(entries), key="stages.1.rewards", recipe_dir=recipe_dir, max_completion_length=max_len)


def call(reward: Reward, completions: list[Any], references: list[Any] | None = None,
         ids: list[list[int]] | None = None, **columns: list[Any]) -> list[float | None]:
    n = len(completions)
    cols = {"reference": references or [None] * n, **columns}
    return reward(["p"] * n, completions, ids or [[1]] * n, cols, [f"train.jsonl:{i + 1}" for i in range(n)])


def test_generation_eval_scorers_are_rewards() -> None:
    exact, contains, regex, json_valid = rewards("exact", {"scorer": "contains", "weight": 0.5},
                                                 {"scorer": {"kind": "regex", "pattern": r"= (-?\d+)\.$"}},
                                                 "json_valid")
    assert call(exact, ["<think>hm</think> Paris", "Lyon"], ["Paris", "Paris"]) == [1.0, 0.0]
    assert contains.weight == 0.5 and call(contains, ["in Paris."], ["Paris"]) == [1.0]
    assert call(regex, ["2 + 2 = 4.", "2 + 2 = 5."], ["4", "4"]) == [1.0, 0.0]
    assert call(json_valid, ['{"a": 1}', "{a"]) == [1.0, 0.0]
    assert [r.needs_reference for r in (exact, contains, regex, json_valid)] == [True, True, True, False]


def test_math_verifier_reads_a_gsm8k_answer_and_equals_trl_accuracy_reward() -> None:
    (math_reward,) = rewards({"scorer": "math"})
    row = json.loads((WILD / "gsm8k.jsonl").read_text().splitlines()[0])  # openai/gsm8k, train row 1
    outputs = ["She sold 48 + 24 = 72 clips.", "She sold 48 + 12 = 60 clips.", "<think>48/2=24</think> 72"]
    assert call(math_reward, outputs, [row["answer"]] * 3) == [1.0, 0.0, 1.0]
    # LaTeX answers, as TRL's accuracy_reward (math-verify) scores them; an unreadable reference skips (None)
    latex = ["The answer is $\\frac{1}{2}$.", "So $x = \\boxed{0.5}$", "It is $\\sqrt{2}$", "$3$"]
    solutions = ["$0.5$", "$\\frac{1}{2}$", "$2$", "not math at all"]
    expected = accuracy_reward([[{"content": c}] for c in latex], solutions)
    assert call(math_reward, latex, solutions) == expected == [1.0, 1.0, 0.0, None]


def test_think_format_and_soft_overlong_equal_trl() -> None:
    think, overlong = rewards("think_format", {"scorer": {"kind": "overlong", "soft_punish_cache": 4}}, max_len=10)
    texts = ["<think>\nwhy\n</think>\nanswer", "<think>why\nanswer", "answer", "<think>a</think><think>b</think>x"]
    assert call(think, texts) == think_format_reward([[{"content": t}] for t in texts]) == [1.0, 0.0, 0.0, 0.0]
    ids = [[1] * n for n in (3, 6, 7, 9, 10, 12)]
    assert call(overlong, ["x"] * 6, ids=ids) == get_soft_overlong_punishment(10, 4)(ids) == \
        [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]


def test_trl_reward_functions_run_unchanged_as_module_function(tmp_path: Path) -> None:
    think, accuracy = rewards("trl.rewards:think_format_reward", "trl.rewards:accuracy_reward")
    conversational = [[{"role": "assistant", "content": "<think>x</think> $\\boxed{2}$"}],
                      [{"role": "assistant", "content": "$\\boxed{3}$"}]]
    assert call(think, conversational) == [1.0, 0.0]
    assert call(accuracy, conversational, solution=["$2$", "$2$"]) == [1.0, 0.0]  # an extra column: solution
    assert accuracy.name == "accuracy_reward" and accuracy.user


def write_module(folder: Path, name: str, body: str) -> Path:
    (folder / f"{name}.py").write_text(body)
    return folder


def test_none_skips_and_the_weighted_columns(tmp_path: Path) -> None:
    folder = write_module(tmp_path, "graded_rewards", "def graded(prompts, completions, completion_ids, level):\n"
                                    "    return [None if lv is None else len(c) * lv for c, lv in "
                                    "zip(completions, level)]\n")
    graded, exact = rewards({"scorer": "graded_rewards:graded", "weight": 2.0}, "exact", recipe_dir=folder)
    table, error = score_completions([graded, exact], ["p"] * 3, ["ab", "abc", "x"], [[1], [2], [3]],
                                     {"reference": ["ab", "x", "x"], "level": [1, None, 2], "other": [0, 0, 0]},
                                     ["a:1", "a:2", "a:3"])
    assert error is None
    torch.testing.assert_close(table, torch.tensor([[2.0, 1.0], [math.nan, 0.0], [2.0, 1.0]]), equal_nan=True)


def test_a_user_function_that_raises_is_one_line_naming_it_and_the_row(tmp_path: Path) -> None:
    folder = write_module(tmp_path, "picky_rewards", "def picky(prompts, completions, completion_ids, **kw):\n"
                                    "    return [1.0 / (len(c) - 3) for c in completions]\n"
                                    "def short(prompts, completions, completion_ids, **kw):\n    return [1.0]\n"
                                    "def wrong(prompts, completions, completion_ids, **kw):\n"
                                    "    return ['yes' for c in completions]\n")
    picky, short, wrong = rewards("picky_rewards:picky", "picky_rewards:short", "picky_rewards:wrong",
                                  recipe_dir=folder)
    _, error = score_completions([picky], ["p"] * 3, ["ab", "abc", "x"], [[1]] * 3, {}, ["t.jsonl:4", "t.jsonl:5",
                                                                                       "t.jsonl:6"])
    assert error == ("reward stages.1.rewards.0 ('picky') failed on t.jsonl:5: ZeroDivisionError: float division "
                     "by zero")
    with pytest.raises(ToolkitError, match=r"returned 1 values for a batch of 2 completions"):
        call(short, ["a", "b"])
    with pytest.raises(ToolkitError, match=r"returned 'yes' on train.jsonl:1; a reward returns a finite number"):
        call(wrong, ["a"])


@pytest.mark.parametrize(("entry", "message"), [
    ("nope:missing", r"stages.1.rewards.0 \('nope:missing'\): module 'nope' could not be imported"),
    ("math:floor_divide_missing", r"module 'math' .* has no function 'floor_divide_missing'"),
    ("math:sqrt", r"cannot be called as sqrt\(prompts=..., completions=..., completion_ids=..."),
    ("bleu", r"stages.1.rewards.0.scorer: unknown reward kind 'bleu'"),
    ({"scorer": "math", "weight": "high"}, r"stages.1.rewards.0.weight is 'high'"),
    ({"scorer": "exact", "weigth": 1}, r"a reward is \{scorer: ..., weight: ...\}"),
    ({"scorer": {"kind": "overlong", "soft_punish_cache": 11}}, r"soft_punish_cache is 11; give a token count in 1"),
    ({"scorer": {"kind": "math", "strict": True}}, r"strict is not an option of a math reward"),
    ({"scorer": {"kind": "regex", "pattern": "("}}, r"stages.1.rewards.0.scorer: .*not a valid regular expression"),
])
def test_bad_rewards_are_refused_in_one_line(entry: Any, message: str) -> None:
    with pytest.raises(ToolkitError, match=message):
        rewards(entry)


def test_names_must_differ_and_references_must_be_there() -> None:
    with pytest.raises(ToolkitError, match=r"two rewards are named 'exact'.*give one a name"):
        rewards("exact", {"scorer": "exact", "weight": 0.1})
    renamed = rewards("exact", {"scorer": {"kind": "exact", "name": "exact_lower", "lower": True}})
    assert [r.name for r in renamed] == ["exact", "exact_lower"]
    check_references(rewards("think_format"), [None], ["t.jsonl:1"])  # no reward needs one
    with pytest.raises(ToolkitError, match=r"t.jsonl:2: reward stages.1.rewards.1 \('math'\) compares with the "
                                           r"row's reference and the row has none.*columns: \{reference: answer\}"):
        check_references(rewards("think_format", "math"), ["1", None], ["t.jsonl:1", "t.jsonl:2"])
