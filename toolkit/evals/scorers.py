"""Scorers of generation evals: one number per completion, averaged over an eval's rows.

The built-ins score 1.0 or 0.0:

* `exact`: the output equals the reference; `contains`: the reference occurs in the output. Both compare after the
  scorer's normalisation: `strip` (default on), `lower`, `whitespace` (every run of whitespace made one space).
* `regex`: with a `pattern`, its first match in the output (the first group, if the pattern has one) equals the
  reference after normalisation (`pattern: '= (-?\\d+)\\.$'` checks the final number of an answer); without one,
  the row's reference is itself a regular expression the output must contain a match of.
* `json_valid`: the output parses as JSON (one surrounding Markdown code fence is allowed).

A user scorer is `module:function`, imported once at start from the recipe's folder or the installed packages and
called as `function(output, reference, row)` (the row is the eval file's JSON object, so it can carry whatever the
scorer needs) returning a number or a bool. A module that does not import, a missing function or one that cannot
take those three arguments stops the run before anything is loaded, with one line naming the scorer's key.

Every scorer sees the answer: a leading `<think>...</think>` block (Qwen3's reasoning) is removed first; the
completions file keeps the whole output.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.config.schema import ScorerConfig
from toolkit.errors import ToolkitError

ScoreFn = Callable[[str, Any, dict[str, Any]], float]

THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)
CODE_FENCE = re.compile(r"^```[\w-]*\n(.*)\n```$", re.DOTALL)


@dataclass(frozen=True)
class Scorer:
    """A scorer ready to call: its metric name, whether rows need a reference, and the function."""

    name: str
    kind: str
    key: str  # the recipe key it comes from, for error messages
    needs_reference: bool
    fn: ScoreFn
    reference_is_pattern: bool = False  # regex without a pattern: each row's reference must compile

    def __call__(self, output: str, reference: Any, row: dict[str, Any], where: str) -> float:
        """The score of one completion; a user function that raises or returns no number is an error naming the
        scorer and the row."""
        try:
            value = self.fn(answer_of(output), reference, row)
        except Exception as e:  # the user's code: any exception, reported in one line
            raise ToolkitError(f"scorer {self.key} ('{self.name}') failed on {where}: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from None
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ToolkitError(f"scorer {self.key} ('{self.name}') returned {value!r} on {where}; a scorer returns a "
                               "finite number (or a bool).")
        return float(value)


def answer_of(output: str) -> str:
    """The output without a leading `<think>...</think>` block."""
    return THINK_BLOCK.sub("", output, count=1)


def normalise(text: str, *, strip: bool, lower: bool, whitespace: bool) -> str:
    if whitespace:
        text = " ".join(text.split()) if strip else re.sub(r"\s+", " ", text)
    elif strip:
        text = text.strip()
    return text.lower() if lower else text


def build_scorer(spec: ScorerConfig, *, key: str, recipe_dir: Path) -> Scorer:
    """The scorer a recipe entry describes (`key` names the entry in messages); user functions are imported here."""
    def norm(text: str) -> str:
        return normalise(text, strip=spec.strip, lower=spec.lower, whitespace=spec.whitespace)

    fn: ScoreFn
    if spec.kind == "exact":
        def fn(output: str, reference: Any, row: dict[str, Any]) -> float:
            return float(norm(output) == norm(reference))
    elif spec.kind == "contains":
        def fn(output: str, reference: Any, row: dict[str, Any]) -> float:
            return float(norm(reference) in norm(output))
    elif spec.kind == "regex" and spec.pattern is not None:
        pattern = re.compile(spec.pattern)

        def fn(output: str, reference: Any, row: dict[str, Any]) -> float:
            found = pattern.search(output)
            if found is None:
                return 0.0
            return float(norm(found.group(1) if pattern.groups else found.group(0)) == norm(reference))
    elif spec.kind == "regex":
        def fn(output: str, reference: Any, row: dict[str, Any]) -> float:
            return float(re.search(reference, output) is not None)
    elif spec.kind == "json_valid":
        def fn(output: str, reference: Any, row: dict[str, Any]) -> float:
            text = output.strip()
            fenced = CODE_FENCE.match(text)
            try:
                json.loads(fenced.group(1) if fenced else text)
            except ValueError:
                return 0.0
            return 1.0
    else:
        fn = import_function(str(spec.function), key=key, recipe_dir=recipe_dir)
    return Scorer(spec.metric, spec.kind, key, spec.kind in ("exact", "contains", "regex"), fn,
                  reference_is_pattern=spec.kind == "regex" and spec.pattern is None)


@contextlib.contextmanager
def _importable_from(folder: Path) -> Iterator[None]:
    """`folder` first on the import path while importing (the recipe's own modules), then as before."""
    entry = str(folder.resolve())
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def import_named(ref: str, where: str, recipe_dir: Path) -> Callable[..., Any]:
    """The callable `module:function` names, imported from the recipe's folder or the installed packages (a
    generation-eval scorer's or an RL reward's). Any failure is one ToolkitError that starts with `where`."""
    module_name, _, name = ref.partition(":")
    try:
        with _importable_from(recipe_dir):
            module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or anything the user's module raises at import
        detail = str(e).splitlines()[0] if str(e) else ""
        raise ToolkitError(f"{where}: module '{module_name}' could not be imported from {recipe_dir} or the installed "
                           f"packages ({type(e).__name__}: {detail}).") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ToolkitError(f"{where}: module '{module_name}' ({getattr(module, '__file__', '?')}) has no function "
                           f"'{name}'.")
    return fn


def import_function(ref: str, *, key: str, recipe_dir: Path) -> ScoreFn:
    """`module:function` from the recipe's folder or the installed packages, checked to take (output, reference,
    row). Any failure is one ToolkitError naming the scorer's key."""
    name = ref.partition(":")[2]
    where = f"scorer {key} ('{ref}')"
    fn = import_named(ref, where, recipe_dir)
    try:
        inspect.signature(fn).bind("output", "reference", {})
    except TypeError:
        raise ToolkitError(f"{where}: {name}{inspect.signature(fn)} cannot be called as {name}(output, reference, "
                           "row).") from None
    except ValueError:  # a builtin without a signature: trust it
        pass
    return fn


def build_scorers(specs: list[ScorerConfig], *, key: str, recipe_dir: Path) -> list[Scorer]:
    """An eval's scorers; `key` is the recipe key of its scorer list (`eval.generation.0.scorers`)."""
    return [build_scorer(spec, key=f"{key}.{i}", recipe_dir=recipe_dir) for i, spec in enumerate(specs)]
