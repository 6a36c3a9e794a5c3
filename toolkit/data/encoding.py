"""Rows to token ids and loss masks, formatted by the tokenizer's own chat template, many rows at a time.

Three row shapes are accepted (`row_shape`; a row has exactly one):
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
  {"prompt": "...", "completion": "..."}      (plain concatenation, loss on the completion)
  {"text": "..."}                               (language modelling, loss on every token)
Other tools' shapes reach here already mapped to these (toolkit/data/sources.py). A row's `difficulty` is kept for
the curriculum; other extra keys are ignored, keys that would change what trains but that no shape reads are
refused (`REFUSED_ROW_KEYS`), and message keys nothing reads are counted for the stage's log
(`unread_message_keys`).

Loss goes on assistant tokens only by default (`data.train_on`), and a message's training flag (`"weight": 0`,
`"training": false` and every peer's other flag: TURN_FLAGS) leaves its turn out (`assistant_trains`). Content
given as text parts is joined for a text model (a vision-language model keeps its parts). How the assistant turns
are found depends on the template:
  * `{% generation %}` markers: the spans the renderer reports (transformers' `return_assistant_tokens_mask`
    rule: every token that overlaps a span);
  * a ChatML-family template (ChatML and the stock Qwen2.5 / Qwen3 / Qwen-VL templates): rendered once and the
    turns read off the rendering, header excluded and `<|im_end|>` included, which holds for templates that rewrite
    history (Qwen3 drops the think block of earlier turns, so it is not prefix-stable);
  * any other template: by rendering prefixes (turn i is what rendering `messages[:i+1]` adds to `messages[:i]`
    with a generation prompt), checked per row.
A row's `tools` go to the template; fields a template cannot render (tools, reasoning_content, tool_calls, tool
turns under ChatML) are refused rather than dropped. `data.thinking` adds or removes empty think blocks.

`TextEncoder.encode` does a batch of rows at once: each row is checked and rendered, then every rendering is
tokenised whole in one call of the fast tokenizer (never turn by turn: BPE may merge across a turn's edge where the
text allows it, so only whole texts give the template's tokens), and the loss mask is read off the tokens' character
offsets against the turns' character spans, so no turn is ever re-encoded. A stock Qwen template is rendered by its
direct renderer (toolkit/data/render.py: the Jinja template's text byte for byte, each assistant turn's span known
as it is written) and the offsets are read only at the spans' ends (`Tokens`); any other template, and every row
under data.renderer: jinja, is rendered through Jinja and its offsets read whole. The choice is logged once.
`encode_row` is the same for one row. Errors name the row (`file:line`) and stop the batch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from toolkit.data.bpe import TWIN_MIN_ROWS, BpeTwin
from toolkit.data.render import Renderer, Unrendered, direct_renderer
from toolkit.errors import ToolkitError
from toolkit.templates import IM_END, IM_START, STOCK_FILES, TEMPLATE_NAMES, is_jinja_text, stock_template

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label of a token that carries no loss (the value transformers' losses ignore)."""

ROLES = ("system", "user", "assistant", "tool")

ENCODE_CALLS = 0
"""Rows encoded in this process (tests check that a prepared store is not tokenised again)."""


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
    dropped_by_difficulty: int = 0  # stage.drop
    identical: int = 0  # pairs whose two sides render alike (data.identical_pairs: skip)
    pairs: bool = False  # a preference stage's: every count is of pairs (tokens: both sides')

    def summary(self) -> str:
        if self.pairs:
            head = (f"{self.rows} pairs, {self.kept} kept ({self.tokens} tokens, {self.label_tokens} trained, both "
                    f"sides), {self.dropped_overlength} dropped over max_seq_len, {self.truncated} truncated, "
                    f"{self.no_label_tokens} dropped with no completion token left"
                    + (f", {self.identical} dropped with chosen = rejected (data.identical_pairs: skip)"
                       if self.identical else ""))
        else:
            head = (f"{self.rows} rows, {self.kept} kept ({self.tokens} tokens, {self.label_tokens} trained), "
                    f"{self.dropped_overlength} dropped over max_seq_len, {self.truncated} truncated, "
                    f"{self.no_label_tokens} skipped with no trainable tokens")
        return head + (f", {self.dropped_by_difficulty} dropped by difficulty (drop)" if self.dropped_by_difficulty
                       else "")

    def add(self, other: DataStats) -> None:
        for key, value in vars(self).items():
            if key == "pairs":
                self.pairs = value or other.pairs
            else:
                setattr(self, key, value + getattr(other, key))


ASSISTANT_HEADER = IM_START + "assistant"
EMPTY_THINK = "<think>\n\n</think>\n\n"
IMAGE_PARTS = '{"type": "text" | "image" | "video", ...} parts'  # a vision-language message's content list


def check_messages(messages: Any, where: str, train_on: str = "assistant", *,
                   image_parts: bool = False) -> list[dict[str, Any]]:
    """`checked_messages` without the training flags."""
    return checked_messages(messages, where, train_on, image_parts=image_parts)[0]


def checked_messages(messages: Any, where: str, train_on: str = "assistant", *,
                     image_parts: bool = False) -> tuple[list[dict[str, Any]], list[bool]]:
    """The row's messages, checked: roles, string contents (an assistant turn with tool_calls may have none), a
    string `reasoning_content`, well-formed `tool_calls`. With train_on: assistant, a conversation with assistant
    turns must open (after an optional system prompt) with a user turn and end with an assistant turn: a trailing
    user or tool turn would train nothing, and changes how Qwen3 renders the turns before it. (A conversation with
    no assistant turn has no trainable tokens and is skipped, as counted in the stage's statistics.) With
    `image_parts` (vision-language rows) a content may also be a list of {"type": "text", "text": str} and
    {"type": "image"} parts. Returns copies with a missing tool-call content made "", and whether each assistant message
    trains (`assistant_trains`, called once here)."""
    if not isinstance(messages, list) or not messages:
        raise ToolkitError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects.")
    content_kind = f"a string content or a list of {IMAGE_PARTS}" if image_parts else "a string content"
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            hint = (f"; its role is {role!r}: map role names with the data entry's tags (user_tag, assistant_tag, "
                    "system_tag, observation_tag, function_tag)") if isinstance(role, str) else ""
            raise ToolkitError(f"{where}: messages[{i}] must have a role in {ROLES} and {content_kind}{hint}.")
        m = {k: v for k, v in m.items() if k not in TURN_FLAGS and k != PROMPT_TURN}  # flags are never rendered
        if m["role"] == "assistant" and m.get("tool_calls") and m.get("content") is None:
            m["content"] = ""
        content = m.get("content")
        if image_parts and isinstance(content, list):
            _check_parts(content, f"{where}: messages[{i}]")
        elif isinstance(content, list) and content:  # text parts (OpenAI, TRL) on a text model: one string
            m["content"] = content = _joined_text(content, f"{where}: messages[{i}]")
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
    return out, assistant_trains(messages, where, train_on)


