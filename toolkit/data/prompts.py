"""Prompt rows: what an RL stage (objective grpo) samples completions for, and what its rewards read.

A prompt row is TRL's prompt-only shape, standard (`{"prompt": "The sky is"}`: raw text, completed as it is) or
conversational (`{"prompt": [{"role": "user", ...}]}`: rendered with the chat template and a generation prompt).
Datasets that name their columns otherwise map them with the data entry's `columns`, as every other row shape does:
GSM8K's `{prompt: question, reference: answer}`, NuminaMath's `{prompt: problem, reference: solution}`; a row
without a `prompt` is refused with that entry, its prompt and reference told by the role table
(toolkit/data/roles.py: a prompt and an answer by their names), not a list of its own.

Every other column of the row stays with it (`PromptRow.columns`) and is handed to the rewards, as TRL hands a
reward function the dataset's columns; `reference` is what the built-in rewards that compare (exact, contains,
regex, math) compare with. Kept apart from toolkit/data/shapes.py, which maps rows to conversations to train on.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolkit.config.schema import ORDERED
from toolkit.data import roles as vocab
from toolkit.data.encoding import DataStats, check_messages
from toolkit.data.plan import TrainingSet, drop_counts
from toolkit.data.shapes import holds_content, prepare_row
from toolkit.data.sources import Source, open_source, pieces, raw_rows
from toolkit.errors import ToolkitError


@dataclass(frozen=True)
class PromptRow:
    """One prompt: the text or messages to complete, its reference (None when the row has none), its other columns
    (handed to the rewards) and where it was read (file:line)."""

    prompt: str | list[dict[str, Any]]
    reference: Any
    where: str
    columns: dict[str, Any] = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


def _keys_of(row: dict[str, Any], role: str, but: str | None = None) -> list[str]:
    """The row's keys of a role by the role table (toolkit/data/roles.py `infer_roles`: GSM8K's `question`, NuminaMath's
    `problem` a prompt; their `answer` / `solution` an answer, the reference an RL row compares with), in the table's
    order; a prompt only where it is text."""
    roles = vocab.infer_roles({k: v for k, v in row.items() if k != but and not k.startswith("_")}, holds_content)
    return [k for k, r in roles.items() if r == role and (role != "prompt" or isinstance(row[k], str))]


def _columns_hint(row: dict[str, Any], source: str) -> str:
    asked = next(iter(_keys_of(row, "prompt")), None)
    if asked is None:
        return ""
    answered = next(iter(_keys_of(row, "answer", but=asked)), None)
    mapping = f"prompt: {asked}" + (f", reference: {answered}" if answered else "")
    return f"; map its columns in the data entry: {{path: {source}, columns: {{{mapping}}}}}"


def prompt_row(row: dict[str, Any], source: Source, where: str) -> PromptRow:
    """A source row as a prompt row: the entry's `columns` and `ignore` applied, then TRL's prompt-only shape
    read. A row with no prompt, a conversation that does not end on the turn to answer, or image prompts (not
    supported by RL stages yet) is one error naming the row."""
    mapped, original = prepare_row(row, source, where)
    if mapped.get("images"):
        raise ToolkitError(f"{where}: the prompt has images; RL stages (objective grpo) train on text prompts only "
                           "for now: drop the images or train this data in an sft or dpo stage.")
    prompt = mapped.pop("prompt", None)
    if prompt is None:
        close = difflib.get_close_matches("prompt", original, n=1, cutoff=0.6)
        hint = _columns_hint(mapped, source.name) or (
            f"; did you mean '{close[0]}'? map it with columns: {{prompt: {close[0]}}}" if close else "")
        raise ToolkitError(f"{where}: an RL stage's row needs a 'prompt' (text, or a list of messages ending on the "
                           f"user turn: TRL's prompt-only rows); the row has {original}{hint}.")
    if isinstance(prompt, list):
        prompt = check_messages(prompt, where, "all")
        if prompt[-1]["role"] not in ("user", "tool"):
            raise ToolkitError(f"{where}: the prompt's messages end with a '{prompt[-1]['role']}' turn; a prompt "
                               "ends on the user (or tool) turn the completion answers.")
    elif not isinstance(prompt, str) or not prompt:
        raise ToolkitError(f"{where}: 'prompt' must be a non-empty string or a list of messages, got "
                           f"{type(prompt).__name__}.")
    reference = mapped.pop("reference", None)
    return PromptRow(prompt, reference, where, {k: v for k, v in mapped.items() if v is not None})


def read_prompt_rows(source: Source) -> Iterator[PromptRow]:
    """Every row of a source as a prompt row, in order."""
    open_source(source)
    for piece in pieces(source):
        for number, row in raw_rows(source, piece):
            where = source.where(piece.file_index, number)
            if not isinstance(row, dict):
                raise ToolkitError(f"{where}: each {'line' if source.fmt == 'jsonl' else 'row'} must be a JSON "
                                   f"object, got {type(row).__name__}.")
            yield prompt_row(row, source, where)


def check_references(rows: list[PromptRow], rewards: list[tuple[str, str]], source: str) -> None:
    """Each reward that compares with a reference (`rewards`: (recipe key, scorer) pairs) finds one in every row;
    the first row without one is one error naming the reward, the row and the `columns` that give it."""
    if not rewards:
        return
    missing = next((r for r in rows if r.reference is None), None)
    if missing is None:
        return
    key, scorer = rewards[0]
    named = next(iter(_keys_of(missing.columns, "answer")), None)
    fix = (f"map it: {{path: {source}, columns: {{reference: {named}}}}}" if named else
           "give every row a 'reference' (or map the column that holds it with columns: {reference: NAME})")
    raise ToolkitError(f"{missing.where}: reward {key} ({scorer}) compares each completion with the row's reference, "
                       f"and this row has none; {fix}.")


def render_prompt(tokenizer: Any, row: PromptRow, *, enable_thinking: bool | None) -> list[int]:
    """A prompt's token ids as the rollout feeds them: a conversational prompt through the chat template with the
    generation prompt (and the template's `enable_thinking`, Qwen3), a standard one as raw text with the
    tokenizer's special tokens, as TRL and the generation evals do."""
    if isinstance(row.prompt, str):
        return list(tokenizer(row.prompt, add_special_tokens=True)["input_ids"])
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        text = tokenizer.apply_chat_template(row.prompt, tools=row.columns.get("tools"), tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except Exception as e:  # a template's raise_exception, or Jinja errors on a shape it does not handle
        raise ToolkitError(f"{row.where}: the chat template could not render this prompt ({type(e).__name__}: "
                           f"{e}).") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _difficulty(stage: Any, samples: list[dict[str, Any]]) -> np.ndarray | None:
    """The prompts' own difficulty, as a stage of rows reads it: the rows' `difficulty` (a `by: field` name is
    mapped to it, toolkit/config/stages.py `difficulty_entries`) when the stage is ordered, every row has a number
    there and the stage orders by no other measure; else None (token length orders, or the pass rates at the
    entry). `by: field` with a row without one is refused, naming the row."""
    how = stage.difficulty
    if stage.order not in ORDERED or (how is not None and how.by != "field"):
        return None
    values = [s["columns"].get("difficulty") for s in samples]
    numbers = [isinstance(v, int | float) and not isinstance(v, bool) for v in values]
    if samples and all(numbers):
        return np.asarray(values, dtype=np.float64)
    if how is not None and samples:
        bad = samples[numbers.index(False)]
        raise ToolkitError(f"{bad['where']}: stage '{stage.name}' orders its prompts by difficulty.field "
                           f"'{how.field}', and this row has no number there; give every row one, or use "
                           "difficulty: {by: pass_rate, model: current}.")
    return None


def prompt_set(stage: Any, sources: list[Source], tokenizer: Any, *, thinking: str) -> TrainingSet:
    """An RL stage's prompts (`stage`: a ResolvedStage with objective grpo) over its entries' `sources`: each row
    read (`prompt_row`), checked against the rewards that need a reference, and rendered (`render_prompt`); a
    prompt that leaves no room for `rl.max_completion_length` tokens under the stage's max_seq_len is dropped and
    counted. Samples are dicts: `prompt_ids`, `prompt` (the row's prompt), `reference`, `columns`, `where`. A
    `drop` (by pass rate) is counted here, its rows chosen by the rollouts at the stage's entry."""
    rl = stage.rl
    enable_thinking = None if thinking == "none" else False
    room = stage.max_seq_len - rl.max_completion_length
    comparing = [(f"stages.{stage.index}.rewards.{j}", r.kind) for j, r in enumerate(stage.rewards)
                 if r.needs_reference]
    stats, samples, sizes = DataStats(), [], []
    for source in sources:
        rows = list(read_prompt_rows(source))
        check_references(rows, comparing, source.name)
        kept = 0
        for row in rows:
            ids = render_prompt(tokenizer, row, enable_thinking=enable_thinking)
            stats.rows += 1
            if len(ids) > room:
                stats.dropped_overlength += 1
                continue
            kept += 1
            stats.tokens += len(ids)
            samples.append({"prompt_ids": ids, "prompt": row.prompt, "reference": row.reference,
                            "columns": row.columns, "where": row.where})
        sizes.append(kept)
    stats.kept = len(samples)
    lengths = np.array([len(s["prompt_ids"]) for s in samples], dtype=np.int64)
    rows = TrainingSet(samples, sizes, _difficulty(stage, samples), lengths, stats)
    if stage.drop is not None:  # by the pass rates (the recipe allows no other drop here), measured at the entry
        rows.dropped_by_score = drop_counts(len(samples), easiest=stage.drop.easiest, hardest=stage.drop.hardest)
    return rows
