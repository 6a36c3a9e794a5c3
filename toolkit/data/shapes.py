"""Shapes: every peer's row shape mapped to the toolkit's `messages` row, here and only here (`to_messages`; the
table of shapes is docs/data.md). Where rows come from (files, formats, the registry) is `toolkit/data/sources.py`.

ShareGPT and OpenAI turns (told apart by their keys, under either `conversations` or `messages`), Alpaca, ms-swift's
query/response and agent roles, TRL's conversational prompt/completion, LLaMA-Factory v1 content parts, image
placeholders of every tool; training flags stay on the messages for the encoder. Which shape reads a row is a row
of the role table (toolkit/data/roles.py SHAPES: role -> key), and the reader follows from the roles (`_read`: turns
as the chat, a prompt and an answer as one exchange, TRL's lists as a chat). A chat under any other key (turns,
exchanges, a message tree, a dialog in one string) is told by its values and read by the same reader of turns; a
row no shape reads is refused with the entry its column roles give (toolkit/data/roles.py). A row missing a field
gets an error naming the file, the row and the field; turns with role names no vocabulary knows get the exact `tags`
that read them.
Table cells that hold structure as JSON text (CSV, LLaMA-Factory's and ms-swift's `tools`) are decoded.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from toolkit.config.schema import DataEntry
from toolkit.data import roles as vocab
from toolkit.data.encoding import MESSAGE_KEYS, NOTE_KEY, PAIR_IN_SFT, PROMPT_TURN, READ_ROW_KEYS, REFUSED_ROW_KEYS
from toolkit.errors import ToolkitError

if TYPE_CHECKING:
    from toolkit.data.sources import Source


class ShapeError(ToolkitError):
    """A row that no shape reads as it is, with the data entry keys that train it (`fix`: `columns`, `tags`,
    `ignore`), written at the end of the line as YAML to paste (`entry_yaml`). `toolkit inspect-data FILE` applies
    the fix (`with_fix`) and reads the file again, as the user would."""

    def __init__(self, message: str, fix: dict[str, Any] | None = None, said: bool = False) -> None:
        self.fix = fix or {}
        super().__init__(message + (f" Give the data entry {entry_yaml(self.fix)}." if self.fix and not said else ""))

    def __reduce__(self) -> tuple[Any, ...]:  # whole across the preparing processes: the line as said, the fix
        return (ShapeError, (str(self), self.fix, True))


def entry_yaml(fix: dict[str, Any]) -> str:
    """`fix` as one line of flow-style YAML: `{columns: {input: context, output: response}, ignore: [category]}`."""
    return yaml.safe_dump(fix, default_flow_style=True, sort_keys=False, width=1 << 16).strip()


def with_fix(entry: DataEntry, fix: dict[str, Any]) -> DataEntry:
    """The entry with a refusal's fix applied: its columns and tags added to the entry's, its ignore keys joined."""
    columns = {**dict(entry.columns), **fix.get("columns", {})}
    tags = {**dict(entry.tags), **fix.get("tags", {})}
    return replace(entry, columns=tuple(sorted(columns.items())), tags=tuple(sorted(tags.items())),
                   ignore=tuple(sorted({*entry.ignore, *fix.get("ignore", [])})))

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
"""The turn keys of ShareGPT's and OpenAI's chats: turns that give no role and content by their values read by the
pair whose keys they hold (`_turn_keys`); a field of turns that are no objects is refused naming its shape's."""


def to_messages(row: dict[str, Any], source: Source, where: str, *, roles: dict[str, str] | None = None
                ) -> dict[str, Any]:
    """The row with the entry's column mapping applied, JSON text decoded where structure is expected, and every
    peer's chat shape turned into a `messages` row (the one place shapes are mapped): ShareGPT `conversations` and
    OpenAI `messages` (either turn keys, the entry's `tags`, ms-swift's agent roles, content parts, `<image>`
    placeholders), Alpaca, ms-swift's `query`/`response` and `conversation` rows, TRL's conversational `prompt` /
    `completion`. A text row (`text`, string `prompt` / `completion`) stays as it is. A preference pair is refused
    (a stage of rows would learn its rejected answer): a preference stage reads its rows through
    `toolkit.data.pairs.pair_rows`. `roles` are the file's column roles (`vocab.file_roles`, inferred once per
    file from its first rows, by the stored names): a row that contradicts them is refused, and refusals advise by
    them, not by this row alone."""
    row, original = prepare_row(row, source, where)
    pair = next((k for k in vocab.pair_side_keys() if row.get(k) is not None), None)
    if pair is not None:
        raise ToolkitError(f"{where}: the row has '{pair}': {PAIR_IN_SFT}.")
    return shape_row(row, source, where, original, roles=mapped_roles(roles, source))


def mapped_roles(roles: dict[str, str] | None, source: Source) -> dict[str, str] | None:
    """A file's column roles (by its stored names) under the names the entry maps them to, its ignored keys out."""
    if roles is None:
        return None
    theirs = {t: ours for ours, t in source.entry.columns}
    return {theirs.get(k, k): r for k, r in roles.items() if k not in source.entry.ignore}


PAIR_KEYS = vocab.pair_side_keys()
"""Keys that make a row a preference pair: the preference sides of the pair shapes (toolkit/data/roles.py
PAIR_SHAPES, read by toolkit/data/pairs.py)."""


def prepare_row(row: dict[str, Any], source: Source, where: str) -> tuple[dict[str, Any], list[str]]:
    """The row with the entry's `ignore` keys dropped, its `columns` mapped, JSON text cells decoded and media keys
    read (`_media`), and the row's keys as stored (for errors)."""
    entry = source.entry
    original = sorted(row)
    if entry.ignore:
        row = _drop_ignored(row, set(entry.ignore))
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
    if source.fmt in ("csv", "tsv") and isinstance(row.get("difficulty"), str):  # cells are read as text
        with contextlib.suppress(ValueError):
            row["difficulty"] = float(row["difficulty"])
    return _media(row, where), original


def shape_row(row: dict[str, Any], source: Source, where: str, original: list[str], *,
              tags: dict[str, str] | None = None, roles: dict[str, str] | None = None) -> dict[str, Any]:
    """A prepared row (`prepare_row`) as the toolkit's `messages` row, or a text row as it is (`to_messages`).
    `tags` replaces the entry's (a pair's sides are OpenAI messages already); `roles` are the file's column roles
    (`to_messages`)."""
    entry = source.entry
    tags = dict(entry.tags) if tags is None else tags
    mapped = dict(entry.columns)
    notes: list[str] = []
    if isinstance(row.get(FLAT_NOTE), str):
        notes.append(row[FLAT_NOTE])
        row = {k: v for k, v in row.items() if k != FLAT_NOTE}
    _check_flat_export(row, where)
    if roles is not None:
        check_file_roles(row, roles, where)
    shape = vocab.shape_of(row)
    if shape is not None:
        row = _read(row, shape, where, tags, mapped, original, notes, every=entry.threads == "all", roles=roles)
    if isinstance(row.get("messages"), list) and isinstance(row.get("reasoning"), str):
        row = _with_reasoning(row, where)
    row = _tools_in_system(row, notes)
    _check_placeholders(row, where)
    _check_unread(row, where, original, notes, roles)
    if entry.dataset is not None:  # LLaMA-Factory: media paths from dataset_dir
        base = Path(entry.dataset_dir or "data").absolute()
        if isinstance(row.get("images"), list):
            row["images"] = [str(base / p) if isinstance(p, str) else p for p in row["images"]]
        if isinstance(row.get("videos"), list):
            row["videos"] = [str(base / p) if isinstance(p, str) else
                             [str(base / f) if isinstance(f, str) else f for f in p] if isinstance(p, list) else p
                             for p in row["videos"]]
    if notes:
        row[NOTE_KEY] = notes
    return row