TURN_FLAGS = ("weight", "loss_weight", "training", "train", "loss", "loss_scale")
"""Per-message keys that say whether a turn trains, honoured exactly as 0/1 or false/true: `weight` (OpenAI's chat
fine-tuning format, ShareGPT/LLaMA-Factory data), `loss_weight` (LLaMA-Factory v1), `training` and `train`
(axolotl), `loss` and `loss_scale` (ms-swift). Anything else (loss weighting) is refused."""
PROMPT_TURN = "_prompt_turn"
"""Marks an assistant turn of a conversational prompt (TRL, set by sources.py): context, not trained under
train_on: assistant (under train_on: all every token trains)."""
MESSAGE_KEYS = ("role", "content", "tool_calls", "reasoning_content", "name", "tool_call_id", *TURN_FLAGS,
                PROMPT_TURN)
"""Message keys that are read (rendered by the template or read as flags); any other is counted and named in the
stage's data log (`unread_message_keys`)."""


def unread_message_keys(row: dict[str, Any]) -> set[str]:
    """The keys on the row's messages that nothing reads (not in MESSAGE_KEYS)."""
    messages = row.get("messages")
    if not isinstance(messages, list):
        return set()
    return {k for m in messages if isinstance(m, dict) for k in m if k not in MESSAGE_KEYS}


READ_ROW_KEYS = ("messages", "prompt", "completion", "text", "tools", "images", "videos", "difficulty", "label",
                 "reference")
"""Row keys a shape or the encoder reads (or refuses: REFUSED_ROW_KEYS; `reference` is read by generation evals,
whose prompt files may also be loss-eval data). A source's other keys hold no content
(toolkit/data/shapes.py refuses those that do) and are named once in the stage's log (`row_notes`)."""
NOTE_KEY = "_notes"
"""A mapped row's notes (toolkit/data/shapes.py): what was chosen for it, said once per stage in the log."""
NOT_READ = "metadata and keys without content, not read"


def row_notes(row: dict[str, Any], empty_answers: str = "error") -> list[str]:
    """What the stage's log says about the row, once per stage with the rows it holds for: the shape chosen where a
    row holds its dialog twice (`NOTE_KEY`), each row key nothing reads (`NOT_READ: key`), and an empty answer left
    untrained under data.empty_answers: skip."""
    notes = list(row.get(NOTE_KEY) or [])
    notes += [f"{NOT_READ}: {k}" for k in row if k not in READ_ROW_KEYS and k not in REFUSED_ROW_KEYS
              and not k.startswith("_")]
    messages = row.get("messages")
    if empty_answers == "skip" and isinstance(messages, list) and any(_empty_answer(m) for m in messages):
        notes.append("assistant turns with no content left untrained (data.empty_answers: skip)")
    return notes


def _empty_answer(m: Any) -> bool:
    """An assistant turn with nothing to train but its end token: no content, tool call or reasoning."""
    if not isinstance(m, dict) or m.get("role") != "assistant" or m.get("tool_calls") or m.get("reasoning_content"):
        return False
    content = m.get("content")
    if isinstance(content, list):
        return not any(not isinstance(p, dict) or p.get("type") != "text" or (p.get("text") or "").strip()
                       for p in content)
    return content is None or (isinstance(content, str) and not content.strip())


def empty_answers(messages: Any, where: str, policy: str) -> Any:
    """data.empty_answers on the row's messages: 'error' refuses an assistant turn with no content (it would train
    a bare end-of-turn token); 'skip' keeps it in the context untrained (PROMPT_TURN)."""
    if not isinstance(messages, list) or not any(_empty_answer(m) for m in messages):
        return messages
    i = next(i for i, m in enumerate(messages) if _empty_answer(m))
    if policy != "skip":
        raise ToolkitError(f"{where}: messages[{i}] is an assistant turn with no content, which would train a bare "
                           "end-of-turn token; fill or remove the turn, or set data.empty_answers: skip to keep such "
                           "turns untrained (counted in the stage's log).")
    return [dict(m, content=m.get("content") or "", **{PROMPT_TURN: True}) if _empty_answer(m) else m
            for m in messages]


NUMERIC_FLAGS = ("weight", "loss_weight", "loss_scale")
"""TURN_FLAGS whose values are numbers (0 or 1 here); the others are true / false."""


def _flag(m: dict[str, Any], key: str, i: int, where: str) -> bool | None:
    value = m[key]
    if value is None:  # ms-swift writes "loss": null for its default
        return None
    if key not in NUMERIC_FLAGS:
        if not isinstance(value, bool):
            raise ToolkitError(f"{where}: messages[{i}].{key} is {value!r}; it must be true or false.")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value not in (0, 1):
        raise ToolkitError(f"{where}: messages[{i}].{key} is {value!r}; only 0 (do not train this turn) or 1 "
                           "(train it) is supported, not loss weighting.")
    return bool(value)


def assistant_trains(messages: list[dict[str, Any]], where: str, train_on: str) -> list[bool]:
    """Whether each assistant message (in order) trains, from its flags (TURN_FLAGS; default: it trains).

    What cannot be honoured exactly is refused: a flag other than 0/1 or false/true (loss weighting), a flag asking
    a user/system/tool turn to train under train_on: assistant, a turn left out under train_on: all (every token
    trains), two flags disagreeing, and axolotl's character-level `train_detail`. An assistant turn of a
    conversational prompt (PROMPT_TURN) does not train under train_on: assistant."""
    trains = []
    for i, m in enumerate(messages):
        if "train_detail" in m:
            raise ToolkitError(f"{where}: messages[{i}].train_detail (per-span training) is not supported; set "
                               "\"weight\": 0 or 1 on the whole turn, or split the turn.")
        flags = {key: flag for key in TURN_FLAGS if key in m and (flag := _flag(m, key, i, where)) is not None}
        if len(set(flags.values())) > 1:
            said = " and ".join(f"{key} {m[key]!r}" for key in flags)
            raise ToolkitError(f"{where}: messages[{i}] has {said}, which disagree; keep one of them.")
        train = next(iter(flags.values())) if flags else None
        key = next(iter(flags), "weight")
        if m["role"] == "assistant":
            if train is False and train_on == "all":
                raise ToolkitError(f"{where}: messages[{i}].{key} leaves the turn out of training, but data.train_on "
                                   "is all, which trains every token; set data.train_on: assistant.")
            trains.append(train is not False and not (m.get(PROMPT_TURN) and train_on == "assistant"))
        elif train is True and train_on == "assistant":
            raise ToolkitError(f"{where}: messages[{i}].{key} asks a {m['role']} turn to train, but only assistant "
                               "turns train with data.train_on: assistant; drop the flag or set data.train_on: all.")
        elif train is False and train_on == "all":
            raise ToolkitError(f"{where}: messages[{i}].{key} leaves a {m['role']} turn out of training, but "
                               "data.train_on is all, which trains every token; set data.train_on: assistant.")
    return trains


