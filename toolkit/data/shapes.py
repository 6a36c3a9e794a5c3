"""Shapes: every peer's row shape mapped to the toolkit's `messages` row, here and only here (`to_messages`; the
table of shapes is docs/data.md). Where rows come from (files, formats, the registry) is `toolkit/data/sources.py`.

ShareGPT and OpenAI turns (told apart by their keys, under either `conversations` or `messages`), Alpaca, ms-swift's
query/response, conversation pairs and agent roles, TRL's conversational prompt/completion, LLaMA-Factory v1 content
parts, `<image>` placeholders; training flags stay on the messages for the encoder. A row missing a field gets an
error naming the file, the row and the field; turns in another tool's key names get the exact `tags` that read them.
Table cells that hold structure as JSON text (CSV, LLaMA-Factory's and ms-swift's `tools`) are decoded.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.data.encoding import PROMPT_TURN
from toolkit.errors import ToolkitError

if TYPE_CHECKING:
    from toolkit.data.sources import Source

STRUCTURED = ("messages", "conversations", "conversation", "tools", "images", "history")
"""Fields that hold lists or objects; in a CSV/TSV cell (or LLaMA-Factory's `tools` string) they are JSON text."""
OPTIONAL_COLUMNS = ("input", "system", "history", "tools", "images", "videos", "audios")
"""Registry columns a row may lack (LLaMA-Factory reads them as empty)."""

CALL = "tool call"

ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
              "system": "system", "observation": "tool", "tool": "tool", "function": "tool",
              "function_response": "tool", "tool_response": "tool", "function_call": CALL, "tool_call": CALL}
"""Role names of the peers' turns -> the toolkit's roles (ShareGPT / LLaMA-Factory, OpenAI, ms-swift's agent roles
`tool_call` / `tool_response`); CALL is a turn whose content is a JSON tool call."""
TAG_ROLES = {"user_tag": "user", "assistant_tag": "assistant", "system_tag": "system", "observation_tag": "tool",
             "function_tag": CALL}
"""Tags that name a role (LLaMA-Factory's `tags`)."""
ROLE_KEY_HINTS = ("speaker", "author", "sender", "who", "role_name", "type", "name")
CONTENT_KEY_HINTS = ("text", "message", "utterance", "body", "msg", "content_text")
"""Key names that suggest a turn's role or content, for the hint of a turn with unknown keys."""
TURN_KEYS = {"conversations": ("from", "value"), "messages": ("role", "content")}
"""The keys of a turn, by the field that holds the turns (unless the turns or the entry's tags say otherwise)."""


def to_messages(row: dict[str, Any], source: Source, where: str) -> dict[str, Any]:
    """The row with the entry's column mapping applied, JSON text decoded where structure is expected, and every
    peer's chat shape turned into a `messages` row (the one place shapes are mapped): ShareGPT `conversations` and
    OpenAI `messages` (either turn keys, the entry's `tags`, ms-swift's agent roles, content parts, `<image>`
    placeholders), Alpaca, ms-swift's `query`/`response` and `conversation` rows, TRL's conversational `prompt` /
    `completion`. A text row (`text`, string `prompt` / `completion`) stays as it is."""
    entry = source.entry
    if entry.columns:
        row = dict(row)
        taken = {}
        for ours, theirs in entry.columns:
            if theirs not in row:
                if entry.dataset is not None and ours in OPTIONAL_COLUMNS:
                    continue  # LLaMA-Factory reads an optional column a row lacks as empty
                raise ToolkitError(f"{where}: no field '{theirs}' (columns.{ours} of data entry {source.name}); the "
                                   f"row has {sorted(row)}.")
            taken[ours] = row.pop(theirs)
        row.update(taken)
    if source.fmt in ("csv", "tsv") or isinstance(row.get("tools"), str):
        row = {k: _json_cell(v, k, where) if k in STRUCTURED and isinstance(v, str) else v for k, v in row.items()}
    tags = dict(entry.tags)
    if row.get("image") is not None:  # TRL's one-image column
        if row.get("images") is not None or not isinstance(row["image"], str):
            raise ToolkitError(f"{where}: the row has 'image' (TRL's one-image column) "
                               f"{'beside images' if row.get('images') is not None else 'that is not a path'}; give "
                               "the image paths as a list in 'images', one {\"type\": \"image\"} part each.")
        row = {**{k: v for k, v in row.items() if k != "image"}, "images": [row["image"]]}
    if row.get("conversations") is not None:
        row = _from_turns(row, "conversations", where, tags, system=True)
    elif row.get("messages") is not None:
        row = _from_turns(row, "messages", where, tags, system="system" in dict(entry.columns))
    elif row.get("instruction") is not None:
        row = _from_alpaca(row, where)
    elif isinstance(row.get("prompt"), list) or isinstance(row.get("completion"), list):
        row = _from_conversational(row, where, tags)
    elif any(row.get(k) is not None for k in ("prompt", "completion", "text")):
        pass  # a text row: ms-swift's keys beside it are extras, as any other key
    elif row.get("query") is not None or row.get("response") is not None:
        row = _from_query_response(row, where)
    elif row.get("conversation") is not None:
        row = _from_pairs(row, where)
    if entry.dataset is not None and isinstance(row.get("images"), list):  # LLaMA-Factory: paths from dataset_dir
        base = Path(entry.dataset_dir or "data").absolute()
        row["images"] = [str(base / p) if isinstance(p, str) else p for p in row["images"]]
    return row