# --- keys that hold content -------------------------------------------------------------------------------------

NO_CONTENT_NAMES = ("id", "idx", "index", "uid", "uuid", "key", "source", "sources", "url", "urls", "link",
                    "category", "categories", "type", "task", "task_type", "lang", "language", "license", "score",
                    "scores", "rating", "quality", "split", "subset", "dataset", "origin", "model", "tag", "tags",
                    "label", "meta", "metadata", "hash", "timestamp", "date", "length", "turns", "num_turns")
"""Row and turn key names that hold no content, whatever their value (`holds_content`); also any name ending in
`_id`, `_ids`, `_idx`, `_url`, `_score`, `_count` or `_type`."""
NO_CONTENT_SUFFIXES = ("_id", "_ids", "_idx", "_url", "_score", "_count", "_type", "_source")
MEDIA_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".mp4", ".avi", ".mov",
                  ".mkv", ".webm", ".mp3", ".wav", ".flac", ".ogg", ".m4a")


def no_content_name(key: str) -> bool:
    """A key named as one that holds no content (NO_CONTENT_NAMES, NO_CONTENT_SUFFIXES)."""
    name = key.lower()
    return name in NO_CONTENT_NAMES or name.endswith(NO_CONTENT_SUFFIXES)


def holds_content(key: str, value: Any) -> bool:
    """Whether a key's value is content a model could learn from (the rule docs/data.md states): never for a name
    in NO_CONTENT_NAMES (ids, indexes, scores, categories, sources, urls, ...) or named metadata by the role
    vocabulary (toolkit/data/roles.py: moderation records, headers, ranks), numbers, booleans and nulls; for a
    string, when it has whitespace in it (words) or names a media file; for a list or object, when anything in it
    does, or it holds objects (tool definitions, turns)."""
    if no_content_name(key) or vocab.named_roles(key) == ["metadata"]:
        return False
    if isinstance(value, str):
        text = value.strip()
        return bool(re.search(r"\s", text)) or text.lower().endswith(MEDIA_SUFFIXES)
    if isinstance(value, dict):
        return bool(value) and (any(isinstance(v, dict | list) for v in value.values())
                                or any(holds_content(k, v) for k, v in value.items()))
    if isinstance(value, list):
        return any(isinstance(v, dict) or holds_content(key, v) for v in value)
    return False


def _drop_ignored(row: dict[str, Any], ignore: set[str]) -> dict[str, Any]:
    """The row without the entry's `ignore` keys, in the row and in the turns of its chat fields."""
    out = {}
    for k, v in row.items():
        if k in ignore:
            continue
        if isinstance(v, list):  # in the turns of a chat, whatever key holds it
            v = [{tk: tv for tk, tv in t.items() if tk not in ignore} if isinstance(t, dict) else t for t in v]
        out[k] = v
    return out


def _check_unread(row: dict[str, Any], where: str, original: list[str], notes: list[str] | None = None,
                  roles: dict[str, str] | None = None) -> None:
    """Refuse a key of the mapped row, or of its turns, that holds content and that nothing reads, with the entry
    that reads it by its role (toolkit/data/roles.py): reasoning to the template's thinking block, a system, a
    context, tools mapped; metadata (by name) `ignore:`d knowingly; a key of no known role named with an entry for
    each role it could have. A text that repeats a turn of the chat (NuminaMath's `problem` beside its `messages`)
    is trained once, from the chat, and said in the log. Keys without content stay, for the stage's log
    (`toolkit.data.encoding.row_notes`)."""
    unread = [k for k, v in row.items() if k not in READ_ROW_KEYS and k not in REFUSED_ROW_KEYS
              and not k.startswith("_") and holds_content(k, v)]
    half = row.get("text") is None and row.get("messages") is None and (row.get("prompt") is None
                                                                        or row.get("completion") is None)
    if not any(row.get(k) is not None for k in ("messages", "text", "prompt", "completion")) or (half and unread):
        # no shape; or a prompt without its completion (or a completion without its prompt) beside content
        # nothing reads, under a name no shape knows: the roles of its keys decide
        content = [k for k, v in row.items() if not k.startswith("_") and holds_content(k, v)]
        if content:
            _no_shape(row, where, original, content, roles)
    turns_text = {str(c).strip() for c in _texts(row)} if unread else set()  # read only when a key is unread
    repeated = [k for k in unread if isinstance(row[k], str) and row[k].strip() and
                any(row[k].strip() == t or (len(row[k].strip()) > 40 and row[k].strip() in t) for t in turns_text)]
    if repeated and notes is not None:
        notes.append(f"{_keys(repeated)} {'repeats' if len(repeated) == 1 else 'repeat'} a turn of the chat: "
                     "trained once, from the chat")
        unread = [k for k in unread if k not in repeated]
    if unread:
        roles = _by_file(vocab.infer_roles({k: row[k] for k in unread}, holds_content), roles)
        fix = _fix_of_unread(row, unread, roles)
        said = f"; {'; '.join(f'{k} is {_role_said(roles[k])}' for k in unread)}"
        if fix is None:
            ways = "; ".join(f"'{k}' as the {r}: {entry_yaml({'columns': {vocab.FIELDS[r]: k}})}" for k in unread
                             for r in ("context", "system", "reasoning") if vocab.FIELDS[r] not in row)
            raise ShapeError(f"{where}: the row's {_keys(unread)} {'holds' if len(unread) == 1 else 'hold'} content "
                             f"({_kind(row[unread[0]])}) that no shape reads (the row has keys {original}; "
                             f"{_shape_name(row)} reads {_read_keys(row)}){said}; candidates: "
                             f"{ways or 'none of the fields'}; or, if it is metadata, drop it knowingly with ignore.")
        raise ShapeError(f"{where}: the row's {_keys(unread)} {'holds' if len(unread) == 1 else 'hold'} content "
                         f"({_kind(row[unread[0]])}) that no shape reads (the row has keys {original}; "
                         f"{_shape_name(row)} reads {_read_keys(row)}){said}.", fix)
    messages = row.get("messages")
    turns = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    keys = sorted({k for m in turns for k, v in m.items()
                   if k not in MESSAGE_KEYS and k != "train_detail" and holds_content(k, v)})  # the encoder refuses it
    if keys:
        meta = [k for k in keys if vocab.named_roles(k) == ["metadata"]]
        if meta != keys:
            raise ToolkitError(f"{where}: the turns carry {_keys(keys)}, which {'holds' if len(keys) == 1 else 'hold'} "
                               "content that no shape reads (a turn is read as role, content, tool_calls, "
                               "reasoning_content, name, tool_call_id and its training flags); map it into the "
                               "turns' content or reasoning_content before training.")
        raise ShapeError(f"{where}: the turns carry {_keys(keys)}, metadata that holds text (a turn is read as role, "
                         "content, tool_calls, reasoning_content, name, tool_call_id and its training flags): drop "
                         "it knowingly.", {"ignore": keys})


