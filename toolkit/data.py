"""Data: JSONL rows to token ids and loss labels, formatted by the tokenizer's own chat template.

Three row shapes are accepted, one per line:
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
  {"prompt": "...", "completion": "..."}      (plain concatenation, loss on the completion)
  {"text": "..."}                               (language modelling, loss on every token)
Extra keys (for example `difficulty`) are kept for the curriculum and ignored here.

Loss goes on assistant tokens only by default. When the template marks assistant turns with
`{% generation %}` we use transformers' `return_assistant_tokens_mask`. A ChatML-family template (ChatML and the
stock Qwen2.5 / Qwen3 / Qwen-VL templates) is rendered once and its assistant turns are read off the rendering,
header excluded and `<|im_end|>` included, which holds for templates that rewrite history (Qwen3 drops the think
block of earlier turns, so it is not prefix-stable). Any other template is masked by rendering prefixes: turn i is
what rendering `messages[:i+1]` adds to `messages[:i]` with a generation prompt, checked per row. A row's `tools`
go to the template; fields a template cannot render (tools, reasoning_content, tool_calls, tool turns under
ChatML) are refused rather than dropped. `data.thinking` adds or removes empty think blocks (see the README).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import re
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import transformers
from transformers import PreTrainedTokenizerBase

from toolkit.atomic import write_atomic
from toolkit.errors import ToolkitError
from toolkit.labels import IGNORE_INDEX
from toolkit.packing import pack_best_fit_decreasing, pack_row, pack_samples
from toolkit.templates import IM_END, IM_START

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")

# Bump whenever encode_row or the length/no-loss policy changes what a file tokenises to, so old cache entries miss.
CACHE_FORMAT_VERSION = 3
# encode_row calls in this process, so tests can check that a cache hit did not tokenise again.
ENCODE_CALLS = 0
# A file's hash is only remembered against its stat once the file is this old (git's "racy clean" rule).
RACY_WINDOW_NS = 2_000_000_000


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
class EncodedRows:
    """Tokenised samples of some files, each `{"input_ids": [...], "labels": [...]}`, plus their row extras."""

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
    if path.is_dir():
        raise ToolkitError(f"Data file {path} is a directory; list the JSONL files in it one by one.")
    if not path.is_file():
        raise ToolkitError(f"Data file {path} does not exist (paths are relative to the working directory).")
    offset = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ToolkitError(f"{path}:{lineno}: byte 0x{raw[e.start]:02x} at byte offset {offset + e.start} of "
                                   "the file is not UTF-8. Data files must be UTF-8 text: re-encode the file (for "
                                   "example iconv -f latin1 -t utf-8).") from None
            offset += len(raw)
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


ASSISTANT_HEADER = IM_START + "assistant"
EMPTY_THINK = "<think>\n\n</think>\n\n"
IMAGE_PARTS = '{"type": "text" | "image", ...} parts'  # a vision-language message's content list


def check_messages(messages: Any, where: str, train_on: str = "assistant", *,
                   image_parts: bool = False) -> list[dict[str, Any]]:
    """The row's messages, checked: roles, string contents (an assistant turn with tool_calls may have none), a
    string `reasoning_content`, well-formed `tool_calls`. With train_on: assistant, a conversation with assistant
    turns must open (after an optional system prompt) with a user turn and end with an assistant turn: a trailing
    user or tool turn would train nothing, and changes how Qwen3 renders the turns before it. (A conversation with
    no assistant turn has no trainable tokens and is skipped, as counted in the stage's statistics.) With
    `image_parts` (vision-language rows) a content may also be a list of {"type": "text", "text": str} and
    {"type": "image"} parts. Returns copies with a missing tool-call content made ""."""
    if not isinstance(messages, list) or not messages:
        raise ToolkitError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects.")
    content_kind = f"a string content or a list of {IMAGE_PARTS}" if image_parts else "a string content"
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ToolkitError(f"{where}: messages[{i}] must have a role in {ROLES} and {content_kind}.")
        m = {k: v for k, v in m.items() if k not in TURN_FLAGS}  # read by assistant_trains; never rendered
        if m["role"] == "assistant" and m.get("tool_calls") and m.get("content") is None:
            m["content"] = ""
        content = m.get("content")
        if image_parts and isinstance(content, list):
            _check_parts(content, f"{where}: messages[{i}]")
        elif not isinstance(content, str):
            raise ToolkitError(f"{where}: messages[{i}] must have a role in {ROLES} and {content_kind}.")
        if "reasoning_content" in m and not (m["role"] == "assistant" and isinstance(m["reasoning_content"], str)):
            raise ToolkitError(f"{where}: messages[{i}].reasoning_content must be a string on an assistant turn.")
        if "tool_calls" in m:
            calls = m["tool_calls"]
            if m["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(f := c.get("function", c), dict)
                    and isinstance(f.get("name"), str) and isinstance(f.get("arguments", {}), dict | str)
                    for c in calls):
                raise ToolkitError(f"{where}: messages[{i}].tool_calls must be a list of {{\"type\": \"function\", "
                                   "\"function\": {\"name\": str, \"arguments\": object}} on an assistant turn.")
        texts = [("content", content)] if isinstance(content, str) else \
            [("content", p["text"]) for p in content if p["type"] == "text"]
        texts += [("reasoning_content", m["reasoning_content"])] if "reasoning_content" in m else []
        for key, text in texts:
            if IM_START in text or IM_END in text:
                raise ToolkitError(f"{where}: messages[{i}].{key} contains {IM_START} or {IM_END}; these are "
                                   "the chat format's own markers and cannot appear inside a message.")
        out.append(m)
    check_turn_order(out, where, train_on)
    assistant_trains(messages, where, train_on)
    return out


TURN_FLAGS = ("weight", "training")
"""Per-message keys that say whether a turn trains, honoured exactly: `"weight": 0 | 1` (OpenAI's chat fine-tuning
format, ShareGPT/LLaMA-Factory data) and axolotl's `"training": false | true`."""


def assistant_trains(messages: list[dict[str, Any]], where: str, train_on: str) -> list[bool]:
    """Whether each assistant message (in order) trains, from its `weight` / `training` flag (default: it trains).

    What cannot be honoured exactly is refused: a weight other than 0 or 1 (loss weighting), a flag asking a
    user/system/tool turn to train under train_on: assistant, a turn left out under train_on: all (every token
    trains), the two flags disagreeing, and axolotl's character-level `train_detail`."""
    trains = []
    for i, m in enumerate(messages):
        if "train_detail" in m:
            raise ToolkitError(f"{where}: messages[{i}].train_detail (per-span training) is not supported; set "
                               "\"weight\": 0 or 1 on the whole turn, or split the turn.")
        flags = []
        if "weight" in m:
            w = m["weight"]
            if isinstance(w, bool) or not isinstance(w, int | float) or w not in (0, 1):
                raise ToolkitError(f"{where}: messages[{i}].weight is {w!r}; only 0 (do not train this turn) or 1 "
                                   "(train it) is supported, not loss weighting.")
            flags.append(bool(w))
        if "training" in m:
            if not isinstance(m["training"], bool):
                raise ToolkitError(f"{where}: messages[{i}].training is {m['training']!r}; it must be true or false.")
            flags.append(m["training"])
        if len(set(flags)) > 1:
            raise ToolkitError(f"{where}: messages[{i}] has weight {m['weight']!r} and training {m['training']!r}, "
                               "which disagree; keep one of them.")
        train = flags[0] if flags else None
        key = "weight" if "weight" in m else "training"
        if m["role"] == "assistant":
            if train is False and train_on == "all":
                raise ToolkitError(f"{where}: messages[{i}].{key} leaves the turn out of training, but data.train_on "
                                   "is all, which trains every token; set data.train_on: assistant.")
            trains.append(train is not False)
        elif train is True and train_on == "assistant":
            raise ToolkitError(f"{where}: messages[{i}].{key} asks a {m['role']} turn to train, but only assistant "
                               "turns train with data.train_on: assistant; drop the flag or set data.train_on: all.")
        elif train is False and train_on == "all":
            raise ToolkitError(f"{where}: messages[{i}].{key} leaves a {m['role']} turn out of training, but "
                               "data.train_on is all, which trains every token; set data.train_on: assistant.")
    return trains


def drop_untrained_runs(mask: list[int], trains: list[bool], where: str) -> list[int]:
    """A {% generation %} mask with the runs of assistant turns that do not train zeroed. The i-th run of 1s must be
    the i-th assistant turn: when the runs do not match the turns one to one, the flags cannot be honoured exactly
    and the row is refused."""
    if all(trains):
        return mask
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if len(runs) != len(trains):
        raise ToolkitError(f"{where}: the chat template's {{% generation %}} blocks mark {len(runs)} span(s) for "
                           f"{len(trains)} assistant turn(s), so per-turn weights cannot be applied exactly; drop the "
                           "weights or use the model's own template.")
    out = list(mask)
    for (a, b), train in zip(runs, trains, strict=True):
        if not train:
            out[a:b] = [0] * (b - a)
    return out


def _check_parts(parts: list[Any], where: str) -> None:
    """A vision-language content list: text parts with a string `text`, and image parts."""
    if not all(isinstance(p, dict) and "type" in p for p in parts):
        raise ToolkitError(f"{where}.content must be a string or a list of {IMAGE_PARTS}.")
    for p in parts:
        if p["type"] == "text" and not isinstance(p.get("text"), str):
            raise ToolkitError(f"{where} has a text part without a string 'text'.")
        if p["type"] not in ("image", "text"):
            raise ToolkitError(f"{where} has a '{p['type']}' part; only text and image parts are supported.")


def check_turn_order(messages: list[dict[str, Any]], where: str, train_on: str) -> None:
    """With train_on: assistant, a conversation with assistant turns opens with a user turn (after an optional
    system prompt) and ends with an assistant turn."""
    if train_on != "assistant" or not any(m["role"] == "assistant" for m in messages):
        return
    first = next(m["role"] for m in messages if m["role"] != "system")
    if first != "user":
        raise ToolkitError(f"{where}: the conversation starts with a{'n' if first == 'assistant' else ''} {first} "
                           "turn; after an optional system prompt it must start with a user turn.")
    if messages[-1]["role"] != "assistant":
        raise ToolkitError(f"{where}: the conversation ends with a {messages[-1]['role']} turn; it must end with "
                           "the assistant turn being trained (drop the trailing turn).")


def has_generation_tags(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}")


def check_renderable(template: str, messages: list[dict[str, Any]], tools: Any, where: str) -> None:
    """Refuse what the chat template would silently drop: `tools`, `reasoning_content`, `tool_calls` or tool turns
    that it never mentions (data.chat_template: chatml renders none of them)."""
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ToolkitError(f"{where}: 'tools' must be a list of JSON objects (function schemas).")
        if "tools" not in template:
            raise ToolkitError(f"{where}: the row has 'tools' but the chat template does not render tools, so the "
                               "model would call functions whose schema it never saw. Use the model's own template "
                               "(drop data.chat_template) or remove 'tools'.")
    needs = [("reasoning_content", any("reasoning_content" in m for m in messages)),
             ("tool_calls", any(m.get("tool_calls") for m in messages))]
    for key, present in needs:
        if present and key not in template:
            raise ToolkitError(f"{where}: the row has '{key}' but the chat template does not render it, so it would "
                               "be dropped from training. Use the model's own template (drop data.chat_template) "
                               f"or remove '{key}'.")
    if any(m["role"] == "tool" for m in messages) and not re.search(r"""==\s*['"]tool['"]""", template):
        raise ToolkitError(f"{where}: the row has a tool turn but the chat template has no format for tool results "
                           "(it would render them as a turn of role 'tool'). Use the model's own template.")


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any, where: str,
            **kwargs: Any) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except Exception as e:  # a template's raise_exception, or Jinja errors on a shape it does not handle
        raise ToolkitError(f"{where}: the chat template could not render this row ({type(e).__name__}: {e}).") from None