def _json_cell(value: str, key: str, where: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{where}: field '{key}' is text that is not valid JSON ({e.msg}); it must hold a JSON "
                           "list or object.") from None


def _turn_keys(turns: list[Any], name: str, where: str, tags: dict[str, str]) -> tuple[str, str]:
    """The (role, content) keys of a list of turns: the entry's tags, else the keys the turns use (from/value or
    role/content, whichever field holds them). Turns with neither are another tool's shape: the error names the
    keys it saw and the tags that map them."""
    if "role_tag" in tags or "content_tag" in tags:
        return tags.get("role_tag", TURN_KEYS[name][0]), tags.get("content_tag", TURN_KEYS[name][1])
    dicts = [t for t in turns if isinstance(t, dict)]
    for keys in (TURN_KEYS[name], *(k for n, k in TURN_KEYS.items() if n != name)):
        if any(k in t for t in dicts for k in keys):
            return keys
    if not dicts:
        return TURN_KEYS[name]
    strings = {k for t in dicts for k, v in t.items() if isinstance(v, str)}
    if len(strings) < 2:
        raise ToolkitError(f"{where}: {name}[0] has keys {sorted(dicts[0])}, none a role and a content; each turn "
                           "needs role/content (or from/value) keys, or the entry's tags naming them.")

    def values(k: str) -> list[str]:
        return [t[k] for t in dicts if isinstance(t.get(k), str)]

    # A guess for the hint only: the role key is named like one, or repeats few values; the content the longest.
    role = min(strings, key=lambda k: (k not in ROLE_KEY_HINTS, len(set(values(k))), sum(map(len, values(k))), k))
    content = max(strings - {role}, key=lambda k: (k in CONTENT_KEY_HINTS, sum(map(len, values(k))), k))
    names = list(dict.fromkeys(t[role] for t in dicts if isinstance(t.get(role), str)))
    hint = [f"role_tag: {role}", f"content_tag: {content}"]
    hint += [f"{tag}: {n}" for tag, n in zip(("user_tag", "assistant_tag"), [n for n in names if n not in ROLE_NAMES],
                                             strict=False)]
    raise ToolkitError(f"{where}: the turns in '{name}' have keys {sorted({k for t in dicts for k in t})} (a chat "
                       "with its own key names, as axolotl's message_property_mappings maps); give the data entry "
                       f"tags: {{{', '.join(hint)}}}.")


