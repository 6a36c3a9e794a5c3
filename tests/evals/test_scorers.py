"""Scorers of generation evals: the built-ins with their normalisation, user functions from the recipe's folder or
the installed packages, and a broken scorer named in one error line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from toolkit.config.load import load_recipe
from toolkit.config.schema import GenerationEvalConfig, ScorerConfig
from toolkit.errors import ToolkitError
from toolkit.evals.scorers import answer_of, build_scorer, import_function

HERE = Path(__file__).resolve().parent


def score(spec: dict | str, output: str, reference: object = None, row: dict | None = None,
          recipe_dir: Path = HERE) -> float:
    config = GenerationEvalConfig(name="e", data=["x.jsonl"], scorers=[spec])
    scorer = build_scorer(config.scorers[0], key="eval.generation.0.scorers.0", recipe_dir=recipe_dir)
    return scorer(output, reference, row or {}, "eval.jsonl:1")


def test_exact_with_its_normalisation_options() -> None:
    assert score("exact", " Paris\n", "Paris") == 1.0  # strip is on by default
    assert score({"kind": "exact", "strip": False}, " Paris", "Paris") == 0.0
    assert score("exact", "paris", "Paris") == 0.0
    assert score({"kind": "exact", "lower": True}, "PARIS", "Paris") == 1.0
    assert score("exact", "New  York", "New York") == 0.0
    assert score({"kind": "exact", "whitespace": True}, " New \n York ", "New York") == 1.0


def test_contains_regex_and_json_valid() -> None:
    assert score("contains", "The answer is 42.", "42") == 1.0
    assert score("contains", "The answer is 41.", "42") == 0.0
    assert score({"kind": "contains", "lower": True}, "It is RED.", "red") == 1.0
    # with a pattern: its match (the first group) is the answer, compared with the reference
    final_number = {"kind": "regex", "pattern": r"= (-?\d+)\.$"}
    assert score(final_number, "3 + 4 = 7.", "7") == 1.0
    assert score(final_number, "3 + 4 = 8.", "7") == 0.0
    assert score(final_number, "seven", "7") == 0.0
    assert score({"kind": "regex", "pattern": r"\d+"}, "about 12 apples", "12") == 1.0  # no group: the whole match
    # without one: the reference is the pattern
    assert score("regex", "colour: blue", r"\b(blue|navy)\b") == 1.0
    assert score("regex", "colour: red", r"\b(blue|navy)\b") == 0.0
    assert score("json_valid", '{"a": [1, 2]}') == 1.0
    assert score("json_valid", '```json\n{"a": 1}\n```') == 1.0  # one Markdown fence is allowed
    assert score("json_valid", '{"a": 1') == 0.0
    assert score("json_valid", "") == 0.0


def test_scorers_see_the_answer_after_a_think_block() -> None:
    assert answer_of("<think>\nLet me add.\n</think>\n\n4") == "4"
    assert answer_of("4 <think>x</think>") == "4 <think>x</think>"  # only a leading block
    assert score("exact", "<think>\n\n</think>\n\nblue", "blue") == 1.0


def test_user_function_from_the_recipe_folder(tmp_path: Path) -> None:
    (tmp_path / "my_scorers.py").write_text(
        "def brackets_balance(output, reference, row):\n"
        "    depth = 0\n"
        "    for c in output:\n"
        "        depth += {'(': 1, ')': -1}.get(c, 0)\n"
        "        if depth < 0:\n"
        "            return False\n"
        "    return depth == 0 and row['weight'] > 0\n")
    spec = "my_scorers:brackets_balance"
    assert score(spec, "(a (b))", row={"weight": 1}, recipe_dir=tmp_path) == 1.0
    assert score(spec, "(a (b)", row={"weight": 1}, recipe_dir=tmp_path) == 0.0
    config = GenerationEvalConfig(name="e", data=["x.jsonl"], scorers=[spec])
    assert config.scorers[0].metric == "brackets_balance"  # the metric is the function's name by default
    scorer = build_scorer(config.scorers[0], key="k", recipe_dir=tmp_path)
    assert not scorer.needs_reference


def test_user_function_from_an_installed_package() -> None:
    # tests/ is a package on the import path, like an installed one: no recipe folder involved
    fn = import_function("tests.helpers.user_scorers:length_ratio", key="k", recipe_dir=HERE / "data")
    assert fn("abcd", "ab", {}) == 2.0


@pytest.mark.parametrize(("body", "ref", "message"), [
    (None, "no_such_module:fn", "module 'no_such_module' could not be imported from"),
    ("import numpyy\n", "broken_import:fn", "(ModuleNotFoundError: No module named 'numpyy')"),
    ("raise RuntimeError('config missing')\n", "broken_raises:fn", "(RuntimeError: config missing)"),
    ("def other(o, r, row):\n    return 1\n", "broken_name:fn", "has no function 'fn'"),
    ("def fn(output):\n    return 1\n", "broken_args:fn", "fn(output) cannot be called as fn(output, reference, row)"),
])
def test_a_broken_user_scorer_is_one_line_naming_it(tmp_path: Path, body: str | None, ref: str,
                                                    message: str) -> None:
    if body is not None:
        (tmp_path / f"{ref.partition(':')[0]}.py").write_text(body)
    with pytest.raises(ToolkitError) as err:
        import_function(ref, key="stages.1.generation.0.scorers.2", recipe_dir=tmp_path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"scorer stages.1.generation.0.scorers.2 ('{ref}'): ")
    assert message in text


def test_a_user_scorer_that_fails_on_a_row_names_the_row(tmp_path: Path) -> None:
    (tmp_path / "flaky.py").write_text("def boom(output, reference, row):\n    return 1 / 0\n"
                                       "def nan(output, reference, row):\n    return float('nan')\n"
                                       "def text(output, reference, row):\n    return 'yes'\n")
    with pytest.raises(ToolkitError, match=r"scorer eval.generation.0.scorers.0 \('boom'\) failed on "
                                           r"eval.jsonl:1: ZeroDivisionError: division by zero"):
        score("flaky:boom", "x", recipe_dir=tmp_path)
    for name, shown in (("nan", "nan"), ("text", "'yes'")):
        with pytest.raises(ToolkitError, match=f"returned {shown} on eval.jsonl:1; a scorer returns a finite number"):
            score(f"flaky:{name}", "x", recipe_dir=tmp_path)


@pytest.mark.parametrize(("scorers", "message"), [
    (["exakt"], "unknown scorer 'exakt' (did you mean exact?)"),
    ([{"kind": "regex", "pattern": "("}], "pattern is not a valid regular expression"),
    ([{"kind": "exact", "pattern": "x"}], "pattern is for kind: regex, not exact"),
    ([{"kind": "function"}], "a function scorer needs function: module:function"),
    (["not a function:x y"], "is not of the form module:function"),
    (["exact", "exact"], "scorer names must be unique within an eval, repeated: ['exact']"),
    ([{"kind": "exact", "name": "eval_loss"}], "scorer name eval_loss is the loss evaluation's"),
])
def test_bad_scorer_entries_fail_in_the_recipe(scorers: list, message: str) -> None:
    with pytest.raises(ToolkitError) as err:
        load_recipe(None, [f"eval.generation=[{{name: e, data: [x.jsonl], scorers: {scorers}}}]"])
    assert message in str(err.value)


def test_metric_names() -> None:
    assert ScorerConfig(kind="json_valid").metric == "json_valid"
    assert ScorerConfig(kind="exact", name="exact_ci", lower=True).metric == "exact_ci"
    assert ScorerConfig(kind="function", function="pkg.mod:cad_parses").metric == "cad_parses"
    assert not math.isnan(score("exact", "a", "a"))