def is_chatml_family(template: str) -> bool:
    """Templates that render every turn as <|im_start|>role ... <|im_end|> (ChatML, Qwen2.5, Qwen3, Qwen-VL)."""
    return IM_START in template and IM_END in template


def chatml_assistant_spans(text: str, n_assistant: int, where: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in a ChatML-family rendering: from after the header
    `<|im_start|>assistant\n` through `<|im_end|>` (the newline after it is not part of the turn).

    This reads the turns off the rendering itself, so it holds whatever the template does to a turn (Qwen3 drops
    the think block of history turns, which makes it not prefix-stable); the number of turns found must equal the
    row's assistant messages."""
    spans, pos = [], 0
    while (start := text.find(IM_START, pos)) != -1:
        end = text.find(IM_END, start)
        if end == -1:
            raise ToolkitError(f"{where}: the chat template rendered a turn without {IM_END}, so assistant turns "
                               "cannot be located.")
        end += len(IM_END)
        if text.startswith(ASSISTANT_HEADER, start) and text[start + len(ASSISTANT_HEADER)] in ("\n", "<"):
            body = start + len(ASSISTANT_HEADER)
            spans.append((body + 1 if text[body] == "\n" else body, end))
        pos = end
    if len(spans) != n_assistant:
        raise ToolkitError(f"{where}: the chat template rendered {len(spans)} assistant turn(s) for {n_assistant} "
                           "assistant message(s), so they cannot be masked exactly.")
    return spans


def chatml_token_mask(ids: list[int], tokenizer: PreTrainedTokenizerBase, trains: list[bool], where: str) -> list[int]:
    """`chatml_assistant_spans` on token ids (vision-language rows, whose image tokens the processor expands): 1 from
    after the header tokens `<|im_start|>assistant\n` through the next `<|im_end|>` for each assistant turn that
    trains (`trains`, one flag per assistant message), 0 elsewhere."""
    header = tokenizer.encode(ASSISTANT_HEADER + "\n", add_special_tokens=False)
    end_id = tokenizer.convert_tokens_to_ids(IM_END)
    n_assistant = len(trains)
    mask, found, i = [0] * len(ids), 0, 0
    while i < len(ids):
        if ids[i:i + len(header)] == header:
            j = i + len(header)
            while j < len(ids) and ids[j] != end_id:
                j += 1
            if found >= n_assistant or trains[found]:
                mask[i + len(header):j + 1] = [1] * (min(j + 1, len(ids)) - i - len(header))
            found, i = found + 1, j + 1
        else:
            i += 1
    if found != n_assistant:
        raise ToolkitError(f"{where}: found {found} assistant turn(s) in the rendering for {n_assistant} assistant "
                           "message(s), so they cannot be masked exactly (does an assistant message start with a "
                           "newline?).")
    return mask


def _apply_thinking(text: str, spans: list[tuple[int, int]], thinking: str, tokenizer: PreTrainedTokenizerBase,
                    where: str) -> tuple[str, list[tuple[int, int]]]:
    """data.thinking: 'none' removes the empty think block from the assistant turns the template gave one; 'empty'
    gives the last assistant turn one when it has no think block. 'auto' keeps the template's rendering."""
    if thinking == "auto" or not spans:
        return text, spans
    if thinking == "empty":
        start, end = spans[-1]
        if text.startswith("<think>", start):
            return text, spans
        if tokenizer.convert_tokens_to_ids("<think>") in (None, tokenizer.unk_token_id):
            raise ToolkitError(f"{where}: data.thinking is 'empty' but the tokenizer has no <think> token; use "
                               "auto or none with this model.")
        n = len(EMPTY_THINK)
        return text[:start] + EMPTY_THINK + text[start:], [*spans[:-1], (start, end + n)]
    out, new_spans, shift, pos = [], [], 0, 0
    for start, end in spans:
        cut = len(EMPTY_THINK) if text.startswith(EMPTY_THINK, start) else 0
        out += [text[pos:start]]
        pos = start + cut
        new_spans.append((start - shift, end - shift - cut))
        shift += cut
    out.append(text[pos:])
    return "".join(out), new_spans


def _prefix_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any, full: str,
                  where: str) -> list[tuple[int, int]]:
    """Spans of assistant turns for a prefix-stable template that is not ChatML-shaped (Llama 3, ...): turn i is
    what rendering messages[:i+1] adds to messages[:i] with a generation prompt."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, where, add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], tools, where)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ToolkitError(
                f"{where}: the chat template is not prefix-stable for this conversation and has neither ChatML turns "
                "nor {% generation %} markers, so assistant turns cannot be located. Set data.chat_template: chatml "
                "or give a Jinja template with {% generation %} blocks.")
        spans.append((len(before), len(upto.rstrip())))  # the newline after a turn is not trained
    return spans


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token that starts inside one of the (sorted, disjoint) character spans."""
    mask, k = [], 0
    for start, _ in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        mask.append(int(k < len(spans) and spans[k][0] <= start))
    return mask