def _joined_text(parts: list[Any], where: str) -> str:
    """A text model's content given as parts: the text parts joined (as a vision-language template joins them);
    an image or other part is refused, as the model reads text only."""
    texts = []
    for p in parts:
        if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
            kind = f"a '{p.get('type')}' part" if isinstance(p, dict) else "a part that is not an object"
            family = (" (a vision-language model reads it: Qwen2.5-VL, Qwen3-VL, builtin:tiny-qwen2.5-vl)"
                      if isinstance(p, dict) and p.get("type") == "image" else "")
            raise ToolkitError(f"{where}.content has {kind}; this model reads text only{family}, so content must be "
                               "a string or a list of {\"type\": \"text\", \"text\": str} parts.")
        texts.append(p["text"])
    return "".join(texts)


def _check_parts(parts: list[Any], where: str) -> None:
    """A vision-language content list: text parts with a string `text`, and image parts."""
    if not all(isinstance(p, dict) and "type" in p for p in parts):
        raise ToolkitError(f"{where}.content must be a string or a list of {IMAGE_PARTS}.")
    for p in parts:
        if p["type"] == "text" and not isinstance(p.get("text"), str):
            raise ToolkitError(f"{where} has a text part without a string 'text'.")
        if p["type"] not in ("image", "video", "text"):
            raise ToolkitError(f"{where} has a '{p['type']}' part; only text, image and video parts are supported.")


def check_turn_order(messages: list[dict[str, Any]], where: str, train_on: str) -> None:
    """With train_on: assistant, a conversation with assistant turns and a user turn opens with a user turn (after
    an optional system prompt) and ends with an assistant turn. A row of a system prompt and answers alone (OpenAI's
    fine-tuning format accepts it) trains its answers."""
    if train_on != "assistant" or not any(m["role"] == "assistant" for m in messages):
        return
    first = next(m["role"] for m in messages if m["role"] != "system")
    if first != "user" and any(m["role"] == "user" for m in messages):  # system + answer alone (OpenAI) trains
        raise ToolkitError(f"{where}: the conversation starts with a{'n' if first == 'assistant' else ''} {first} "
                           "turn; after an optional system prompt it must start with a user turn.")
    if messages[-1]["role"] != "assistant":
        raise ToolkitError(f"{where}: the conversation ends with a {messages[-1]['role']} turn; it must end with "
                           "the assistant turn being trained (drop the trailing turn).")


_GENERATION: dict[int, tuple[str, bool]] = {}


def has_generation_tags(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template marks assistant turns with {% generation %} (remembered per template text)."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return False
    known = _GENERATION.get(id(template))
    if known is None or known[0] is not template:
        known = _GENERATION[id(template)] = (
            template, "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}"))
    return known[1]


_RENDERS: dict[str, Callable[[str], bool]] = {
    "tools": lambda t: "tools" in t,
    "reasoning_content": lambda t: "reasoning_content" in t,
    "tool_calls": lambda t: "tool_calls" in t,
    "tool": lambda t: re.search(r"""==\s*['"]tool['"]""", t) is not None,
}
"""Whether a chat template renders each field (a template that never mentions it drops it)."""


def _fix(key: str, field: str, override: str | None) -> str:
    """What to do about a field the template in use cannot render: name the stock templates that render it, and
    the recipe's override when there is one (`override`: data.chat_template; None: the model's own template)."""
    names = ", ".join(n for n in TEMPLATE_NAMES if n in STOCK_FILES and n != "qwen2.5-instruct"
                      and _RENDERS[key](stock_template(n)))
    if override is None:
        return (f"The model's own template is in use: set data.chat_template to one that renders {field} (for a "
                f"Qwen model: {names}), or remove them from the data.")
    shown = "Jinja text" if is_jinja_text(override) else override
    return (f"The template in use is data.chat_template ({shown}): use one that renders {field} (for a Qwen model: "
            f"{names}), remove data.chat_template to use the model's own, or remove them from the data.")


def check_renderable(template: str, messages: list[dict[str, Any]], tools: Any, where: str, *,
                     override: str | None = None) -> None:
    """Refuse what the chat template would silently drop: `tools`, `reasoning_content`, `tool_calls` or tool turns
    that it never mentions (data.chat_template: chatml renders none of them). `override`: the recipe's
    data.chat_template (None: the model's own template is in use), for the message's advice."""
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ToolkitError(f"{where}: 'tools' must be a list of JSON objects (function schemas).")
        if not _RENDERS["tools"](template):
            raise ToolkitError(f"{where}: the row has 'tools' but the chat template does not render tools, so the "
                               f"model would call functions whose schema it never saw. "
                               f"{_fix('tools', 'tools', override)}")
    needs = [("reasoning_content", any("reasoning_content" in m for m in messages)),
             ("tool_calls", any(m.get("tool_calls") for m in messages))]
    for key, present in needs:
        if present and not _RENDERS[key](template):
            raise ToolkitError(f"{where}: the row has '{key}' but the chat template does not render it, so it would "
                               f"be dropped from training. {_fix(key, repr(key), override)}")
    if any(m["role"] == "tool" for m in messages) and not _RENDERS["tool"](template):
        raise ToolkitError(f"{where}: the row has a tool turn but the chat template has no format for tool results "
                           f"(it would render them as a turn of role 'tool'). {_fix('tool', 'tool turns', override)}")


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
        before = render_chat(tokenizer, messages[:i], tools, where, add_generation_prompt=True)[0] if i else ""
        upto = render_chat(tokenizer, messages[: i + 1], tools, where)[0]
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ToolkitError(
                f"{where}: the chat template is not prefix-stable for this conversation and has neither ChatML turns "
                "nor {% generation %} markers, so assistant turns cannot be located. Set data.chat_template: chatml "
                "or give a Jinja template with {% generation %} blocks.")
        spans.append((len(before), len(upto.rstrip())))  # the newline after a turn is not trained
    return spans


