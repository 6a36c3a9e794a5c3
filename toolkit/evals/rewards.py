"""Rewards of an RL stage: `rewards: [{scorer, weight}]`, each scoring every completion of a rollout batch.

A reward is one of:

* a generation-eval scorer (toolkit/evals/scorers.py): `exact`, `contains`, `regex`, `json_valid`, with their options
  (`{kind: regex, pattern: ...}`); they compare the completion's answer (a leading think block removed) with the
  row's `reference`;
* `math`: the answer is mathematically equal to the reference, by math-verify (HuggingFace's verifier, the one TRL's
  `accuracy_reward` uses: LaTeX, boxed and plain expressions, units, fractions against decimals). A reference it
  cannot parse gives None (the completion is skipped), as in TRL. A GSM8K answer's `#### 72` is read as 72;
* `think_format`: 1 when the completion is a `<think>...</think>` block then the answer (TRL's `think_format_reward`);
* `overlong`: DAPO's soft overlong punishment: 0 up to `max_completion_length - soft_punish_cache` tokens, then
  falling linearly to -1 at `max_completion_length`, -1 beyond (TRL's `get_soft_overlong_punishment`);
* `module:function`, imported from the recipe's folder or the installed packages, with TRL's reward-function
  signature: `function(prompts, completions, completion_ids, **columns) -> list[float | None]` over the batch, where
  `completions` are strings, or `[{"role": "assistant", "content": ...}]` for conversational prompts, and `columns`
  are the rows' other columns (`reference` among them). A function TRL users wrote runs unchanged.

None skips: a reward that returns None for a completion adds nothing to its weighted sum; a completion no reward
scores gets no advantage (toolkit/train/grpo.py). A user function that raises, or returns anything but one number,
bool or None per completion, is one error line naming the reward and the row (the batch is called again row by row
to find it).
"""

from __future__ import annotations

import inspect
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from toolkit.config.schema import ScorerConfig
from toolkit.errors import ToolkitError
from toolkit.evals.scorers import answer_of, build_scorer, import_named

RewardFn = Callable[..., list[Any]]
SCORER_KINDS = ("exact", "contains", "regex", "json_valid")
KINDS = (*SCORER_KINDS, "math", "think_format", "overlong")
THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)  # TRL's pattern


@dataclass(frozen=True)
class Reward:
    """A reward ready to call on a batch: its metric name (`rewards/<name>/mean`), the recipe key it comes from,
    its weight, whether rows need a reference, and the batched function."""

    name: str
    key: str
    weight: float
    needs_reference: bool
    fn: RewardFn
    user: bool = False  # a user's function: its failures name the function and the row

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
                 columns: dict[str, Sequence[Any]], where: Sequence[str]) -> list[float | None]:
        """One reward (a float, or None: skipped) per completion; one ToolkitError naming the row on failure."""
        n = len(completions)
        try:
            values = self.fn(prompts=list(prompts), completions=list(completions),
                             completion_ids=[list(c) for c in completion_ids],
                             **{k: list(v) for k, v in columns.items()})
        except ToolkitError:
            raise
        except Exception as e:  # the user's code: find the row it fails on
            raise self._failure(prompts, completions, completion_ids, columns, where, e) from None
        if not isinstance(values, list | tuple) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, list | tuple) else repr(type(values).__name__)
            raise ToolkitError(f"reward {self.key} ('{self.name}') returned {got} for a batch of {n} completions "
                               f"({where[0]} ...); a reward returns one number (or None) per completion.")
        out: list[float | None] = []
        for value, place in zip(values, where, strict=True):
            if value is None:
                out.append(None)
            elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
                out.append(float(value))
            else:
                raise ToolkitError(f"reward {self.key} ('{self.name}') returned {value!r} on {place}; a reward "
                                   "returns a finite number, a bool, or None to skip the completion.")
        return out

    def _failure(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
                 columns: dict[str, Sequence[Any]], where: Sequence[str], error: Exception) -> ToolkitError:
        for i in range(len(completions)):
            try:
                self.fn(prompts=[prompts[i]], completions=[completions[i]], completion_ids=[list(completion_ids[i])],
                        **{k: [v[i]] for k, v in columns.items()})
            except Exception as e:  # the first row that fails alone
                return _error_line(self, where[i], e)
        return _error_line(self, f"the batch {where[0]} ... {where[-1]} (no row fails alone)", error)


def _error_line(reward: Reward, where: str, error: Exception) -> ToolkitError:
    detail = str(error).splitlines()[0] if str(error) else ""
    return ToolkitError(f"reward {reward.key} ('{reward.name}') failed on {where}: {type(error).__name__}: {detail}")