def _by_file(mine: dict[str, str], file: dict[str, str] | None) -> dict[str, str]:
    """A row's roles with the file's in their place (`vocab.file_roles`), so a value that is empty or odd in this row
    does not change its column's role; a key the file's sample never held keeps this row's."""
    return mine if file is None else {k: file.get(k, r) for k, r in mine.items()}


def check_file_roles(row: dict[str, Any], roles: dict[str, str], where: str) -> None:
    """Refuse a row whose values contradict the file's column roles (`vocab.contradiction`: text where the file's
    rows hold a chat under another name, a chat where they hold text), in one line naming the file's row and key:
    read by this row alone it would be another shape than its file's."""
    wrong = vocab.contradiction({k: v for k, v in row.items() if not k.startswith("_")}, roles, holds_content)
    if wrong is None:
        return
    key, theirs, mine = wrong
    raise ToolkitError(f"{where}: '{key}' holds {_kind(row[key])}, {_role_said(mine)}, where the file's rows hold "
                       f"{_role_said(theirs)} (a file's column roles are inferred once, from its first "
                       f"{vocab.SAMPLE_ROWS} rows); make the row like the file's, or keep rows of another layout in "
                       "a file of their own.")


def _role_said(role: str) -> str:
    article = "an" if role[0] in "aeiou" else "a"
    return {"unknown": "of no role the vocabulary names", "metadata": "metadata", "tools": "tool definitions",
            "media": "media", "turns": "a chat"}.get(role, f"{article} {role}")


def _fix_of_unread(row: dict[str, Any], unread: list[str], roles: dict[str, str]) -> dict[str, Any] | None:
    """The entry that reads unread content keys by role: metadata ignored, a reasoning, system, context or tools
    key mapped to its field (when the row's field is free); None when any key has another role, or none."""
    columns, ignore = {}, []
    for key in unread:
        role = roles[key]
        field = vocab.FIELDS.get(role)
        if role == "metadata":
            ignore.append(key)
        elif role in ("reasoning", "system", "context", "tools") and field not in row and field not in columns:
            if role == "context" and row.get("instruction") is None:
                return None  # Alpaca's input follows an instruction; a chat has no place for it
            columns[field] = key
        else:
            return None
    return {**({"columns": columns} if columns else {}), **({"ignore": ignore} if ignore else {})}


def _no_shape(row: dict[str, Any], where: str, original: list[str], content: list[str],
              file: dict[str, str] | None = None) -> None:
    """Refuse a row that no shape reads, naming its keys, their roles (toolkit/data/roles.py: the vocabulary of real
    datasets' column names) and the entry that trains it: prompt, answer, system, context, reasoning and tools
    mapped to their fields, metadata holding text ignored knowingly. A row whose roles leave a key unknown, or its
    prompt or answer missing, is refused naming the candidates and the entry for each. A single text with no
    other content (Glaive's dialog in one string) can train as plain text, every token (`columns: {text: KEY}`)."""
    close = closest_shapes(original)
    near = f"; closest shapes: {'; '.join(close)}" if close else ""
    roles = _by_file(vocab.infer_roles({k: row[k] for k in row if not k.startswith("_")}, holds_content), file)
    meta = [k for k in content if roles.get(k) == "metadata"]
    content = [k for k in roles if k in content or roles[k] != "metadata"]
    said = ", ".join(f"'{k}' {_role_said(roles[k])}" for k in content)
    head = f"{where}: a row needs 'messages', 'prompt' and 'completion', or 'text'; found keys {original} ({said})"
    entry, unknown = vocab.entry_for({k: r for k, r in roles.items() if k in content})
    if entry is not None:
        fix = {**entry, **({"ignore": meta} if meta else {})}
        raise ShapeError(f"{head}{near}; their roles read as one exchange.", fix)
    ways = vocab.candidates({k: r for k, r in roles.items() if k in content})
    if ways:
        choices = "; ".join(f"{what}: {entry_yaml({**e, **({'ignore': meta} if meta else {})})}" for what, e in ways)
        if len(ways) == 1:
            raise ShapeError(f"{head}{near}; candidates: {choices}.", {**ways[0][1], **({"ignore": meta} if meta
                                                                                           else {})}, said=True)
        raise ShapeError(f"{head}{near}; which key holds what is ambiguous, candidates: {choices}.")
    texts = [k for k in content if isinstance(row[k], str) and roles.get(k) != "metadata"]
    if len(texts) == 1 and roles.get(texts[0]) == "prompt":
        raise ShapeError(f"{head}{near}; '{texts[0]}' is a prompt with no answer beside it: give the answer "
                         "(a response, output or answer column), or train it as a prompt/completion row.")
    if len(texts) == 1 and roles.get(texts[0]) == "answer":  # ms-swift's pretraining rows: `{"response": ...}`
        raise ShapeError(f"{head}{near}; '{texts[0]}' is an answer with no prompt beside it: a text to train as it "
                         "is, every token (pretraining).", {"columns": {"text": texts[0]},
                                                             **({"ignore": meta} if meta else {})})
    if len(texts) == 1 and not unknown:
        raise ShapeError(f"{head}{near}. '{texts[0]}' is text ({_kind(row[texts[0]])}) with no prompt or answer "
                         "beside it: a dialog written into one string is not split into turns, so convert it to "
                         "messages to train the answers only, or train it as plain text (every token).",
                         {"columns": {"text": texts[0]}, **({"ignore": meta} if meta else {})})
    raise ShapeError(f"{head}, none a chat, a text or a prompt with its answer{near}.")


def _read(row: dict[str, Any], shape: tuple[str, dict[str, str], str], where: str, tags: dict[str, str],
          mapped: dict[str, str], original: list[str], notes: list[str], *, every: bool,
          roles: dict[str, str] | None = None) -> dict[str, Any]:
    """A row read by the roles of its shape (`vocab.shape_of`: a row of the role table, toolkit/data/roles.py
    SHAPES), one path for every shape: turns read as the chat (`_from_chat`, `_from_turns`: any key, any turn keys
    and role names); a prompt and an answer as one exchange (`_from_roles`); TRL's prompt/completion as a chat when
    they are lists (only the completion trains), else a text row, as it is."""
    _, keys, reader = shape
    if "*" in keys:
        found = keys["*"].split(",")
        raise ShapeError(f"{where}: the row holds chats under {_keys(found)}; train one: "
                         + "; ".join(f"columns: {{messages: {k}}}" for k in found) + ".")
    if reader == "chat" and keys["turns"] not in ("messages", "conversations"):  # a key only its values tell
        return _from_chat(row, keys["turns"], where, tags, notes, every=every)
    if reader == "chat":
        out = _from_turns(row, keys["turns"], where, tags, system="system" in keys or "system" in mapped)
        return _prompt_of_messages(out, where, notes) if "prompt" in keys else out
    if reader == "exchange":
        return _exchange_or_text(row, keys, where, mapped, original, notes, roles)
    if reader == "lists or text" and any(isinstance(row.get(keys[r]), list) for r in ("prompt", "answer")
                                         if r in keys):
        return _from_conversational(row, where, tags)
    return row  # a text row: `text`, or TRL's standard prompt/completion


