"""Data: JSONL rows to token ids and loss labels, formatted by the tokenizer's own chat template.

Three row shapes are accepted, one per line:
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
  {"prompt": "...", "completion": "..."}      (plain concatenation, loss on the completion)
  {"text": "..."}                               (language modelling, loss on every token)
Extra keys (for example `difficulty`) are kept for the curriculum and ignored here.

Loss goes on assistant tokens only by default. When the template marks assistant turns with
`{% generation %}` we use transformers' `return_assistant_tokens_mask`; otherwise the span of assistant turn i
is the text that rendering `messages[:i+1]` adds to rendering `messages[:i]` with a generation prompt, which is
exact for any prefix-stable template (ChatML, Qwen2.5, Llama 3) and checked per row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from toolkit.errors import ToolkitError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class DataStats:
    """What happened to a stage's rows; reported at the stage start."""

    rows: int = 0
    kept: int = 0
    dropped_overlength: int = 0
    truncated: int = 0
    no_label_tokens: int = 0
    tokens: int = 0
    label_tokens: int = 0

    def summary(self) -> str:
        return (f"{self.rows} rows, {self.kept} kept ({self.tokens} tokens, {self.label_tokens} trained), "
                f"{self.dropped_overlength} dropped over max_seq_len, {self.truncated} truncated, "
                f"{self.no_label_tokens} skipped with no trainable tokens")


@dataclass
class StageData:
    """Tokenised samples of one stage, each `{"input_ids": [...], "labels": [...]}`, plus their row extras."""

    samples: list[dict[str, list[int]]] = field(default_factory=list)
    extras: list[dict[str, Any]] = field(default_factory=list)
    stats: DataStats = field(default_factory=DataStats)


DUMMY_PREFIX = "dummy:"


def resolve_data_paths(entries: list[str], dummy_dir: Path) -> list[Path]:
    """Stage data entries to files: `dummy:NAME` is generated dummy data, anything else a path from the cwd."""
    return [dummy_dir / f"{e.removeprefix(DUMMY_PREFIX)}.jsonl" if e.startswith(DUMMY_PREFIX) else Path(e)
            for e in entries]


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, row) for each non-blank line; a malformed line is an error naming file and line."""
    if not path.is_file():
        raise ToolkitError(f"Data file {path} does not exist (paths are relative to the working directory).")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ToolkitError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}). "
                                   "Each line must be one JSON object.") from None
            if not isinstance(row, dict):
                raise ToolkitError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}.")
            yield lineno, row


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ToolkitError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ToolkitError(f"{where}: messages[{i}] must have a role in {ROLES} and a string content.")
    return messages


def has_generation_tags(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}")


def _encode_messages(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                     train_on: str, where: str) -> tuple[list[int], list[int]]:
    if has_generation_tags(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        mask = list(out["assistant_masks"])
    else:
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = ""
            if i:
                before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ToolkitError(
                    f"{where}: the chat template is not prefix-stable for this conversation, so assistant turns "
                    "cannot be located. Set data.chat_template: chatml (a training template with generation "
                    "markers) or give a Jinja template with {% generation %} blocks.")
            spans.append((len(before), len(upto.rstrip())))  # the newline after a turn is not trained
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(s <= start < e for s, e in spans)) for start, _ in enc["offset_mapping"]]
    labels = ids if train_on == "all" else [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
    return ids, list(labels)


def encode_row(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, train_on: str,
               where: str) -> tuple[list[int], list[int]]:
    """Token ids and labels (IGNORE_INDEX where no loss) of one row. The first token never carries loss."""
    if "messages" in row:
        if not tokenizer.chat_template:
            raise ToolkitError(
                f"{where}: the row is a chat ('messages') but the tokenizer has no chat template. Use a chat "
                "model's tokenizer or set data.chat_template (for example: chatml).")
        ids, labels = _encode_messages(tokenizer, check_messages(row["messages"], where), train_on, where)
    elif "prompt" in row and "completion" in row:
        if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
            raise ToolkitError(f"{where}: 'prompt' and 'completion' must be strings.")
        prompt = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt + completion
        labels = (prompt if train_on == "all" else [IGNORE_INDEX] * len(prompt)) + completion
    elif "text" in row:
        if not isinstance(row["text"], str):
            raise ToolkitError(f"{where}: 'text' must be a string.")
        ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
        labels = list(ids)
    else:
        raise ToolkitError(f"{where}: a row needs 'messages', 'prompt' and 'completion', or 'text'; "
                           f"found keys {sorted(row)}.")
    if labels:
        labels[0] = IGNORE_INDEX  # nothing predicts the first token
    return ids, labels


def load_stage_data(paths: list[Path], tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int,
                    overlength: str, train_on: str) -> StageData:
    """Read and tokenise a stage's files, applying the over-length policy and skipping rows with no loss."""
    data = StageData()
    st = data.stats
    for path in paths:
        for lineno, row in iter_jsonl(path):
            where = f"{path}:{lineno}"
            st.rows += 1
            ids, labels = encode_row(row, tokenizer, train_on, where)
            if len(ids) > max_seq_len:
                if overlength == "error":
                    raise ToolkitError(f"{where}: {len(ids)} tokens, over data.max_seq_len={max_seq_len}. Raise "
                                       "max_seq_len, or set data.overlength to drop or truncate.")
                if overlength == "drop":
                    st.dropped_overlength += 1
                    continue
                ids, labels = ids[:max_seq_len], labels[:max_seq_len]
                st.truncated += 1
            n_label = sum(label != IGNORE_INDEX for label in labels)
            if n_label == 0:
                st.no_label_tokens += 1
                continue
            st.kept += 1
            st.tokens += len(ids)
            st.label_tokens += n_label
            data.samples.append({"input_ids": ids, "labels": labels})
            data.extras.append({k: v for k, v in row.items() if k not in ("messages", "prompt", "completion", "text")})
    return data