PAIR_IN_SFT = ("preference pairs train in a preference stage: set the stage's objective: dpo (or orpo / simpo); "
               "this stage's objective is sft, which trains rows and would learn the rejected answer")
"""Why a preference pair is refused in a stage that trains rows (docs/preference.md)."""

SHAPES = {"messages": ("messages",), "prompt and completion": ("prompt", "completion"), "text": ("text",)}
"""The row shapes, by the keys that make them; a row has exactly one."""

REFUSED_ROW_KEYS = {
    **dict.fromkeys(("weight", "loss_weight", "sample_weight"), "per-row loss weighting is not supported (a "
                    "message's \"weight\": 0 or 1 leaves a turn out); remove it, or repeat rows to weight them"),
    **dict.fromkeys(("chosen", "rejected"), PAIR_IN_SFT),
    "completions": "TRL's stepwise-supervision rows (a prompt, completions and labels per step) train process "
                   "reward models, which is not supported; give chats or prompt/completion rows",
    **dict.fromkeys(("input_ids", "labels", "attention_mask", "loss_mask"), "pre-tokenised rows are not supported: "
                    "give the text and let data.train_on decide the loss"),
    "train_on": "data.train_on sets it for every row; remove it, or split the file into stages",
    "system": "put the system prompt as the first message, {\"role\": \"system\", \"content\": ...}",
    "audios": "audio rows are not supported",
}
"""Row keys that would change what trains but that no row shape reads: refused, never dropped."""


KTO_LABEL = "_desirable"
"""Where a kto stage's row carries its `label` once read (toolkit/data/sources.py `kto_row`), to the store."""


def kto_label(row: dict[str, Any], where: str) -> bool:
    """A kto stage's row's desirable (true) / undesirable (false) mark, TRL's `label`; one line when it is missing or
    not a boolean."""
    if "label" not in row or row["label"] is None:
        raise ToolkitError(f"{where}: a kto stage's row needs 'label': true (a desirable completion) or false (an "
                           f"undesirable one), TRL's unpaired preference shape; the row has keys {sorted(row)}.")
    if not isinstance(row["label"], bool):
        raise ToolkitError(f"{where}: 'label' is {row['label']!r}, but a kto stage's label must be true or false "
                           "(JSON booleans: desirable or undesirable); write true / false.")
    return row["label"]


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
                           "supported in a stage of rows: they train supervised, so an undesirable answer would be "
                           "learned; train it in a stage with objective: kto (docs/preference.md), or keep only rows "
                           "to learn, without the label.")
    shapes = [name for name, keys in SHAPES.items() if any(_present(row, k) for k in keys)]
    if len(shapes) > 1:
        keys = [k for name in shapes for k in SHAPES[name] if _present(row, k)]
        raise ToolkitError(f"{where}: the row has {', '.join(repr(k) for k in keys)}, which are {len(shapes)} row "
                           "shapes; keep one ('messages', 'prompt' and 'completion', or 'text'): the others would "
                           "not be trained.")
    shape = shapes[0] if shapes else None
    if shape is None or not all(_present(row, k) for k in SHAPES[shape]):
        chats = [k for k, v in row.items() if isinstance(v, list) and v and all(isinstance(t, dict) for t in v)]
        hint = f"; if '{chats[0]}' holds the chat, map it: columns: {{messages: {chats[0]}}}" if chats else ""
        raise ToolkitError(f"{where}: a row needs 'messages', 'prompt' and 'completion', or 'text'; "
                           f"found keys {sorted(row)}{hint}.")
    for key, needs in (("tools", "a chat ('messages')"),
                       *((media, "a chat ('messages') for a vision-language model" if vision else
                          "a vision-language model (this model reads text only)") for media in ("images", "videos"))):
        if _present(row, key) and (shape != "messages" or (key in ("images", "videos") and not vision)):
            raise ToolkitError(f"{where}: the row has '{key}', which needs {needs}; it would not be trained.")
    return shape


def span_mask(starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]], *, overlap: bool) -> np.ndarray:
    """Which tokens (character offsets `starts`/`ends`) train, for sorted, disjoint character spans.

    ChatML and prefix spans (`overlap` False): a token trains when it starts inside a span. `{% generation %}` spans
    (`overlap` True): when it overlaps one, transformers' `return_assistant_tokens_mask` rule."""
    if not spans:
        return np.zeros(len(starts), dtype=np.uint8)
    lo = np.fromiter((a for a, _ in spans), np.int64, len(spans))
    hi = np.fromiter((b for _, b in spans), np.int64, len(spans))
    k = np.searchsorted(hi, starts, side="right")  # the first span that ends after the token starts
    inside = k < len(spans)
    first = lo[np.minimum(k, len(spans) - 1)]
    return (inside & (first < ends if overlap else first <= starts)).astype(np.uint8)


@dataclass
class EncodedBatch:
    """Rows encoded together: every row's token ids and loss mask concatenated, and one entry per row. VL rows also
    carry their image paths, image grids and how many leading tokens may not be cut (up to the last image)."""

    ids: np.ndarray  # int32
    mask: np.ndarray  # uint8: 1 where the token carries loss (its label is the token), 0 where it does not
    lengths: np.ndarray  # int64, one per row
    rows: np.ndarray  # int64: each row's number in its source (the line, for JSONL)
    difficulty: list[Any] = field(default_factory=list)  # the rows' `difficulty` values (None where absent)
    uncuttable: np.ndarray | None = None
    images: list[list[str]] | None = None
    grids: list[list[list[int]]] | None = None
    capped: dict[int, int] = field(default_factory=dict)  # rows cut by the size guard: row -> its characters
    desirable: list[bool | None] | None = None  # a kto stage's rows: each row's true/false `label` (None: unread)

    @classmethod
    def join(cls, parts: Sequence[EncodedBatch]) -> EncodedBatch:
        vision = any(p.images is not None for p in parts)

        def cat(name: str, dtype: Any) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts]) if parts else np.zeros(0, dtype)

        return cls(cat("ids", np.int32), cat("mask", np.uint8), cat("lengths", np.int64), cat("rows", np.int64),
                   [d for p in parts for d in p.difficulty],
                   cat("uncuttable", np.int64) if vision else None,
                   [i for p in parts for i in p.images or []] if vision else None,
                   [g for p in parts for g in p.grids or []] if vision else None,
                   {int(start) + r: c for start, p in zip(np.cumsum([0, *(len(p.lengths) for p in parts)])[:-1],
                                                          parts, strict=True) for r, c in p.capped.items()},
                   [d for p in parts for d in (p.desirable if p.desirable is not None else [None] * len(p.lengths))]
                   if any(p.desirable is not None for p in parts) else None)

    def sample(self, i: int) -> dict[str, Any]:
        """Row i as a sample: `input_ids` and `labels` lists (and its images and grids)."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        ids = self.ids[offsets[i]:offsets[i + 1]]
        labels = np.where(self.mask[offsets[i]:offsets[i + 1]] != 0, ids, IGNORE_INDEX)
        out: dict[str, Any] = {"input_ids": ids.tolist(), "labels": labels.tolist()}
        if self.images is not None and self.images[i]:
            out["images"], out["image_grid_thw"] = self.images[i], self.grids[i]  # type: ignore[index]
        return out


RowAddress = Callable[[int], str]
"""A source's way of naming a row in an error: row number -> 'file:line' (JSONL) or 'file row N'."""