def _from_chat(row: dict[str, Any], key: str, where: str, tags: dict[str, str], notes: list[str],
               every: bool = False) -> dict[str, Any]:
    """The chat under `key`, read by the one reader of turns (`_from_turns`): a list of turns with any keys and role
    names (toolkit/data/roles.py), a list of exchanges ({human, assistant}, Capybara's {input, output}), or a
    message tree (OASST's export), read along its main thread: at each turn the reply ranked best (`rank` 0), else
    the first; with `every` (the entry's `threads: all`), every thread that ends with an answer, one row each
    (`THREADS`, made rows by `threads`). The log says which."""
    value = row[key]
    rest = {k: v for k, v in row.items() if k != key}
    if vocab.is_tree(value) and every:
        paths = _tree_threads(value)
        if not paths:
            raise ToolkitError(f"{where}: the message tree under '{key}' has no thread that ends with an answer.")
        notes.append(f"'{key}' is a message tree: every thread trained, one row each (threads: all)")
        rows = [_from_turns({**rest, key: p}, key, where, tags, system=True) for p in paths]
        return {**rows[0], THREADS: [r["messages"] for r in rows]}
    if vocab.is_tree(value):
        thread, node = [], value
        while isinstance(node, dict):
            thread.append({k: v for k, v in node.items() if k not in vocab.TREE_KEYS and k != "labels"})
            replies = [r for r in next((node[k] for k in vocab.TREE_KEYS if isinstance(node.get(k), list)), [])
                       if isinstance(r, dict)]
            ranked = sorted(replies, key=lambda r: r.get("rank") if isinstance(r.get("rank"), int | float) else 1e9)
            node = ranked[0] if ranked else None
        while thread and vocab.speaker(thread[-1].get(vocab.turn_keys(thread[-1])[0])) != "assistant":  # type: ignore
            thread.pop()  # a thread ends with the answer it trains (a question left unanswered is not trained)
        if not thread:
            raise ToolkitError(f"{where}: the message tree under '{key}' has no answer to train (no assistant "
                               "message on its main thread).")
        notes.append(f"'{key}' is a message tree: its main thread trained (the best-ranked reply at each turn, "
                     f"{len(thread)} turns); other threads are not (the entry's threads: all trains them)")
        turns = thread
    elif isinstance(value, str):
        turns = vocab.split_dialog(value) or []
        notes.append(f"'{key}' is a dialog written into one string: split into turns at its speakers' markers")
        if isinstance(rest.get("system"), str):  # Glaive's system prompt carries its own `SYSTEM:` marker
            rest["system"] = re.sub(r"^\s*SYSTEM\s*:\s*", "", rest["system"])
    elif all(vocab.exchange_keys(t) is not None for t in value):
        turns = []
        for t in value:
            asked, answered = vocab.exchange_keys(t)  # type: ignore[misc]
            turns += [{"role": "user", "content": t[asked]}, {"role": "assistant", "content": t[answered]}]
        notes.append(f"'{key}' holds question/answer exchanges: read as the chat")
    else:
        turns = value
        notes.append(f"'{key}' holds the chat (its values are turns): read as messages")
    return _from_turns({**rest, key: turns}, key, where, tags, system=True)


THREADS = "_threads"
"""A row's other threads (a message tree under `threads: all`): `threads` makes each its own row."""