def completion_text(completion: Any) -> str:
    """A completion's text, from a string or TRL's conversational `[{"role": "assistant", "content": ...}]`."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


# ------------------------------------------------------------------------------------------- built-ins


def _per_completion(score: Callable[[str, Any, dict[str, Any], int], float | None]) -> RewardFn:
    """A batched reward from a per-completion one (text, reference, row's columns, token count)."""
    def batched(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **columns: Any
                ) -> list[float | None]:
        references = columns.get("reference", [None] * len(completions))
        return [score(completion_text(c), references[i], {k: v[i] for k, v in columns.items()},
                      len(completion_ids[i])) for i, c in enumerate(completions)]
    return batched


def _math_reward() -> RewardFn:
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        raise ToolkitError("the math reward needs math-verify: pip install 'curriculum-toolkit[rl]'.") from None
    answer_configs = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                            boxed_match_priority=0, try_extract_without_anchor=False),
                      ExprExtractionConfig()]

    def score(text: str, reference: Any, row: dict[str, Any], tokens: int) -> float | None:
        main = threading.current_thread() is threading.main_thread()  # its timeouts use SIGALRM: main thread only
        gold = parse(str(reference).rpartition("####")[2].strip() if "####" in str(reference) else str(reference),
                     parsing_timeout=10 if main else None)
        if not gold:
            return None  # a reference math-verify cannot read: the completion is skipped, as TRL's accuracy_reward
        answer = parse(answer_of(text), extraction_config=answer_configs, extraction_mode="first_match",
                       parsing_timeout=10 if main else None)
        return float(verify(gold, answer, timeout_seconds=5 if main else None))
    return _per_completion(score)


def _think_format(text: str, reference: Any, row: dict[str, Any], tokens: int) -> float:
    return 1.0 if THINK_FORMAT.match(text) else 0.0


def _overlong(max_len: int, cache: int) -> RewardFn:
    def score(text: str, reference: Any, row: dict[str, Any], tokens: int) -> float:
        if tokens <= max_len - cache:
            return 0.0
        if tokens <= max_len:
            return (max_len - cache - tokens) / cache
        return -1.0
    return _per_completion(score)


def _scorer_reward(spec: dict[str, Any], key: str, recipe_dir: Path) -> tuple[str, RewardFn]:
    try:
        config = ScorerConfig(**spec)
    except ValidationError as e:  # its first message, in the recipe's words
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ToolkitError(f"{key}{'.' + where if where else ''}: {first['msg'].removeprefix('Value error, ')}"
                           ) from None
    scorer = build_scorer(config, key=key, recipe_dir=recipe_dir)

    def score(text: str, reference: Any, row: dict[str, Any], tokens: int) -> float:
        return scorer(text, reference, row, "a completion")
    return config.metric, _per_completion(score)


def import_reward(ref: str, *, key: str, recipe_dir: Path) -> RewardFn:
    """`module:function` with TRL's reward signature, from the recipe's folder or the installed packages; checked
    to take `prompts`, `completions` and `completion_ids` by keyword. Any failure is one line naming the key."""
    name = ref.partition(":")[2]
    where = f"reward {key} ('{ref}')"
    fn = import_named(ref, where, recipe_dir)
    try:
        signature = inspect.signature(fn)
    except ValueError:  # a builtin without a signature: trust it
        return fn
    params = signature.parameters
    kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    takes = [n for n in ("prompts", "completions", "completion_ids") if kwargs or (
        n in params and params[n].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))]
    if len(takes) < 3:
        raise ToolkitError(f"{where}: {name}{signature} cannot be called as {name}(prompts=..., completions=..., "
                           "completion_ids=..., **columns), TRL's reward-function signature.")
    if kwargs:
        return fn
    named = set(params)

    def called(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **columns: Any
               ) -> list[Any]:  # a function without **kwargs gets only the columns it names
        return fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                  **{k: v for k, v in columns.items() if k in named})
    return called