def build_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorForSeq2Seq:
    """Pads a list of samples to the longest one (right padding, labels padded with IGNORE_INDEX)."""
    return DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE_INDEX,
                                  return_tensors="pt")


@dataclass
class StageSources:
    """A stage's training rows: samples (packed rows with packing), per-file sizes, difficulty, lengths."""

    samples: list[dict[str, list[int]]]
    sizes: list[int]
    difficulty: list[float] | None  # None: no row has one (easy_to_hard then sorts by length)
    lengths: list[int]
    stats: DataStats


def _difficulty(extras: list[dict[str, Any]], path: Path) -> list[float] | None:
    values = [e.get("difficulty") for e in extras]
    if all(v is None for v in values):
        return None
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ToolkitError(f"{path}: kept row {i + 1} has difficulty {v!r}; easy_to_hard needs a number on "
                               "every row (or on none, to order by token length).")
    return [float(v) for v in values]


def load_stage_sources(paths: list[Path], tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int, overlength: str,
                       train_on: str, packing: bool, needs_difficulty: bool) -> StageSources:
    """Load each file of a stage separately (mixtures sample per file); with packing, pack within each file.

    A packed row's difficulty is that of its hardest sample, so easy-to-hard order stays conservative.
    """
    from toolkit.packing import pack_best_fit_decreasing, pack_row, pack_samples

    out = StageSources([], [], [] if needs_difficulty else None, [], DataStats())
    for path in paths:
        data = load_stage_data([path], tokenizer, max_seq_len=max_seq_len, overlength=overlength, train_on=train_on)
        for key in vars(out.stats):
            setattr(out.stats, key, getattr(out.stats, key) + getattr(data.stats, key))
        difficulty = _difficulty(data.extras, path) if needs_difficulty else None
        if packing and difficulty is not None:
            bins = pack_best_fit_decreasing([len(s["input_ids"]) for s in data.samples], max_seq_len)
            rows = [pack_row([data.samples[i] for i in b]) for b in bins]
            difficulty = [max(difficulty[i] for i in b) for b in bins]
        elif packing:
            rows = pack_samples(data.samples, max_seq_len)
        else:
            rows = data.samples
        if needs_difficulty and out.difficulty is not None:
            out.difficulty = None if difficulty is None else out.difficulty + difficulty
        out.samples += rows
        out.sizes.append(len(rows))
        out.lengths += [len(r["input_ids"]) for r in rows]
    return out