def threads(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows a shaped row stands for: itself, or one per thread of its message tree (`threads: all`)."""
    if THREADS not in row:
        return [row]
    base = {k: v for k, v in row.items() if k != THREADS}
    return [{**base, "messages": messages} for messages in row[THREADS]]


def _tree_threads(node: dict[str, Any], before: tuple[dict[str, Any], ...] = ()) -> list[list[dict[str, Any]]]:
    """Every root-to-node path of a message tree that ends with an assistant turn, deepest first along each branch
    (a path ending at an answer that is followed by more turns is its own thread only where no deeper one is)."""
    turn = {k: v for k, v in node.items() if k not in vocab.TREE_KEYS and k != "labels"}
    path = (*before, turn)
    replies = [r for r in next((node[k] for k in vocab.TREE_KEYS if isinstance(node.get(k), list)), [])
               if isinstance(r, dict)]
    deeper = [p for r in replies for p in _tree_threads(r, path)]
    keys = vocab.turn_keys(turn)
    answer = keys is not None and vocab.speaker(turn.get(keys[0])) == "assistant"
    return deeper or ([list(path)] if answer else [])


def _check_flat_export(row: dict[str, Any], where: str) -> None:
    """A row that is one message of a flat message export (`vocab.flat_message`) reaching the row reader is refused:
    read row by row, each message would train alone, the user's questions included. A file whose first row is such a
    message is read whole and rebuilt into trees (`message_trees`); this row is one in a file that starts otherwise."""
    keys = vocab.flat_message(row)
    if keys is None:
        return
    turn = vocab.turn_keys({k: v for k, v in row.items() if k not in keys})
    assert turn is not None  # flat_message found it
    raise ToolkitError(f"{where}: the row is one message of a flat message export ('{keys[1]}', '{turn[0]}': "
                       f"{row.get(turn[0])!r}, '{turn[1]}') in a file whose first row is not one: a flat export is "
                       "rebuilt into message trees only as a whole file of messages. Give the export's messages a "
                       "file of their own (or OASST's *.trees.jsonl: one tree per row).")


FLAT_NOTE = "_flat_export"
"""A tree row's note that it was rebuilt from a flat message export (`message_trees`), said in the log."""


def message_trees(rows: list[tuple[int, Any]], where: Callable[[int], str]) -> list[tuple[int, Any]]:
    """A flat message export's rows, (number, message), as message trees: one row per root message (its parent
    None), numbered by the root's row, `{message_tree_id, prompt: root}` with each message's replies nested under
    `replies` as OASST's *.trees.jsonl export gives them, so a tree trains as that export's (`_from_chat`: main
    thread, or every thread with `threads: all`). The whole file is grouped in memory (a flat export is read as one
    piece, each row within the row byte cap). A row that is no message, a repeated id, a reply whose parent is not
    in the file, or a message no root reaches (a cycle) is refused in one line: a tree rebuilt without it would
    drop it in silence. Rows over the byte cap (`Oversize`) pass as they are (refused or dropped by the size guard,
    their replies then orphans)."""
    first = next((r for _, r in rows if isinstance(r, dict)), None)
    keys = vocab.flat_message(first)
    assert keys is not None, "message_trees needs a file whose first row is a message"
    ident, parent = keys
    nodes: dict[str, dict[str, Any]] = {}
    out: list[tuple[int, Any]] = []
    for number, row in rows:
        if not isinstance(row, dict):
            out.append((number, row))  # an Oversize, or a non-object the row reader refuses
            continue
        if vocab.flat_message(row) != keys:
            raise ToolkitError(f"{where(number)}: the row is not a message of the flat export this file starts with "
                               f"('{ident}', '{parent}', a role and a text); its keys are {sorted(row)}. A flat "
                               "export is rebuilt into trees as a whole file: keep other rows in another file.")
        if row[ident] in nodes:
            raise ToolkitError(f"{where(number)}: '{ident}' {row[ident]!r} repeats an earlier message's; a flat "
                               "export's message ids are unique.")
        nodes[row[ident]] = {**row, "replies": []}
    orphans: list[tuple[int, str]] = []
    for number, row in rows:
        if not isinstance(row, dict):
            continue
        node, up = nodes[row[ident]], row[parent]
        if up is None:
            out.append((number, {"message_tree_id": row.get("message_tree_id", row[ident]), "prompt": node}))
        elif up in nodes:
            nodes[up]["replies"].append(node)
        else:
            orphans.append((number, up))
    if orphans:
        number, up = orphans[0]
        raise ToolkitError(f"{where(number)}: {len(orphans)} message(s) of the flat export reply to a message not in "
                           f"the file ('{parent}': {up!r}); trees are rebuilt file by file, so keep each tree whole "
                           "in one file (with its root), or leave out the replies whose parent is gone.")
    reached = 0
    for _, tree in out:
        if not isinstance(tree, dict):
            continue
        stack = [tree["prompt"]]
        while stack:
            node = stack.pop()
            reached += 1
            stack += node["replies"]
        tree[FLAT_NOTE] = f"the file is a flat message export: its messages rebuilt into trees by '{parent}'"
    if reached < len(nodes):
        raise ToolkitError(f"{where(rows[0][0])}: {len(nodes) - reached} message(s) of the flat export are reached "
                           f"from no root (their '{parent}' links form a cycle); each tree needs a root whose "
                           f"'{parent}' is null.")
    return sorted(out, key=lambda t: t[0])


def _keys(keys: list[str]) -> str:
    return ("key " if len(keys) == 1 else "keys ") + ", ".join(f"'{k}'" for k in keys)


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "a media file" if value.strip().lower().endswith(MEDIA_SUFFIXES) else f"text of {len(value)} characters"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return "an object"


def _shape_name(row: dict[str, Any]) -> str:
    if isinstance(row.get("messages"), list):
        return "the chat"
    return "the text row" if row.get("text") is not None else "the prompt/completion row"


def _read_keys(row: dict[str, Any]) -> str:
    return ", ".join(k for k in READ_ROW_KEYS if row.get(k) is not None) or "nothing"


SHAPE_KEYS = {
    "chat (OpenAI, TRL)": ("messages",),
    "ShareGPT (LLaMA-Factory, axolotl)": ("conversations",),
    "Alpaca": ("instruction", "input", "output"),
    "query/response (ms-swift)": ("query", "response"),
    "a chat under another key (lmsys, WildChat, ms-swift's exchanges)": ("conversation",),
    "prompt/completion (TRL)": ("prompt", "completion"),
    "text": ("text",),
}
"""The shapes read as they are (the rows of toolkit/data/roles.py SHAPES) by the keys that make them, in the order
ties rank, for the closest shapes of a row none fits."""


def closest_shapes(keys: list[str], n: int = 3) -> list[str]:
    """The shapes whose keys the row shares most (a shape sharing none is not named)."""
    score = {name: len(set(k) & set(keys)) / len(k) for name, k in SHAPE_KEYS.items()}
    ranked = sorted((name for name in score if score[name] > 0), key=lambda name: -score[name])
    return [f"{name}: {', '.join(SHAPE_KEYS[name])}" for name in ranked[:n]]


# --- media --------------------------------------------------------------------------------------------------------

VIDEO = ("'<video>' tags need one video each in the row's 'videos' (or 'video'), in order; without them '<video>' "
         "would train as text: add the videos, or remove the tags")
AUDIO = ("audio does not train: the models this toolkit trains read no audio (Qwen2-Audio and Qwen2.5-Omni do); "
         "keep audio rows out of this source")


def _media(row: dict[str, Any], where: str) -> dict[str, Any]:
    """Media keys, singular or plural, a string or a list: `image` (TRL's and Qwen-VL's finetune column) becomes
    `images`, `video` (Qwen-VL's finetune and LLaVA-Video's column) `videos`; audio keys are refused in one line
    (never trained as text). A LLaVA-Video row marks its one video with `<image>` (its own convention): a row
    with `video`, no images and `<image>` but no `<video>` tags has those tags read as `<video>`."""
    for key, why in (("audio", AUDIO), ("audios", AUDIO)):
        if row.get(key) not in (None, [], ""):
            raise ToolkitError(f"{where}: the row has '{key}': {why}.")
    video = row.get("video")
    if video not in (None, [], ""):
        if row.get("videos") not in (None, []):
            raise ToolkitError(f"{where}: the row has 'video' beside 'videos'; give the videos as a list in "
                               "'videos', one '<video>' tag or {\"type\": \"video\"} part each.")
        row = {**{k: v for k, v in row.items() if k != "video"}, "videos": [video]}
        if row.get("image") in (None, [], "") and row.get("images") in (None, []):
            row = _llava_video_tags(row)
    urls = [p for p in (row.get("images") if isinstance(row.get("images"), list) else [row.get("image")])
            if isinstance(p, str) and re.match(r"^(https?|data):", p)]
    if urls:
        raise ToolkitError(f"{where}: the row's images include {urls[0][:60]!r}, a URL; images are read from files, "
                           "never downloaded: save the images and give their paths.")
    image = row.get("image")
    if image is None:
        return row
    paths = [image] if isinstance(image, str) else image
    if row.get("images") is not None or not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        why = "beside images" if row.get("images") is not None else "that is not a path or a list of paths"
        raise ToolkitError(f"{where}: the row has 'image' (TRL's and Qwen-VL's image column) {why}; give the "
                           "image paths as a list in 'images', one {\"type\": \"image\"} part or '<image>' each.")
    return {**{k: v for k, v in row.items() if k != "image"}, "images": paths}


def _llava_video_tags(row: dict[str, Any]) -> dict[str, Any]:
    """LLaVA-Video's `<image>` tags read as `<video>` (see `_media`), in `conversations` / `messages` strings."""
    for key in ("conversations", "messages"):
        turns = row.get(key)
        if not isinstance(turns, list):
            continue
        texts = [v for t in turns if isinstance(t, dict) for v in t.values() if isinstance(v, str)]
        if any(VIDEO_TAG in t for t in texts) or not any(IMAGE_TAG in t for t in texts):
            return row
        row[key] = [{k: v.replace(IMAGE_TAG, VIDEO_TAG) if isinstance(v, str) else v for k, v in t.items()}
                    if isinstance(t, dict) else t for t in turns]
    return row


def _texts(row: dict[str, Any]) -> list[str]:
    texts = [row[k] for k in ("text", "prompt", "completion") if isinstance(row.get(k), str)]
    for m in row.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        texts += [p if isinstance(p, str) else p.get("text") for p in parts
                  if isinstance(p, str) or (isinstance(p, dict) and isinstance(p.get("text"), str))]
    return texts


def _check_placeholders(row: dict[str, Any], where: str) -> None:
    """A `<video>` placeholder left in the row's text (the row has no videos) or an `<audio>` one is refused (it
    would train as text); so are other tools' image placeholders in a row without images, and image markup that no
    shape reads."""
    texts = _texts(row)
    for tag, why in ((VIDEO_TAG, VIDEO), ("<audio>", AUDIO)):
        if any(tag in t for t in texts):
            raise ToolkitError(f"{where}: the text holds '{tag}': {why}.")
    if not row.get("images"):
        tags = sorted({t for text in texts for t in IMAGE_TAGS if t in text})
        if tags:
            raise ToolkitError(f"{where}: the text holds {', '.join(tags)}, an image placeholder, but the row has no "
                               "images; give the image paths in 'images' (or 'image'), one per placeholder, or "
                               "remove the placeholder (it would train as text).")
    markup = sorted({m for text in texts for m in UNREAD_TAGS.findall(text)})
    if markup:
        raise ToolkitError(f"{where}: the text holds {markup[0]!r}, image markup of another tool that is not read as "
                           "a placeholder; write '<image>' where each image goes and list the paths in 'images'.")


# --- rows that hold their dialog twice ----------------------------------------------------------------------------

TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.S)
"""The tool definitions a system turn writes in its own text (Hermes' and Qwen's `<tools>` ... `</tools>`)."""