class TextEncoder:
    """Text rows to token ids and loss masks with a tokenizer and its chat template (see the module docstring).

    Plain settings only (train_on, thinking, the recipe's data.chat_template that refusals name), so it pickles
    with the tokenizer for worker processes. With `pairs` (a preference stage's) the rows it is given are the two
    sides of each pair (`toolkit.data.pairs.pair_rows`, read so by `toolkit.data.sources.read_piece`), encoded as
    any row; the mode is in `options`, so a pair store is another store."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, train_on: str, thinking: str = "auto",
                 chat_template: str | None = None, empty_answers: str = "error", pairs: bool = False,
                 completion_newline: bool = False, renderer: str = "auto", kto: bool = False) -> None:
        self.tokenizer, self.train_on, self.thinking = tokenizer, train_on, thinking
        self.renderer = renderer  # data.renderer: 'auto' (direct where the template is a stock one) or 'jinja'
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            chosen_renderer(tokenizer.chat_template, renderer)  # said once, in the process that builds the encoder
        self.pairs = pairs  # a preference stage's: each source row is a pair, stored as its chosen and rejected rows
        # data.completion_newline (pairs only): a trained turn also trains the newline its template writes after it
        self.completion_newline = completion_newline and (pairs or kto)
        self.kto = kto  # a kto stage's: each source row carries a true/false `label`, stored beside its tokens
        self.empty_answers = empty_answers
        self.chat_template = chat_template  # the override the tokenizer carries (None: the model's own template)
        self.fingerprint: str | None = None  # the tokenizer's, once a store key needed it
        self.twin: BpeTwin | None = None  # tiktoken's twin of the tokenizer, once a large preparation asked for it

    def prepare_for(self, rows: int) -> None:
        """Before encoding `rows` rows (in this process or in workers forked from it): build the tokenizer's
        tiktoken twin (toolkit/data/bpe.py) where the preparation is large enough to repay it. Its ids are the
        tokenizer's; `data.renderer: jinja` keeps the fast tokenizer alone, as before."""
        if self.renderer != "jinja" and rows >= TWIN_MIN_ROWS and self.tokenizer is not None:
            self.twin = BpeTwin.of(self.tokenizer, key=self.fingerprint)  # the store key's, where one was taken

    def options(self) -> dict[str, Any]:
        """What besides the tokenizer and the row decides the encoding (part of the store's key)."""
        return {"kind": "text", "train_on": self.train_on, "thinking": self.thinking,
                **({"empty_answers": self.empty_answers} if self.empty_answers != "error" else {}),
                **({"pairs": True} if self.pairs else {}),
                **({"kto": True} if self.kto else {}),
                **({"completion_newline": True} if self.completion_newline else {}),
                **({"renderer": "jinja"} if self.renderer == "jinja" else {})}  # forced: its own store

    def encode(self, rows: Sequence[dict[str, Any]], numbers: Sequence[int], address: RowAddress,
               base_dir: Path | None = None, *, max_tokens: int | None = None) -> EncodedBatch:
        """Encode `rows` (numbered `numbers` in their source); the first bad row raises, named by `address`.
        (`base_dir`, where a vision encoder finds images, is not used by text rows.) With `max_tokens`, a row far
        longer than that is stored cut (`SizeGuard`)."""
        global ENCODE_CALLS
        ENCODE_CALLS += len(rows)
        tok = self.tokenizer
        plans: list[tuple[str, Any]] = []
        chats: list[str] = []
        specials: list[str] = []  # prompts and texts: tokenised with the tokenizer's special tokens (BOS)
        plain: list[str] = []  # completions
        for row, number in zip(rows, numbers, strict=True):
            where = address(number)
            shape = row_shape(row, where)
            if shape == "messages":
                text, spans, overlap = self._render(row, where)
                plans.append(("chat", (len(chats), spans, overlap)))
                chats.append(text)
            elif shape == "prompt and completion":
                if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
                    raise ToolkitError(f"{where}: 'prompt' and 'completion' must be strings.")
                plans.append(("completion", (len(specials), len(plain))))
                specials.append(row["prompt"])
                plain.append(row["completion"])
            else:
                if not isinstance(row["text"], str):
                    raise ToolkitError(f"{where}: 'text' must be a string.")
                plans.append(("text", len(specials)))
                specials.append(row["text"])
        guard = SizeGuard(self, max_tokens)
        encoded, long_chats = guard.encode_with_offsets(chats, lazy=self.renderer != "jinja", twin=self.twin)
        with_specials, long_specials = guard.token_ids(specials, add_special_tokens=True)
        without, long_plain = guard.token_ids(plain, add_special_tokens=False)
        eos = tok.eos_token_id
        ids_parts, mask_parts = [], []
        capped: dict[int, int] = {}
        for r, (kind, plan) in enumerate(plans):
            if kind == "chat":
                k, spans, overlap = plan
                cut = k in long_chats
                item = encoded[k]
                if isinstance(item, Tokens | TwinTokens):
                    ids = item.ids
                    mask = (np.ones(len(ids), np.uint8) if self.train_on == "all"
                            else item.mask(spans, overlap=overlap))
                else:
                    ids, starts, ends = item
                    mask = (np.ones(len(ids), np.uint8) if self.train_on == "all"
                            else span_mask(starts, ends, spans, overlap=overlap))
            elif kind == "completion":
                prompt, completion = with_specials[plan[0]], without[plan[1]]
                cut = plan[0] in long_specials or plan[1] in long_plain
                ids = np.array([*prompt, *completion, *([] if cut else [eos])], dtype=np.int32)
                mask = np.ones(len(ids), np.uint8)
                if self.train_on != "all":
                    mask[:len(prompt)] = 0
            else:
                cut = plan in long_specials
                ids = np.array([*with_specials[plan], *([] if cut else [eos])], dtype=np.int32)
                mask = np.ones(len(ids), np.uint8)
            if cut:  # a prefix that is over any max_seq_len of the run; its first tokens are the row's own
                assert max_tokens is not None
                ids, mask = ids[:max_tokens + 1], mask[:max_tokens + 1]
                capped[r] = guard.characters(rows[r])
            if len(mask):
                mask[0] = 0  # nothing predicts the first token
            ids_parts.append(ids)
            mask_parts.append(mask)
        return EncodedBatch(
            np.concatenate(ids_parts).astype(np.int32) if ids_parts else np.zeros(0, np.int32),
            np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8),
            np.array([len(i) for i in ids_parts], dtype=np.int64), np.array(numbers, dtype=np.int64),
            [row.get("difficulty") for row in rows], capped=capped,
            desirable=[row.get(KTO_LABEL) for row in rows] if self.kto else None)

    def _render(self, row: dict[str, Any], where: str) -> tuple[str, list[tuple[int, int]], bool]:
        """(rendering, character spans of the turns that train, whether spans are {% generation %} blocks)."""
        tok = self.tokenizer
        if not tok.chat_template:
            raise ToolkitError(
                f"{where}: the row is a chat ('messages') but the tokenizer has no chat template. Use a chat "
                "model's tokenizer or set data.chat_template (for example: chatml).")
        train_on, thinking = self.train_on, self.thinking
        given = empty_answers(row["messages"], where, self.empty_answers)
        messages, trains = checked_messages(given, where, train_on)
        tools = row.get("tools")
        template = tok.chat_template
        check_renderable(template, messages, tools, where, override=self.chat_template)
        generation = has_generation_tags(tok)
        if thinking != "auto" and (generation or not is_chatml_family(template)):
            raise ToolkitError(f"{where}: data.thinking: {thinking} applies to ChatML-family templates without "
                               "{% generation %} markers (the stock Qwen templates); this template decides what "
                               "trains itself. Use data.thinking: auto.")
        if generation:
            full, blocks = render_chat(tok, messages, tools, where, generation=True)
            if not all(trains) and len(blocks) != len(trains):
                raise ToolkitError(f"{where}: the chat template's {{% generation %}} blocks mark {len(blocks)} "
                                   f"span(s) for {len(trains)} assistant turn(s), so per-turn weights cannot be "
                                   "applied exactly; drop the weights or use the model's own template.")
            spans = [b for b, t in zip(blocks, trains, strict=False) if t] if not all(trains) else blocks
            return full, self._with_newline(full, spans), True
        direct = chosen_renderer(template, self.renderer) if isinstance(template, str) else None
        if direct is not None:  # a stock template: rendered in Python, its assistant spans known as written
            try:
                full, spans = direct(messages, tools)
                full, spans = _apply_thinking(full, spans, thinking, tok, where)
                return full, self._with_newline(full, _trained(spans, trains)), False
            except Unrendered:  # a row the direct renderer does not mirror: the template renders it
                pass
        full, _ = render_chat(tok, messages, tools, where)
        if is_chatml_family(template):
            spans = chatml_assistant_spans(full, len(trains), where)
            full, spans = _apply_thinking(full, spans, thinking, tok, where)
        else:
            spans = _prefix_spans(tok, messages, tools, full, where)
        return full, self._with_newline(full, [span for span, train in zip(spans, trains, strict=True) if train]), False

    def _with_newline(self, text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """With data.completion_newline, each trained turn through the newline the template writes after its end
        token, as TRL's conversational completions are cut (the rendering of prompt + completion less that of the
        prompt with its generation header: `<|im_end|>` and the newline)."""
        if not self.completion_newline:
            return spans
        return [(start, end + 1) if text.startswith("\n", end) else (start, end) for start, end in spans]


def _trained(spans: list[tuple[int, int]], trains: list[bool]) -> list[tuple[int, int]]:
    """The spans of the assistant turns that train."""
    return [span for span, train in zip(spans, trains, strict=True) if train]


_SAID: set[str] = set()
_CHOSEN: dict[tuple[int, str], tuple[str, Renderer | None, str]] = {}


def chosen_renderer(template: str, choice: str) -> Renderer | None:
    """The direct renderer for a chat template (None: Jinja renders it), `choice` being data.renderer; which one is
    logged once per process and template."""
    key = (id(template), choice)
    cached = _CHOSEN.get(key)
    if cached is None or cached[0] is not template:  # an id is reused once its string is gone
        _CHOSEN[key] = cached = (template, *direct_renderer(template, choice))
    if cached[2] not in _SAID:
        _SAID.add(cached[2])
        log.info(cached[2])
    return cached[1]


GUARD_MIN_CHARS = 1 << 20
"""Texts of up to this many characters are always tokenised whole (tens of MB at most): the size guard is for rows
far over max_seq_len, and an ordinary over-length row keeps its exact token count (and error message)."""


class SizeGuard:
    """Keeps one enormous row from exhausting the machine: a text far longer than `max_tokens` is measured in
    characters before it is tokenised, and only a prefix of it is.

    A token covers at most L characters, L the longest token's text in the vocabulary (byte-level BPE: a vocabulary
    string has one character per byte, an upper bound on the characters it decodes to), so a text of C characters
    has at least C / L tokens: over (max_tokens + 1) * L characters (and GUARD_MIN_CHARS) it is over every
    max_seq_len of the run. Such a text is tokenised as a prefix that yields over twice max_tokens + 1 tokens
    (grown by doubling, so a tokenizer whose tokens cover more than L characters only costs another call), and the
    row keeps its first max_tokens + 1 tokens: what truncation keeps is the row's own first tokens (a cut only
    changes the tokens near itself, and the kept ones are followed by as many again before it), and drop and error
    see the row as over-length. Tokenising costs a few times the characters of the prefix that yields
    2 (max_tokens + 1) tokens (the doubling starts at 4 (max_tokens + 1) characters), whatever the row's size;
    counting characters is len(str), O(1).

    What it does not bound: the row's text itself, parsed and rendered by the chat template (a few times the row's
    size, tens of times for a row of many short messages). That is bounded before parsing, in bytes: a JSON Lines
    row over ROW_BYTES_PER_CHAR bytes per character of this limit is stored unread, dropped or refused
    (toolkit/data/sources.py row_byte_cap), and so is a row of a .json file over the cap's floor (read element by
    element); a CSV / TSV line over the floor is refused; a table's row over the cap in Arrow bytes is unread."""

    def __init__(self, encoder: Any, max_tokens: int | None) -> None:
        self.encoder, self.max_tokens = encoder, max_tokens
        self.tokenizer = encoder.tokenizer

    @property
    def limit(self) -> int | None:
        """Characters above which a text is surely over max_tokens + 1 tokens, and is long enough that tokenising
        it whole costs memory (None: no guard)."""
        if self.max_tokens is None:
            return None
        longest = getattr(self.encoder, "longest_token", None)
        if longest is None:  # once per encoder and process (0.2 s for a 150k vocabulary)
            longest = self.encoder.longest_token = max(
                1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))
        return max((self.max_tokens + 1) * longest, GUARD_MIN_CHARS)

    def _long(self, texts: list[str]) -> list[int]:
        if self.max_tokens is None or not any(len(t) > GUARD_MIN_CHARS for t in texts):
            return []  # cheap exit: no text is long enough to guard
        limit = self.limit
        assert limit is not None
        return [k for k, t in enumerate(texts) if len(t) > limit]

    def _prefix(self, text: str, tokenise: Callable[[str], Any], count: Callable[[Any], int]) -> Any:
        """`tokenise` of the shortest doubling prefix of `text` that yields over 2 (max_tokens + 1) tokens."""
        assert self.max_tokens is not None and self.limit is not None
        # From a prefix of two characters per token wanted, not from the guard's floor: what is tokenised follows
        # max_tokens (a 1.5M-character side of 50k short messages, max_seq_len 128, was tokenised whole: +0.2 GB).
        size = min(2 * self.limit, 4 * (self.max_tokens + 1))
        while size < len(text):
            out = tokenise(text[:size])
            if count(out) > 2 * (self.max_tokens + 1):
                return out
            size *= 2
        return tokenise(text)

    def encode_with_offsets(self, texts: list[str], *, lazy: bool = False, twin: BpeTwin | None = None
                            ) -> tuple[list[Any], set[int]]:
        """`encode_with_offsets` of the texts, the long ones (returned by index) as a prefix (as arrays)."""
        long = self._long(texts)
        if not long:
            return encode_with_offsets(self.tokenizer, texts, lazy=lazy, twin=twin), set()
        out = encode_with_offsets(self.tokenizer, ["" if k in long else t for k, t in enumerate(texts)], lazy=lazy,
                                  twin=twin)
        for k in long:
            out[k] = self._prefix(texts[k], lambda t: encode_with_offsets(self.tokenizer, [t])[0],
                                  lambda e: len(e[0]))
        return out, set(long)

    def token_ids(self, texts: list[str], *, add_special_tokens: bool) -> tuple[list[list[int]], set[int]]:
        """The tokenizer's ids of the texts, the long ones (returned by index) as a prefix."""
        if not texts:
            return [], set()
        long = self._long(texts)
        tok = self.tokenizer
        out = tok(["" if k in long else t for k, t in enumerate(texts)] if long else texts,
                  add_special_tokens=add_special_tokens)["input_ids"]
        for k in long:
            out[k] = self._prefix(texts[k], lambda t: tok(t, add_special_tokens=add_special_tokens)["input_ids"],
                                  len)
        return out, set(long)

    @staticmethod
    def characters(row: dict[str, Any]) -> int:
        """The characters of a row's texts (how a cut row is described)."""
        if isinstance(row.get("messages"), list):
            total = 0
            for m in row["messages"]:
                content = m.get("content") if isinstance(m, dict) else None
                parts = content if isinstance(content, list) else [content]
                total += sum(len(p) if isinstance(p, str) else len(p.get("text") or "") if isinstance(p, dict)
                             else 0 for p in parts)
                total += len(m.get("reasoning_content") or "") if isinstance(m, dict) else 0
            return total
        return sum(len(row[k]) for k in ("text", "prompt", "completion") if isinstance(row.get(k), str))