def _from_turns(row: dict[str, Any], name: str, where: str, tags: dict[str, str], *, system: bool
                ) -> dict[str, Any]:
    """A row whose `name` field (conversations or messages) holds chat turns, as a `messages` row: the turns' keys
    read (`_turn_keys`), their role names mapped (ROLE_NAMES, the entry's tags), every other key of a turn kept
    (training flags are read by the encoder), content parts normalised (`_parts`), a tool-call turn's JSON content
    made the `tool_calls` of an assistant turn (consecutive calls one turn), and `<image>` placeholders made image
    parts. With `system`, a row `system` string becomes the first message. In `messages`, a turn that is no turn of
    a known role is kept as it is, for the encoder's own error."""
    other = "messages" if name == "conversations" else "conversations"
    if row.get(other) is not None:
        raise ToolkitError(f"{where}: the row has both 'messages' and 'conversations'; keep one.")
    turns = row[name]
    strict = name == "conversations"  # a messages row's odd turns are left to the encoder's checks
    if not isinstance(turns, list) or not turns:
        if strict:
            raise ToolkitError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} turns.")
        return row
    role_key, content_key = _turn_keys(turns, name, where, tags)
    roles = {**ROLE_NAMES, **{tags[t]: role for t, role in TAG_ROLES.items() if t in tags}}
    drop = (name, "system") if system else (name,)
    out = {k: v for k, v in row.items() if k not in drop}
    messages: list[Any] = []
    if system and row.get("system") is not None:
        if not isinstance(row["system"], str):
            raise ToolkitError(f"{where}: 'system' must be a string.")
        messages.append({"role": "system", "content": row["system"]})
    joined = -1  # the index of the assistant turn that tool calls join
    for i, turn in enumerate(turns):
        at = f"{name}[{i}]"
        if not isinstance(turn, dict):
            if strict:
                raise ToolkitError(f"{where}: {at} must be an object with '{role_key}' and '{content_key}'.")
            messages.append(turn)
            continue
        speaker = turn.get(role_key)
        role = roles.get(speaker) if isinstance(speaker, str) else None
        if strict:
            for key in (role_key, content_key):
                if turn.get(key) is None:
                    raise ToolkitError(f"{where}: {at} has no '{key}'.")
            if role is None:
                raise ToolkitError(f"{where}: {at}.{role_key} is {speaker!r}; known speakers are {sorted(roles)} "
                                   "(map other names with the entry's tags: user_tag, assistant_tag, ...).")
        elif role is None:
            messages.append(turn)
            continue
        message = {k: v for k, v in turn.items() if k not in (role_key, content_key) and v is not None}
        content = turn.get(content_key)
        if role == CALL:
            calls = _tool_calls(content, at, where)
            if joined == len(messages) - 1 >= 0:
                last = messages[-1]
                for key, value in message.items():  # one assistant turn: their flags must agree
                    if key in last and last[key] != value:
                        raise ToolkitError(f"{where}: {at}.{key} differs from the tool call before it, which it "
                                           "joins as one assistant turn; give them the same flags.")
                last.update(message)
                last["tool_calls"] = [*last["tool_calls"], *calls]
                continue
            message.update(role="assistant", content="", tool_calls=calls)
            joined = len(messages)
        else:
            message["role"] = role
            message["content"] = _parts(content, at, where, message) if isinstance(content, list) else content
        messages.append(message)
    out["messages"] = _placeholders(messages, out)
    return out


PART_FLAGS = ("train", "training", "weight", "loss_weight", "loss", "loss_scale")
"""Training flags a content part may carry (axolotl's per-part `train`): honoured when a turn's parts agree."""


def _parts(parts: list[Any], at: str, where: str, message: dict[str, Any]) -> list[Any]:
    """A content list with LLaMA-Factory v1's `value` text parts read as `text`, and per-part training flags made
    the turn's flag: exactly when every part of the turn says the same, else refused."""
    out, flags = [], set()
    for part in parts:
        if not isinstance(part, dict):
            out.append(part)
            continue
        part = dict(part)
        if part.get("type") == "text" and "text" not in part and "value" in part:
            part["text"] = part.pop("value")
        flags.add(tuple(sorted((k, part.pop(k)) for k in PART_FLAGS if k in part)))
        out.append(part)
    if flags - {()}:
        if len(flags) > 1:
            said = "; ".join(", ".join(f"{k}: {v!r}" for k, v in f) or "none" for f in sorted(flags))
            raise ToolkitError(f"{where}: {at} has parts with different training flags ({said}); a turn trains "
                               "whole or not at all: split the turn, or give every part the same flag.")
        for key, value in flags.pop():
            if key in message and message[key] != value:
                raise ToolkitError(f"{where}: {at}.{key} is {message[key]!r} but its parts say {value!r}; keep one.")
            message[key] = value
    return out


IMAGE_TAG = "<image>"
"""LLaMA-Factory's and ms-swift's placeholder for an image of the row's `images`, in the text."""


def _placeholders(messages: list[Any], row: dict[str, Any]) -> list[Any]:
    """`<image>` placeholders in text as image parts, in order, when the row has `images` and its messages no
    image part of their own. (`videos` rows are refused by the encoder.)"""
    images = row.get("images")
    if not isinstance(images, list) or not images:
        return messages
    dicts = [m for m in messages if isinstance(m, dict)]
    if any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") == "image"
                                                      for p in m["content"]) for m in dicts):
        return messages
    for m in dicts:
        if isinstance(m.get("content"), str) and IMAGE_TAG in m["content"]:
            parts: list[dict[str, Any]] = []
            for k, text in enumerate(m["content"].split(IMAGE_TAG)):
                if k:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
            m["content"] = parts
    return messages