def _tools_in_system(row: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """A `tools` column whose definitions the system turn already carries (hermes-function-calling's `tools`, a
    JSON copy of the `<tools>` block in its system prompt) is not given to the template, which would render them a
    second time; the log says so. The same definitions: the block's JSON (one list, or one object per line) equals
    the column's, whatever the spacing. Tools that differ from the block stay the template's."""
    tools, messages = row.get("tools"), row.get("messages")
    if not isinstance(tools, list) or not tools or not isinstance(messages, list):
        return row
    system = next((m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "system"), None)
    if not isinstance(system, str):
        return row
    for block in TOOLS_BLOCK.findall(system):
        with contextlib.suppress(json.JSONDecodeError):
            text = block.strip()
            said = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()
                                                                   if line.strip()]
            if said == tools or [t.get("function", t) if isinstance(t, dict) else t for t in said] == [
                    t.get("function", t) if isinstance(t, dict) else t for t in tools]:
                notes.append("'tools' repeats the <tools> block of the system turn: rendered once, from the system "
                             "turn (not given to the template again)")
                return {k: v for k, v in row.items() if k != "tools"}
    return row

def _prompt_of_messages(row: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
    """UltraChat's `prompt` beside the `messages` that start with it: trained once, from `messages`; a `prompt`
    that is another text is a second shape, refused with the entry that trains the chat."""
    prompt, messages = row.get("prompt"), row.get("messages")
    if not isinstance(prompt, str) or not isinstance(messages, list) or row.get("completion") is not None:
        return row
    first = next((m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
    if isinstance(first, str) and first.strip() == prompt.strip():
        notes.append("'prompt' repeats the first user turn of 'messages': trained once, from 'messages'")
        return {k: v for k, v in row.items() if k != "prompt"}
    raise ShapeError(f"{where}: the row has 'messages' and a 'prompt' that is not its first user turn, two shapes "
                     "that are not one dialog twice; the chat trains once the prompt is dropped knowingly.",
                     {"ignore": ["prompt"]})


def _exchange_or_text(row: dict[str, Any], keys: dict[str, str], where: str, mapped: dict[str, str],
                     original: list[str], notes: list[str], roles: dict[str, str] | None = None) -> dict[str, Any]:
    """An exchange row (`_from_roles`), or (the user's word: `columns: {text: ...}`) its rendered `text`.
    tatsu-lab/alpaca's `text` beside the fields it renders trains once, from the fields; a `text` that is not their
    rendering is two shapes."""
    text, fields = row.get("text"), [k for k in keys.values() if k in row]
    if isinstance(text, str) and "text" in mapped:
        notes.append(f"'text' chosen by columns; {', '.join(fields)} not trained")
        return {k: v for k, v in row.items() if k not in keys.values()}
    said = [keys[r] for r in ("prompt", "context", "answer") if r in keys]
    if isinstance(text, str) and row.get(keys["answer"]) is not None and all(
            isinstance(row.get(k), str) and row[k].strip() in text for k in (keys["prompt"], keys["answer"])
            if row.get(k)):
        notes.append(f"'text' renders {'/'.join(said)}: trained once, from the fields "
                     "(columns: {text: text} trains the text instead)")
        row = {k: v for k, v in row.items() if k != "text"}
    return _from_roles(row, keys, where, original, roles)


def _json_cell(value: str, key: str, where: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{where}: field '{key}' is text that is not valid JSON ({e.msg}); it must hold a JSON "
                           "list or object.") from None


def _turn_keys(turns: list[Any], name: str, where: str, tags: dict[str, str]) -> tuple[str, str]:
    """The (role, content) keys of a list of turns, inferred from the turns whatever field holds them: each turn's
    role-like key (a key named as one, toolkit/data/roles.py ROLE_KEYS, else one whose value is a role name) and
    content-like key beside it (`vocab.turn_keys`), the pair most turns give (OpenAI's role/content, ShareGPT's
    from/value, OASST's role/text); turns of which none gives one, the pair of TURN_KEYS they hold most keys of (a
    turn missing its content is refused naming it). The entry's tags name either key over the inferred one. Turns
    with neither are another tool's shape: the error names the keys it saw and the tags that map them."""
    dicts = [t for t in turns if isinstance(t, dict)]
    inferred = [k for k in (vocab.turn_keys(t, tags.get("role_tag")) for t in dicts) if k is not None]
    if inferred:
        found = max(dict.fromkeys(inferred), key=inferred.count)  # the most turns' pair, the first on a tie
    else:  # the TURN_KEYS pair the turns hold most keys of
        held = max(TURN_KEYS.values(), key=lambda ks: sum(k in t for t in dicts for k in ks))
        found = held if any(k in t for t in dicts for k in held) else None
    if "role_tag" in tags or "content_tag" in tags:
        default = found or TURN_KEYS["messages"]
        return tags.get("role_tag", default[0]), tags.get("content_tag", default[1])
    if found is not None:
        return found
    if not dicts:  # no turn is an object: the keys the field's own shape uses, named in its error
        return TURN_KEYS.get(name, TURN_KEYS["messages"])
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
    if name in TURN_KEYS and row.get(other) is not None:
        raise ToolkitError(f"{where}: the row has both 'messages' and 'conversations'; keep one.")
    turns = row[name]
    strict = name != "messages"  # a messages row's odd turns are left to the encoder's checks
    if not isinstance(turns, list) or not turns:
        if strict:
            raise ToolkitError(f"{where}: '{name}' must be a non-empty list of {{from, value}} turns.")
        return row
    if strict and all(isinstance(t, str) for t in turns) and "turns" in vocab.named_roles(name):
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        row = {**row, name: turns}  # LIMA's `conversations`: bare strings, the user first, turns alternating
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
    found: list[str] = []  # image_url paths of the parts
    found_videos: list[Any] = []  # video_url paths and video parts' videos
    for i, turn in enumerate(turns):
        at = f"{name}[{i}]"
        if not isinstance(turn, dict):
            if strict:
                raise ToolkitError(f"{where}: {at} must be an object with '{role_key}' and '{content_key}'.")
            messages.append(turn)
            continue
        speaker = turn.get(role_key)
        role = (roles.get(speaker) or vocab.speaker(speaker)) if isinstance(speaker, str) else None
        if strict:
            for key in (role_key, content_key):
                if turn.get(key) is None:
                    raise ToolkitError(f"{where}: {at} has no '{key}'.")
            if role is None:
                _unknown_speaker(turns, at, role_key, content_key, name, roles, where)
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
            if isinstance(content, list):
                content = _parts(content, at, where, message, found, found_videos)
                content = content if content or role != "assistant" else ""
            message["content"] = content
        messages.append(message)
    if found:
        if out.get("images"):
            raise ToolkitError(f"{where}: the row has 'images' and image_url parts; give the images one way.")
        out["images"] = found
    if found_videos:
        if out.get("videos"):
            raise ToolkitError(f"{where}: the row has 'videos' and video parts; give the videos one way.")
        out["videos"] = found_videos
    out["messages"] = _placeholders(messages, out, where)
    return out


def _unknown_speaker(turns: list[Any], at: str, role_key: str, content_key: str, name: str,
                     roles: dict[str, str], where: str) -> None:
    """Refuse a turn whose role name no vocabulary knows, with the tags that read the chat when the unknown names
    take the user and assistant roles the known names leave free, in the order they speak."""
    names = list(dict.fromkeys(t.get(role_key) for t in turns if isinstance(t, dict)))
    known = {roles.get(n) or vocab.speaker(n) for n in names}
    unknown = [n for n in names if isinstance(n, str) and not (roles.get(n) or vocab.speaker(n))]
    free = [r for r in ("user", "assistant") if r not in known]
    speaker = next(t.get(role_key) for t in turns if isinstance(t, dict) and t.get(role_key) in unknown)
    said = (f"{where}: {at}.{role_key} is {speaker!r}; known speakers are {sorted({*roles, *vocab.SPEAKERS})} "
            "(map other names with the entry's tags: user_tag, assistant_tag, ...)")
    if len(unknown) != len(free) or not unknown:
        raise ToolkitError(said + ".")
    default = TURN_KEYS.get(name, TURN_KEYS["messages"])
    tags = {**({"role_tag": role_key, "content_tag": content_key} if (role_key, content_key) != default else {}),
            **{f"{role}_tag": n for role, n in zip(free, unknown, strict=True)}}
    keys = sorted({k for t in turns if isinstance(t, dict) for k in t})
    raise ShapeError(f"{where}: the turns in '{name}' have keys {keys} and role names {names}; "
                     f"{said.split('; ', 1)[1]}.", {"tags": tags})


PART_FLAGS = ("train", "training", "weight", "loss_weight", "loss", "loss_scale")
"""Training flags a content part may carry (axolotl's per-part `train`): honoured when a turn's parts agree."""


PART_TYPES = {
    "text": "read as text (LLaMA-Factory v1's `value`, OpenAI's and TRL's `text`)",
    "reasoning": "LLaMA-Factory v1: the assistant turn's reasoning_content (Qwen3's think block)",
    "tool_call": "LLaMA-Factory v1: a tool call of the assistant turn (its JSON `value`)",
    "image": "TRL: an image of the row's `images`, in order",
    "image_url": "OpenAI / LLaMA-Factory v1: an image file (a path, not a URL), added to the row's `images`",
    "video_url": "OpenAI: a video file (a path, not a URL), added to the row's `videos`",
    "video": "Qwen / TRL: a video of the row's `videos`, in order; with a `video` value (a path or a frame list, "
             "and settings such as fps, qwen-vl-utils' element) the video itself",
    "input_audio": AUDIO, "audio": AUDIO, "audio_url": AUDIO,
}
"""Every content-part type of the formats read (LLaMA-Factory v1, OpenAI, TRL) and what becomes of it."""


def _parts(parts: list[Any], at: str, where: str, message: dict[str, Any], images: list[str],
           videos: list[Any] | None = None) -> list[Any]:
    """A content list read part by part (PART_TYPES): text parts (LLaMA-Factory v1's `value` read as `text`),
    LLaMA-Factory v1's `reasoning` and `tool_call` parts made the turn's reasoning_content and tool_calls, image
    parts (`image_url` paths appended to `images`), video parts (`video_url` paths and Qwen's `video` values,
    with their settings, appended to `videos`); audio parts refused. Per-part training flags become
    the turn's flag: exactly when every part of the turn says the same, else refused."""
    out, flags = [], set()
    for part in parts:
        if not isinstance(part, dict):
            out.append(part)
            continue
        part = dict(part)
        kind = part.get("type")
        value = part.get("value")
        if kind == "text" and "text" not in part and "value" in part:
            part["text"] = part.pop("value")
        flags.add(tuple(sorted((k, part.pop(k)) for k in PART_FLAGS if k in part)))
        if kind in ("reasoning", "tool_call"):
            if message.get("role") not in ("assistant", "gpt", None) or not isinstance(value, str | dict | list):
                raise ToolkitError(f"{where}: {at} has a '{kind}' part on a turn that is not the assistant's, or "
                                   "without a 'value'; only an assistant turn reasons and calls tools.")
            if kind == "reasoning":
                message["reasoning_content"] = message.get("reasoning_content", "") + str(value)
            else:
                message["tool_calls"] = [*message.get("tool_calls", []), *_tool_calls(value, at, where)]
            continue
        if kind == "image_url":
            url = part.get("image_url", value)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or re.match(r"^(https?|data):", url):
                raise ToolkitError(f"{where}: {at} has an image_url part that is not an image file's path ("
                                   f"{str(url)[:40]!r}); images are read from files, never downloaded or decoded "
                                   "from data URLs: save the image and give its path.")
            images.append(url)
            out.append({"type": "image"})
            continue
        if kind == "video_url" or (kind == "video" and part.get("video") is not None):
            video = part.get(kind, value)
            video = video.get("url") if kind == "video_url" and isinstance(video, dict) else video
            settings = {k: v for k, v in part.items() if k not in ("type", kind, "value")}
            if not isinstance(video, str | list) or any(
                    re.match(r"^(https?|data):", v) for v in ([video] if isinstance(video, str) else video)
                    if isinstance(v, str)):
                raise ToolkitError(f"{where}: {at} has a {kind} part that is not a video file's path or a list of "
                                   f"frame paths ({str(video)[:40]!r}); videos are read from files, never "
                                   "downloaded or decoded from data URLs: save the video and give its path.")
            if videos is None:
                raise ToolkitError(f"{where}: {at} has a '{kind}' part where videos are not read.")
            video = (video.removeprefix("file://") if isinstance(video, str)
                     else [v.removeprefix("file://") if isinstance(v, str) else v for v in video])  # qwen-vl-utils'
            videos.append({"video": video, **settings} if settings else video)
            out.append({"type": "video"})
            continue
        if kind not in PART_TYPES:
            raise ToolkitError(f"{where}: {at} has a '{kind}' part; the part types read are "
                               f"{', '.join(PART_TYPES)}.")
        if PART_TYPES[kind] in (VIDEO, AUDIO):
            raise ToolkitError(f"{where}: {at} has a '{kind}' part: {PART_TYPES[kind]}.")
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
IMAGE_TAGS = (IMAGE_TAG, "<IMG_CONTEXT>", "<|image|>", "<image_placeholder>", "<ImageHere>", "<|image_1|>")
"""Other tools' image placeholders (InternVL, mPLUG-Owl / Llama 3.2 Vision, DeepSeek-VL, MiniGPT-4, Phi-3-vision):
read as `<image>` is, one per image of the row, in order."""
UNREAD_TAGS = re.compile(r"<img>[^<]*</img>|<image_\d+>|<\|image_\d+\|>|<\|vision_start\|>|<\|image_pad\|>")
"""Image markup that no row shape reads as a placeholder (Qwen-VL v1's `<img>path</img>`, MiniCPM-V's numbered
`<image_00>`, Qwen2-VL's own rendered tokens): refused, never trained as text."""
VIDEO_TAG = "<video>"
"""LLaMA-Factory's, ms-swift's and Qwen's placeholder for a video of the row's `videos`, in the text."""
_TAG_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in (*IMAGE_TAGS, VIDEO_TAG)) + ")")


def _placeholders(messages: list[Any], row: dict[str, Any], where: str = "") -> list[Any]:
    """Image placeholders in text (`<image>` and the other tools' IMAGE_TAGS) and `<video>` as image and video parts,
    in order, when the row has `images` or `videos` and its messages no image or video part of their own (the
    encoder checks the counts); beside image parts, a placeholder left in the text is refused (it would train as
    text beside the images). A placeholder of a kind the row has none of stays text, for `_check_placeholders`."""
    has = {kind: isinstance(row.get(key), list) and bool(row[key]) for kind, key in (("image", "images"),
                                                                                     ("video", "videos"))}
    if not any(has.values()):
        return messages
    dicts = [m for m in messages if isinstance(m, dict)]
    if any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in ("image", "video")
                                                      for p in m["content"]) for m in dicts):
        tags = sorted({t for m in dicts for t in _tags_in(m.get("content"))})
        if tags:
            raise ToolkitError(f"{where}: the text holds {', '.join(tags)} beside image parts; give each image "
                               "one way: an image part, or a placeholder in the text.")
        return messages
    for m in dicts:
        if isinstance(m.get("content"), str) and _TAG_SPLIT.search(m["content"]):
            parts: list[dict[str, Any]] = []
            for piece in _TAG_SPLIT.split(m["content"]):
                kind = "video" if piece == VIDEO_TAG else "image" if piece in IMAGE_TAGS else None
                if kind is not None and has[kind]:
                    parts.append({"type": kind})
                elif piece:
                    parts.append({"type": "text", "text": piece})
            m["content"] = parts
    return messages