class Tokens:
    """One text's tokens from the fast tokenizer (`encode_with_offsets(lazy=True)`): its ids, and the loss mask of
    character spans read off the tokenizer's Encoding at the spans' ends only.

    Turning every token's offsets into Python tuples and arrays costs about a quarter of tokenising; the mask only
    needs, for each span [lo, hi), the first token starting at or after lo and at or after hi (token starts never
    decrease: the text is split on added tokens, then pre-tokenised, then merged, in order). The rule is
    `span_mask`'s without overlap: a token trains when it starts inside a span. `data.renderer: jinja` keeps the
    offset arrays (`span_mask`), and tests/data/test_render.py proves both give the same masks."""

    __slots__ = ("enc", "ids")

    def __init__(self, enc: Any) -> None:
        self.enc = enc
        self.ids = np.array(enc.ids, dtype=np.int32)

    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.array(self.enc.offsets, dtype=np.int64).reshape(-1, 2)
        return offsets[:, 0], offsets[:, 1]

    def _first_from(self, x: int) -> int | None:
        """The first token that starts at or after character x (None where x is in no token)."""
        n, start = len(self.ids), self.enc.token_to_chars
        if x >= start(n - 1)[1]:  # past the last token's end: every token starts before x
            return n
        c = self.enc.char_to_token(x)
        if c is None:
            return None
        if start(c)[0] >= x:
            while c > 0 and start(c - 1)[0] >= x:
                c -= 1
        else:
            while c < n and start(c)[0] < x:
                c += 1
        return c

    def mask(self, spans: list[tuple[int, int]], *, overlap: bool) -> np.ndarray:
        mask = np.zeros(len(self.ids), dtype=np.uint8)
        if overlap or not len(self.ids):
            return span_mask(*self.offsets(), spans, overlap=overlap) if len(self.ids) else mask
        for lo, hi in spans:
            a, b = self._first_from(lo), self._first_from(hi)
            if a is None or b is None:  # a character in no token: read every offset
                return span_mask(*self.offsets(), spans, overlap=False)
            mask[a:b] = 1
        return mask