def _encode_messages(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any,
                     train_on: str, where: str, thinking: str, trains: list[bool]) -> tuple[list[int], list[int]]:
    """Ids and labels of a checked conversation; `trains` says which assistant turns train (`assistant_trains`)."""
    template = tokenizer.chat_template
    check_renderable(template, messages, tools, where)
    if thinking != "auto" and (has_generation_tags(tokenizer) or not is_chatml_family(template)):
        raise ToolkitError(f"{where}: data.thinking: {thinking} applies to ChatML-family templates without "
                           "{% generation %} markers (the stock Qwen templates); this template decides what trains "
                           "itself. Use data.thinking: auto.")
    if has_generation_tags(tokenizer):
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        mask = drop_untrained_runs(list(out["assistant_masks"]), trains, where)
    else:
        full = _render(tokenizer, messages, tools, where)
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        if is_chatml_family(template):
            spans = chatml_assistant_spans(full, n_assistant, where)
            full, spans = _apply_thinking(full, spans, thinking, tokenizer, where)
        else:
            spans = _prefix_spans(tokenizer, messages, tools, full, where)
        spans = [span for span, train in zip(spans, trains, strict=True) if train]
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = _span_mask(enc["offset_mapping"], spans)
    labels = ids if train_on == "all" else [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
    return ids, list(labels)


SHAPES = {"messages": ("messages",), "prompt and completion": ("prompt", "completion"), "text": ("text",)}
"""The row shapes, by the keys that make them; a row has exactly one."""

REFUSED_ROW_KEYS = {
    **dict.fromkeys(("weight", "loss_weight", "sample_weight"), "per-row loss weighting is not supported (a "
                    "message's \"weight\": 0 or 1 leaves a turn out); remove it, or repeat rows to weight them"),
    **dict.fromkeys(("chosen", "rejected"), "preference pairs (DPO) are not supported: rows train supervised, so "
                    "a rejected answer would be learned; keep the answer to learn as the row's last assistant turn"),
    **dict.fromkeys(("input_ids", "labels", "attention_mask", "loss_mask"), "pre-tokenised rows are not supported: "
                    "give the text and let data.train_on decide the loss"),
    "train_on": "data.train_on sets it for every row; remove it, or split the file into stages",
    "system": "put the system prompt as the first message, {\"role\": \"system\", \"content\": ...}",
    "videos": "video rows are not supported",
    "audios": "audio rows are not supported",
}
"""Row keys that would change what trains but that no row shape reads: refused, never dropped."""


def _present(row: dict[str, Any], key: str) -> bool:
    return row.get(key) is not None  # a null column of a mixed-shape table is no key at all


def row_shape(row: dict[str, Any], where: str, *, vision: bool = False) -> str:
    """The row's shape (a key of SHAPES), once it is shown that nothing in the row that would change what trains
    is ignored: two shapes in one row, a refused key (REFUSED_ROW_KEYS), `tools` outside a chat, `images` outside
    a vision-language model's chat."""
    for key, why in REFUSED_ROW_KEYS.items():
        if _present(row, key):
            raise ToolkitError(f"{where}: the row has '{key}': {why}.")
    if isinstance(row.get("label"), bool):  # KTO's desirable / undesirable mark (another 'label' is an extra)
        raise ToolkitError(f"{where}: the row has a true/false 'label' (KTO preference data), which is not "
                           "supported: rows train supervised, so an undesirable answer would be learned; keep only "
                           "rows to learn, without the label.")
    shapes = [name for name, keys in SHAPES.items() if any(_present(row, k) for k in keys)]
    if len(shapes) > 1:
        keys = [k for name in shapes for k in SHAPES[name] if _present(row, k)]
        raise ToolkitError(f"{where}: the row has {', '.join(repr(k) for k in keys)}, which are {len(shapes)} row "
                           "shapes; keep one ('messages', 'prompt' and 'completion', or 'text'): the others would "
                           "not be trained.")
    shape = shapes[0] if shapes else None
    if shape is None or not all(_present(row, k) for k in SHAPES[shape]):
        raise ToolkitError(f"{where}: a row needs 'messages', 'prompt' and 'completion', or 'text'; "
                           f"found keys {sorted(row)}.")
    for key, needs in (("tools", "a chat ('messages')"),
                       ("images", "a chat ('messages') for a vision-language model" if vision else
                        "a vision-language model (this model reads text only)")):
        if _present(row, key) and (shape != "messages" or (key == "images" and not vision)):
            raise ToolkitError(f"{where}: the row has '{key}', which needs {needs}; it would not be trained.")
    return shape


def encode_row(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, train_on: str,
               where: str, thinking: str = "auto") -> tuple[list[int], list[int]]:
    """Token ids and labels (IGNORE_INDEX where no loss) of one row. The first token never carries loss.

    A chat row's `tools` (function schemas) go to the chat template; `thinking` is data.thinking; a message's
    `weight` / `training` flag leaves its turn out (`assistant_trains`)."""
    global ENCODE_CALLS
    ENCODE_CALLS += 1
    shape = row_shape(row, where)
    if shape == "messages":
        if not tokenizer.chat_template:
            raise ToolkitError(
                f"{where}: the row is a chat ('messages') but the tokenizer has no chat template. Use a chat "
                "model's tokenizer or set data.chat_template (for example: chatml).")
        messages = check_messages(row["messages"], where, train_on)
        ids, labels = _encode_messages(tokenizer, messages, row.get("tools"), train_on, where, thinking,
                                       assistant_trains(row["messages"], where, train_on))
    elif shape == "prompt and completion":
        if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
            raise ToolkitError(f"{where}: 'prompt' and 'completion' must be strings.")
        prompt = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt + completion
        labels = (prompt if train_on == "all" else [IGNORE_INDEX] * len(prompt)) + completion
    else:
        if not isinstance(row["text"], str):
            raise ToolkitError(f"{where}: 'text' must be a string.")
        ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
        labels = list(ids)
    if labels:
        labels[0] = IGNORE_INDEX  # nothing predicts the first token
    return ids, labels


RowEncoder = Callable[[dict[str, Any], Path, str, "DataStats"], "dict[str, Any] | None"]
"""(row, its file, 'file:line', stats) -> sample with input_ids and labels, or None when the length policy drops
it (counted in stats). Text rows use `text_encoder`; vision-language rows `toolkit.vl_data.vl_encoder`."""


def text_encoder(tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int, overlength: str,
                 train_on: str, thinking: str = "auto") -> RowEncoder:
    """`encode_row`, then the over-length policy (`fit_to_length`)."""
    def encode(row: dict[str, Any], path: Path, where: str, stats: DataStats) -> dict[str, Any] | None:
        ids, labels = encode_row(row, tokenizer, train_on, where, thinking)
        return fit_to_length(ids, labels, max_seq_len=max_seq_len, overlength=overlength, where=where, stats=stats)
    return encode


def fit_to_length(ids: list[int], labels: list[int], *, max_seq_len: int, overlength: str, where: str,
                  stats: DataStats | None, uncuttable: int = 0) -> dict[str, Any] | None:
    """data.overlength for a row over `max_seq_len` tokens: "error" raises, "drop" returns None, "truncate" cuts ids
    and labels to max_seq_len. The first `uncuttable` tokens must stay whole (a vision-language row's image tokens):
    a cut inside them drops the row instead. `stats`, when given, counts dropped and truncated rows."""
    if len(ids) <= max_seq_len:
        return {"input_ids": ids, "labels": labels}
    if overlength == "error":
        raise ToolkitError(f"{where}: {len(ids)} tokens, over data.max_seq_len={max_seq_len}. Raise "
                           "max_seq_len, or set data.overlength to drop or truncate.")
    if overlength == "drop" or uncuttable > max_seq_len:
        if stats is not None:
            stats.dropped_overlength += 1
        return None
    if stats is not None:
        stats.truncated += 1
    return {"input_ids": ids[:max_seq_len], "labels": labels[:max_seq_len]}


def encode_files(paths: list[Path], tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int,
                    overlength: str, train_on: str, thinking: str = "auto", cache_dir: Path | None = None,
                    encoder: RowEncoder | None = None) -> EncodedRows:
    """Read and tokenise a stage's files, applying the over-length policy and skipping rows with no loss.

    With `cache_dir`, each file's result is reused from the tokenisation cache there, or computed and saved to it
    (see `_load_file_cached`), so restarts and later stages skip the slow chat-template tokenisation. An explicit
    `encoder` (vision-language rows) replaces the text encoder and is not cached.
    """
    if encoder is not None:
        return _tokenise(paths, encoder)
    if cache_dir is None:
        return _tokenise(paths, text_encoder(tokenizer, max_seq_len=max_seq_len, overlength=overlength,
                                             train_on=train_on, thinking=thinking))
    fingerprint = tokenizer_fingerprint(tokenizer)
    data = EncodedRows()
    for path in paths:
        part = _load_file_cached(path, tokenizer, Path(cache_dir), fingerprint, max_seq_len=max_seq_len,
                                 overlength=overlength, train_on=train_on, thinking=thinking)
        data.samples += part.samples
        data.extras += part.extras
        _add_stats(data.stats, part.stats)
    return data


ROW_CONTENT_KEYS = ("messages", "tools", "prompt", "completion", "text", "images")
"""Row keys that become tokens; the others (difficulty, ...) are kept as the sample's extras."""


def _tokenise(paths: list[Path], encode: RowEncoder) -> EncodedRows:
    """The uncached work of `encode_files`: encode every row, count what happened, drop rows with no loss."""
    data = EncodedRows()
    st = data.stats
    for path in paths:
        for lineno, row in iter_jsonl(path):
            st.rows += 1
            sample = encode(row, path, f"{path}:{lineno}", st)
            if sample is None:
                continue
            n_label = sum(label != IGNORE_INDEX for label in sample["labels"])
            if n_label == 0:
                st.no_label_tokens += 1
                continue
            st.kept += 1
            st.tokens += len(sample["input_ids"])
            st.label_tokens += n_label
            data.samples.append(sample)
            data.extras.append({k: v for k, v in row.items() if k not in ROW_CONTENT_KEYS})
    return data


def _add_stats(into: DataStats, other: DataStats) -> None:
    for key in vars(into):
        setattr(into, key, getattr(into, key) + getattr(other, key))


# --- tokenisation cache -------------------------------------------------------------------------------------------
# Layout under cache_dir:
#   <key>.npz               one tokenised file: int arrays input_ids, labels (concatenated), offsets (n + 1), and
#                           meta (uint8 UTF-8 JSON: key fields, source path, DataStats, extras). No pickles.
#   hashes/<sha(path)>.json a file's sha256 remembered against its size, mtime, ctime and inode.
# key = sha256 of {CACHE_FORMAT_VERSION, file sha256, tokenizer fingerprint (chat template included), max_seq_len,
# overlength, train_on, thinking}.
# Every file is written atomically (toolkit/atomic.py), so concurrent ranks and crashes never leave a
# partial entry; ranks that miss together each tokenise and the last rename wins (the contents are identical).


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of everything encode_row's output depends on besides the row: the tokenizer (its full serialisation
    when fast, else its vocab), special and added tokens, BOS/EOS settings, the chat template, library versions."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "class": type(tokenizer).__name__,
        "core": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "special": tokenizer.special_tokens_map,
        "all_special": tokenizer.all_special_tokens,
        "added": {str(i): str(t) for i, t in tokenizer.added_tokens_decoder.items()},
        "eos_token_id": tokenizer.eos_token_id,
        "flags": [getattr(tokenizer, name, None) for name in ("add_bos_token", "add_eos_token")],
        "chat_template": tokenizer.chat_template,
        "versions": [transformers.__version__, tokenizers.__version__],
    }
    return _sha256(json.dumps(parts, sort_keys=True, default=str).encode())