def _tool_calls(value: Any, at: str, where: str) -> list[dict[str, Any]]:
    """A tool-call turn's content (JSON text of {name, arguments}, or a list of them) as `tool_calls`."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{where}: {at} is a tool call whose content is not JSON ({e.msg}); it must be "
                           "{\"name\": ..., \"arguments\": {...}}.") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise ToolkitError(f"{where}: {at} is a tool call whose content is not {{\"name\": ..., \"arguments\": "
                           "{...}} (or a list of them).")
    for c in calls:  # arguments given as JSON text (ms-swift writes them so) reach the template as an object
        if isinstance(c.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):
                c["arguments"] = json.loads(c["arguments"])
    return [{"type": "function", "function": c} for c in calls]


def _from_alpaca(row: dict[str, Any], where: str) -> dict[str, Any]:
    """Alpaca: `instruction` (+ `input`, joined with a newline) -> `output`, optional `system` and `history`
    ([[instruction, output], ...] of earlier turns, which train like the last one)."""
    for key in ("messages", "conversations", "prompt", "text"):
        if row.get(key) is not None:
            raise ToolkitError(f"{where}: the row has both 'instruction' and '{key}'; keep one row shape.")
    if row.get("output") is None:
        raise ToolkitError(f"{where}: the row has 'instruction' but no 'output' (Alpaca rows need both).")
    out = _from_exchange(row, where, ("instruction", "input", "output"), "instruction", "output")
    if row.get("input"):
        out["messages"][-2]["content"] += f"\n{row['input']}"
    return out


def _from_query_response(row: dict[str, Any], where: str) -> dict[str, Any]:
    """ms-swift's `query` -> `response` rows, optional `system` and `history` ([[query, response], ...])."""
    for key in ("query", "response"):
        if row.get(key) is None:
            raise ToolkitError(f"{where}: the row has '{'response' if key == 'query' else 'query'}' but no '{key}' "
                               "(ms-swift's query/response rows need both).")
    return _from_exchange(row, where, ("query", "response"), "query", "response")


def _from_exchange(row: dict[str, Any], where: str, keys: tuple[str, ...], asked: str, answered: str
                   ) -> dict[str, Any]:
    """One exchange (row[asked] -> row[answered]) after an optional `system` and `history` of [asked, answered]
    pairs (which train like the last answer)."""
    for key in (*keys, "system"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise ToolkitError(f"{where}: '{key}' must be a string.")
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") is not None else []
    history = row.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
        raise ToolkitError(f"{where}: 'history' must be a list of [{asked}, {answered}] pairs.")
    for query, answer in history:
        messages += [{"role": "user", "content": query}, {"role": "assistant", "content": answer}]
    messages += [{"role": "user", "content": row[asked]}, {"role": "assistant", "content": row[answered]}]
    out = {k: v for k, v in row.items() if k not in (*keys, "system", "history")}
    out["messages"] = messages
    return out


def _from_pairs(row: dict[str, Any], where: str) -> dict[str, Any]:
    """ms-swift's `conversation`: [{"human": ..., "assistant": ...}, ...] exchanges, optional `system`."""
    pairs = row["conversation"]
    if not isinstance(pairs, list) or not pairs or not all(
            isinstance(p, dict) and isinstance(p.get("human"), str) and isinstance(p.get("assistant"), str)
            for p in pairs):
        raise ToolkitError(f"{where}: 'conversation' must be a non-empty list of {{\"human\": str, \"assistant\": "
                           "str}} exchanges (ms-swift's shape).")
    if row.get("system") is not None and not isinstance(row["system"], str):
        raise ToolkitError(f"{where}: 'system' must be a string.")
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") is not None else []
    for p in pairs:
        messages += [{"role": "user", "content": p["human"]}, {"role": "assistant", "content": p["assistant"]}]
    out = {k: v for k, v in row.items() if k not in ("conversation", "system")}
    out["messages"] = messages
    return out


def _from_conversational(row: dict[str, Any], where: str, tags: dict[str, str]) -> dict[str, Any]:
    """TRL's conversational prompt/completion: `prompt` and `completion` lists of messages, one chat in which only
    the completion trains (an assistant turn of the prompt is context: PROMPT_TURN)."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise ToolkitError(f"{where}: 'prompt' and 'completion' must both be strings, or both lists of messages "
                           "(TRL's conversational shape).")
    rest = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
    head = _from_turns({**rest, "messages": prompt}, "messages", where, tags, system=False)["messages"]
    tail = _from_turns({**rest, "messages": completion}, "messages", where, tags, system=False)["messages"]
    head = [dict(m, **{PROMPT_TURN: True}) if isinstance(m, dict) and m.get("role") == "assistant" else m
            for m in head]
    rest["messages"] = [*head, *tail]
    return rest