class TwinTokens:
    """One text's tokens from the tokenizer's tiktoken twin (toolkit/data/bpe.py): the same ids, and the same
    masks as `Tokens`, from each token's first character (`starts`; ASCII: a byte is a character)."""

    __slots__ = ("ends", "ids", "starts")

    def __init__(self, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.ids, self.starts, self.ends = ids, starts, ends

    def mask(self, spans: list[tuple[int, int]], *, overlap: bool) -> np.ndarray:
        if overlap:
            return span_mask(self.starts, self.ends, spans, overlap=True)
        mask = np.zeros(len(self.ids), dtype=np.uint8)
        for lo, hi in spans:  # the tokens that start inside the span: `span_mask`'s rule without overlap
            mask[np.searchsorted(self.starts, lo):np.searchsorted(self.starts, hi)] = 1
        return mask


def twin_tokens(twin: BpeTwin, texts: list[str]) -> list[TwinTokens | None]:
    """The twin's tokens of each text it takes (None for the others), their offsets worked out for all texts at
    once from the tokens' byte lengths (one lookup and one cumulative sum, not one per text)."""
    ids = [twin.encode(text) for text in texts]
    taken = [x for x in ids if x is not None]
    if not taken:
        return [None] * len(texts)
    flat = np.concatenate(taken)
    sizes = twin.lengths[flat]
    ends = np.cumsum(sizes)
    counts = np.fromiter((len(x) for x in taken), np.int64, len(taken))
    bounds = np.concatenate([[0], np.cumsum(counts)])
    base = np.concatenate([[0], ends])[bounds[:-1]]  # the characters before each text, in the running sum
    out: list[TwinTokens | None] = []
    k = 0
    for x in ids:
        if x is None:
            out.append(None)
            continue
        a, b = bounds[k], bounds[k + 1]
        stop = ends[a:b] - base[k]
        out.append(TwinTokens(x, stop - sizes[a:b], stop))
        k += 1
    return out


def encode_with_offsets(tokenizer: PreTrainedTokenizerBase, texts: list[str], *, lazy: bool = False,
                        twin: BpeTwin | None = None) -> list[Any]:
    """(ids, start offsets, end offsets) of each text, tokenised without special tokens in one batch: the fast
    tokenizer's own batch call (Rust, parallel when allowed) where there is one, else transformers' call. With
    `lazy`, a fast tokenizer's texts come as `Tokens` (offsets read where a mask needs them), and with a `twin`
    too, those it takes come as `TwinTokens` (the same ids, several times faster)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        if lazy and twin is not None:
            mixed: list[Any] = twin_tokens(twin, texts)
            rest = [k for k, t in enumerate(mixed) if t is None]  # tokenised by the fast tokenizer, in one batch
            if rest:
                for k, enc in zip(rest, backend.encode_batch([texts[k] for k in rest], add_special_tokens=False),
                                  strict=True):
                    mixed[k] = Tokens(enc)
            return mixed
        if lazy:
            return [Tokens(enc) for enc in backend.encode_batch(texts, add_special_tokens=False)]
        out = []
        for enc in backend.encode_batch(texts, add_special_tokens=False):
            offsets = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)
            out.append((np.array(enc.ids, dtype=np.int32), offsets[:, 0], offsets[:, 1]))
        return out
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [(np.array(ids, dtype=np.int32), np.array(off, dtype=np.int64).reshape(-1, 2)[:, 0],
             np.array(off, dtype=np.int64).reshape(-1, 2)[:, 1])
            for ids, off in zip(enc["input_ids"], enc["offset_mapping"], strict=True)]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any, where: str, *,
                generation: bool = False, add_generation_prompt: bool = False, template: str | None = None
                ) -> tuple[str, list[tuple[int, int]]]:
    """The chat rendered by the tokenizer's template, and the character spans of its {% generation %} blocks.

    This is what `apply_chat_template` does before it tokenises (transformers' own `render_jinja_template`, after
    dropping None-valued message keys as it does), called directly because only it reports the generation spans
    and it skips the per-call setup that dominates rendering one row. `template` replaces the tokenizer's (a
    processor's template)."""
    try:
        template = template or tokenizer.get_chat_template(None, tools)
        normal = [{k: v for k, v in m.items() if v is not None} for m in messages]
        rendered, blocks = render_jinja_template(
            conversations=[normal], tools=tools, chat_template=template, return_assistant_tokens_mask=generation,
            add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens_map)
    except Exception as e:  # a template's raise_exception, or Jinja errors on a shape it does not handle
        raise ToolkitError(f"{where}: the chat template could not render this row ({type(e).__name__}: {e}).") from None
    return rendered[0], [tuple(b) for b in blocks[0]] if generation else []  # type: ignore[misc]


def encode_row(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, train_on: str,
               where: str, thinking: str = "auto") -> tuple[list[int], list[int]]:
    """Token ids and labels (IGNORE_INDEX where no loss) of one row: `TextEncoder` on a batch of one. The first
    token never carries loss; a chat row's `tools` go to the template; `thinking` is data.thinking."""
    batch = TextEncoder(tokenizer, train_on=train_on, thinking=thinking).encode([row], [0], lambda _: where)
    sample = batch.sample(0)
    return sample["input_ids"], sample["labels"]


def fit_to_length(ids: list[int], labels: list[int], *, max_seq_len: int, overlength: str, where: str,
                  stats: DataStats | None, uncuttable: int = 0) -> dict[str, Any] | None:
    """data.overlength for a row over `max_seq_len` tokens: "error" raises, "drop" returns None, "truncate" cuts ids
    and labels to max_seq_len. The first `uncuttable` tokens must stay whole (a vision-language row's image tokens):
    a cut inside them drops the row instead. `stats`, when given, counts dropped and truncated rows."""
    if len(ids) <= max_seq_len:
        return {"input_ids": ids, "labels": labels}
    if overlength == "error":
        raise ToolkitError(overlength_message(where, len(ids), max_seq_len))
    if overlength == "drop" or uncuttable > max_seq_len:
        if stats is not None:
            stats.dropped_overlength += 1
        return None
    if stats is not None:
        stats.truncated += 1
    return {"input_ids": ids[:max_seq_len], "labels": labels[:max_seq_len]}


def overlength_message(where: str, length: int, max_seq_len: int, characters: int | None = None) -> str:
    """The error of data.overlength: error; `characters` given for a row the size guard cut (its length is then a
    lower bound)."""
    count = f"{length} tokens" if characters is None else f"at least {length} tokens ({characters} characters)"
    return (f"{where}: {count}, over data.max_seq_len={max_seq_len}. Raise max_seq_len, or set "
            "data.overlength to drop or truncate.")