def _stat_sig(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _file_sha256(path: Path, cache_dir: Path) -> tuple[str, list[int]]:
    """sha256 of the file's bytes (streamed) and its stat signature taken before reading.

    The hash is remembered and reused while size, mtime, ctime and inode are unchanged; it is only remembered for a
    file last changed over RACY_WINDOW_NS before hashing, so a same-size rewrite within the filesystem's timestamp
    granularity cannot hide behind an unchanged stat.
    """
    sig = _stat_sig(path)
    record = cache_dir / "hashes" / f"{_sha256(str(path.resolve()).encode())}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(record.read_text())
        if saved["stat"] == sig and isinstance(saved["sha256"], str):
            return saved["sha256"], sig
    started = time.time_ns()
    digest = _stream_sha256(path)
    if started - max(sig[1], sig[2]) > RACY_WINDOW_NS and _stat_sig(path) == sig:
        payload = json.dumps({"path": str(path), "stat": sig, "sha256": digest}).encode()
        with contextlib.suppress(OSError):
            write_atomic(record, lambda f: f.write(payload))
    return digest, sig


def content_digest(path: Path, cache_dir: Path | None) -> str:
    """sha256 of a data file's bytes; with a cache dir, remembered there while the file is unchanged (the same
    record the tokenisation cache keys on, so a run hashes each file once)."""
    return _file_sha256(path, cache_dir)[0] if cache_dir is not None else _stream_sha256(path)


def _stream_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _read_entry(entry: Path, key: dict[str, Any]) -> EncodedRows | None:
    """The cached result, or None when the entry is unreadable, truncated, inconsistent or for another key."""
    try:
        with np.load(entry, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            ids, labels, offsets = z["input_ids"], z["labels"], z["offsets"]
        stats = DataStats(**meta["stats"])
        extras = meta["extras"]
        ok = (meta["key"] == key and isinstance(extras, list) and len(extras) == len(offsets) - 1 == stats.kept
              and all(a.dtype.kind == "i" and a.ndim == 1 for a in (ids, labels, offsets))
              and offsets[0] == 0 and offsets[-1] == len(ids) == len(labels) == stats.tokens
              and bool((np.diff(offsets) >= 0).all()) and int((labels != IGNORE_INDEX).sum()) == stats.label_tokens)
    except (OSError, ValueError, KeyError, TypeError, IndexError, EOFError, zipfile.BadZipFile):
        ok = False
    if not ok:
        log.warning("Tokenisation cache entry %s is unreadable or inconsistent; rebuilding it.", entry)
        return None
    bounds, ids_list, labels_list = offsets.tolist(), ids.tolist(), labels.tolist()
    samples = [{"input_ids": ids_list[a:b], "labels": labels_list[a:b]} for a, b in itertools.pairwise(bounds)]
    return EncodedRows(samples, extras, stats)


def _write_entry(entry: Path, data: EncodedRows, key: dict[str, Any], source: Path) -> None:
    lengths = [len(s["input_ids"]) for s in data.samples]
    ids = np.fromiter(itertools.chain.from_iterable(s["input_ids"] for s in data.samples), np.int64, sum(lengths))
    labels = np.fromiter(itertools.chain.from_iterable(s["labels"] for s in data.samples), np.int64, sum(lengths))
    if ids.size == 0 or int(ids.max()) < 2**31:  # int32 halves the size for every real vocabulary
        ids, labels = ids.astype(np.int32), labels.astype(np.int32)
    meta = {"key": key, "source": str(source), "stats": asdict(data.stats), "extras": data.extras}
    arrays = {"input_ids": ids, "labels": labels, "offsets": np.cumsum([0, *lengths], dtype=np.int64),
              "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    write_atomic(entry, lambda f: np.savez(f, **arrays))


def _load_file_cached(path: Path, tokenizer: PreTrainedTokenizerBase, cache_dir: Path, fingerprint: str, *,
                      max_seq_len: int, overlength: str, train_on: str, thinking: str = "auto") -> EncodedRows:
    """One file through the cache: a hit skips tokenisation; a miss tokenises (errors propagate and are never
    cached) and saves the result unless the file changed meanwhile. A cache that cannot be written only warns."""
    settings: dict[str, Any] = {"max_seq_len": max_seq_len, "overlength": overlength, "train_on": train_on,
                                "thinking": thinking}
    encode = text_encoder(tokenizer, **settings)
    if not path.is_file():
        return _tokenise([path], encode)  # raises iter_jsonl's "does not exist" error
    digest, sig = _file_sha256(path, cache_dir)
    key = {"format": CACHE_FORMAT_VERSION, "file_sha256": digest, "tokenizer": fingerprint, **settings}
    entry = cache_dir / f"{_sha256(json.dumps(key, sort_keys=True).encode())}.npz"
    if entry.is_file() and (cached := _read_entry(entry, key)) is not None:
        return cached
    data = _tokenise([path], encode)
    if _stat_sig(path) == sig:  # otherwise the bytes tokenised may not be the bytes hashed
        try:
            _write_entry(entry, data, key, path)
        except OSError as e:
            log.warning("Could not write tokenisation cache entry %s (%s); continuing without it.", entry, e)
    return data


@dataclass
class TrainingSet:
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


def load_training_set(paths: list[Path], tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int, overlength: str,
                       train_on: str, packing: bool, needs_difficulty: bool, thinking: str = "auto",
                       cache_dir: Path | None = None, encoder: RowEncoder | None = None) -> TrainingSet:
    """Load each file of a stage separately (mixtures sample per file); with packing, pack within each file.

    `cache_dir` and `encoder` are passed on to `encode_files` (the per-file tokenisation cache; a non-text
    row encoder).

    A packed row's difficulty is that of its hardest sample, so easy-to-hard order stays conservative.
    """
    out = TrainingSet([], [], [] if needs_difficulty else None, [], DataStats())
    for path in paths:
        data = encode_files([path], tokenizer, max_seq_len=max_seq_len, overlength=overlength, train_on=train_on,
                               thinking=thinking, cache_dir=cache_dir, encoder=encoder)
        _add_stats(out.stats, data.stats)
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