def _tags_in(content: Any) -> set[str]:
    texts = [content] if isinstance(content, str) else [p.get("text") for p in content or []
                                                        if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return {t for text in texts if isinstance(text, str) for t in IMAGE_TAGS if t in text}


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


OTHER_SHAPES = ("messages", "conversations", "prompt", "text")
"""Keys of the other shapes (a chat, TRL's prompt, a text), refused beside an exchange: one dialog, two shapes."""


def _from_roles(row: dict[str, Any], keys: dict[str, str], where: str, original: list[str],
               roles: dict[str, str] | None = None) -> dict[str, Any]:
    """One exchange read by the roles of its keys (`keys`: role -> key, a SHAPES row of toolkit/data/roles.py):
    the system, then the history ([[prompt, answer], ...] of earlier turns, which train like the last one), then the
    prompt (its context joined after a newline) and the answer (`_answer`: JSON tool calls become tool calls), the
    reasoning the answer's reasoning_content. A row with the prompt but its answer under another name (Dolly's
    `instruction`, `context`, `response`), or its context under another name, is refused with the columns that read
    it all; a second shape beside the exchange is refused, naming it."""
    asked, answered, context = keys["prompt"], keys["answer"], keys.get("context")
    for key in OTHER_SHAPES:
        if key not in keys.values() and row.get(key) is not None:
            raise ShapeError(f"{where}: the row has both '{asked}' and '{key}', two shapes that are not one "
                             f"dialog twice (the row has keys {original}); keep one: columns: {{{key}: {key}}} "
                             f"trains '{key}', or drop it knowingly.", {"ignore": [key]})
    if row.get(answered) is None:  # the answer under another name (Dolly's `response`): its roles give the entry
        _no_shape(row, where, original, [k for k, v in row.items() if not k.startswith("_") and holds_content(k, v)],
                  roles)
    if context is not None and not row.get(context):  # the context under another name (Dolly's `context`)
        unread = [k for k, v in row.items() if k not in keys.values() and k not in READ_ROW_KEYS
                  and not no_content_name(k) and holds_content(k, v) and "context" in vocab.named_roles(k)]
        if unread:
            fix = {"columns": {context: unread[0]}, **({"ignore": unread[1:]} if unread[1:] else {})}
            raise ShapeError(f"{where}: the row's '{unread[0]}' holds content ({_kind(row[unread[0]])}) that no "
                             f"field reads (the row has keys {original}); '{context}' reads a passage after the "
                             f"'{asked}'.", fix)
    system, history, reasoning = keys.get("system"), keys.get("history"), keys.get("reasoning")
    for key in (asked, context, answered, system):
        if key is not None and row.get(key) is not None and not isinstance(row[key], str):
            raise ToolkitError(f"{where}: '{key}' must be a string.")
    messages = [{"role": "system", "content": row[system]}] if system and row.get(system) else []  # "": none
    past = (row.get(history) if history else None) or []
    if not isinstance(past, list) or not all(isinstance(h, list) and len(h) == 2 for h in past):
        raise ToolkitError(f"{where}: '{history}' must be a list of [{asked}, {answered}] pairs.")
    for query, answer in past:
        messages += [{"role": "user", "content": query}, {"role": "assistant", "content": answer}]
    messages += [{"role": "user", "content": row[asked] + (f"\n{row[context]}" if context and row.get(context)
                                                           else "")}, _answer(row[answered])]
    if reasoning and isinstance(row.get(reasoning), str):
        messages[-1]["reasoning_content"] = row[reasoning]
    out = {k: v for k, v in row.items() if k not in keys.values()}
    out["messages"] = _placeholders(messages, out, where)
    return out


def _answer(value: str) -> dict[str, Any]:
    """An exchange's answer as the assistant turn: text, or tool calls when it is JSON of calls (xLAM's `answers`:
    `[{"name": ..., "arguments": {...}}]`), which the template renders as its tool calls."""
    text = value.strip()
    if text.startswith(("[{", "{")):
        with contextlib.suppress(json.JSONDecodeError, ToolkitError):
            calls = json.loads(text)
            items = calls if isinstance(calls, list) else [calls]
            if items and all(isinstance(c, dict) and set(c) == {"name", "arguments"} for c in items):
                return {"role": "assistant", "content": "", "tool_calls": _tool_calls(calls, "answer", "")}
    return {"role": "assistant", "content": value}


def _with_reasoning(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A row's `reasoning` column (mapped by the entry: a reasoning set's CoT) as the reasoning_content of its last
    assistant turn, which the template renders in its thinking block."""
    messages = [dict(m) if isinstance(m, dict) else m for m in row["messages"]]
    last = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "assistant"), None)
    if last is None or last.get("reasoning_content"):
        raise ToolkitError(f"{where}: the row's 'reasoning' has no assistant turn to go to, or the turn has its own "
                           "reasoning_content; keep one.")
    last["reasoning_content"] = row["reasoning"]
    return {**{k: v for k, v in row.items() if k != "reasoning"}, "messages": messages}


def _from_conversational(row: dict[str, Any], where: str, tags: dict[str, str]) -> dict[str, Any]:
    """TRL's conversational prompt/completion: `prompt` and `completion` lists of messages, one chat in which only
    the completion trains (an assistant turn of the prompt is context: PROMPT_TURN)."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, list) and completion is None:
        raise ToolkitError(f"{where}: the row has a 'prompt' and no 'completion': TRL's prompt-only rows train in an "
                           "RL stage (objective: grpo), which writes the completions; a row of this stage needs its "
                           "answer ('completion', or the chat's last assistant turn in 'messages').")
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