def build_reward(entry: Any, *, key: str, recipe_dir: Path, max_completion_length: int) -> Reward:
    """The reward a `rewards:` entry describes: `{scorer: <kind, module:function, or {kind: ..., options}>,
    weight: 1.0}`; `key` names the entry in messages (`stages.2.rewards.0`)."""
    if not isinstance(entry, dict) or "scorer" not in entry or set(entry) - {"scorer", "weight"}:
        raise ToolkitError(f"{key}: a reward is {{scorer: ..., weight: ...}} (scorer one of {', '.join(KINDS)} or "
                           f"module:function); got {entry!r}.")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ToolkitError(f"{key}.weight is {weight!r}; a reward's weight is a finite number.")
    spec = entry["scorer"]
    if isinstance(spec, str):
        spec = {"kind": "function", "function": spec} if ":" in spec else {"kind": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise ToolkitError(f"{key}.scorer is {entry['scorer']!r}; give a kind ({', '.join(KINDS)}), module:function, "
                           "or {kind: ..., options}.")
    spec = dict(spec)
    kind = spec.pop("kind")
    name = spec.pop("name", None)
    where = f"{key}.scorer"
    if kind in SCORER_KINDS:
        metric, fn = _scorer_reward({"kind": kind, **({"name": name} if name else {}), **spec}, where, recipe_dir)
        return Reward(metric, key, float(weight), kind in ("exact", "contains", "regex"), fn)
    if kind == "function":
        ref = spec.pop("function", None)
        _no_options(spec, where, kind)
        if not isinstance(ref, str) or not re.fullmatch(r"[\w.]+:\w+", ref):
            raise ToolkitError(f"{where}: '{ref}' is not of the form module:function (e.g. my_rewards:correct).")
        fn = import_reward(ref, key=key, recipe_dir=recipe_dir)
        return Reward(name or ref.rpartition(":")[2], key, float(weight), False, fn, user=True)
    if kind == "math":
        _no_options(spec, where, kind)
        return Reward(name or "math", key, float(weight), True, _math_reward())
    if kind == "think_format":
        _no_options(spec, where, kind)
        return Reward(name or "think_format", key, float(weight), False, _per_completion(_think_format))
    if kind == "overlong":
        cache = spec.pop("soft_punish_cache", max(1, max_completion_length // 5))
        _no_options(spec, where, kind)
        if isinstance(cache, bool) or not isinstance(cache, int) or not 0 < cache <= max_completion_length:
            raise ToolkitError(f"{where}.soft_punish_cache is {cache!r}; give a token count in 1.."
                               f"{max_completion_length} (rl.max_completion_length).")
        return Reward(name or "overlong", key, float(weight), False, _overlong(max_completion_length, cache))
    raise ToolkitError(f"{where}: unknown reward kind '{kind}'; choose one of {', '.join(KINDS)}, or "
                       "module:function.")


def _no_options(spec: dict[str, Any], where: str, kind: str) -> None:
    if spec:
        raise ToolkitError(f"{where}: {', '.join(sorted(spec))} is not an option of a {kind} reward.")


def build_rewards(entries: Sequence[Any], *, key: str, recipe_dir: Path, max_completion_length: int
                  ) -> list[Reward]:
    """A stage's rewards (`key`: the recipe key of the list); names must differ (each is a metric)."""
    if not entries:
        raise ToolkitError(f"{key}: an RL stage needs at least one reward ({{scorer: math, weight: 1.0}}, ...).")
    rewards = [build_reward(e, key=f"{key}.{i}", recipe_dir=recipe_dir, max_completion_length=max_completion_length)
               for i, e in enumerate(entries)]
    names = [r.name for r in rewards]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ToolkitError(f"{key}: two rewards are named '{twice}' (rewards/{twice}/mean); give one a name: "
                           "{scorer: {kind: ..., name: ...}}.")
    return rewards


def check_references(rewards: Sequence[Reward], references: Sequence[Any], where: Sequence[str]) -> None:
    """Before anything heavy: every row has the string reference that a reference-needing reward compares with."""
    needing = next((r for r in rewards if r.needs_reference), None)
    if needing is None:
        return
    for reference, place in zip(references, where, strict=True):
        if not isinstance(reference, str) or not reference.strip():
            raise ToolkitError(f"{place}: reward {needing.key} ('{needing.name}') compares with the row's reference "
                               "and the row has none; give each row a 'reference' (or map a column to it: columns: "
                               "{reference: answer}), or use rewards that need none.")


def score_completions(rewards: Sequence[Reward], prompts: Sequence[Any], completions: Sequence[Any],
                      completion_ids: Sequence[Sequence[int]], columns: dict[str, Sequence[Any]],
                      where: Sequence[str]) -> tuple[torch.Tensor, str | None]:
    """``[N, len(rewards)]`` float32 rewards of this rank's completions (NaN: skipped) and the first error, carried
    rather than raised so that no rank stops while the others wait on it (gather it, then stop every rank)."""
    out = torch.full((len(completions), len(rewards)), float("nan"))
    for j, reward in enumerate(rewards):
        try:
            values = reward(prompts, completions, completion_ids, columns, where)
        except ToolkitError as e:
            return out, str(e)
        out[:, j] = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
    return out, None
