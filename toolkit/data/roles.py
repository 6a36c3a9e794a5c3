"""Column roles: what each key of a row holds, inferred from its name (a vocabulary drawn from real datasets) and
its value (a list of turns is a chat under any name), and the data entry that trains a row by those roles.

One inference serves training's refusals (toolkit/data/shapes.py, toolkit/data/pairs.py) and `toolkit inspect-data
FILE`. The shapes the toolkit reads by name (Alpaca, ms-swift's query/response, TRL's prompt/completion, ShareGPT,
OpenAI) are rows of `SHAPES` (role -> key, which decides the reader) and their key names the first synonyms of
each role in `VOCABULARY`. Roles are inferred once per file from its first rows (`file_roles`). Advice built here
(`entry_for`) maps every prompt, answer, system, context, reasoning, tools and media key to the row field that
reads it and `ignore:`s only metadata; a content key whose role no name or value tells is named with the entry for
each role it could have, never dropped.
"""

from __future__ import annotations

import functools
import re
from typing import Any

ROLES = ("turns", "system", "prompt", "context", "answer", "reasoning", "tools", "media", "chosen", "rejected",
         "metadata")
"""The roles a row's key can have."""

VOCABULARY: dict[str, tuple[str, ...]] = {
    # the toolkit's own shapes' names first (Alpaca, ms-swift, TRL, ShareGPT, OpenAI), then other datasets'
    "turns": ("messages", "conversations", "conversation", "dialog", "dialogue", "chat", "turns", "history_turns"),
    "system": ("system", "system_prompt", "system_message", "sys_prompt", "systemprompt"),
    "prompt": ("instruction", "query", "prompt", "question", "problem", "inputs", "input", "user", "human",
               "request", "user_prompt", "user_input", "instructions", "task_input"),
    "context": ("input", "context", "passage", "document", "documents", "background", "knowledge", "article"),
    "answer": ("output", "response", "completion", "answer", "answers", "targets", "target", "solution", "reply",
               "assistant", "gpt", "outputs", "output_text", "generation", "model_response", "responses",
               "ground_truth"),
    "reasoning": ("reasoning", "reasoning_content", "thinking", "think", "thought", "thoughts", "cot",
                  "complex_cot", "chain_of_thought", "rationale", "deepseek_reasoning", "reasoning_trace",
                  "explanation"),
    "tools": ("tools", "functions", "tool_definitions", "available_tools", "tool_list"),
    "media": ("images", "image", "videos", "video", "audios", "audio", "image_path", "image_file", "img"),
    "chosen": ("chosen", "preferred_output", "chosen_response", "response_j", "better_response"),
    "rejected": ("rejected", "non_preferred_output", "rejected_response", "response_k", "worse_response",
                 "rejected_messages"),
    "metadata": ("id", "idx", "index", "uid", "uuid", "key", "source", "sources", "url", "urls", "link", "category",
                 "categories", "type", "task", "task_type", "task_name", "task_source", "template_type", "lang",
                 "language", "language_code", "license", "score", "scores", "rating", "quality", "split", "subset",
                 "dataset", "origin", "model", "model_name", "tag", "tags", "label", "labels", "meta", "metadata",
                 "hash", "timestamp", "date", "length", "num_turns", "turn", "annotation_type", "user_id",
                 "openai_moderation", "detoxify_moderation", "redacted", "toxic", "country", "state", "hashed_ip",
                 "header", "conversation_hash", "original_question", "created_date", "review_count", "review_result",
                 "rank", "synthetic", "emojis", "tree_state", "deleted", "weight", "sub_task", "subcategory", "domain",
                 "level", "difficulty", "problem_type", "question_type", "cot_type", "source_type",
                 "is_reasoning_complete", "correctness_math_verify", "finish_reason", "unnamed_0", "__index_level_0__",
                 "score_chosen", "score_rejected"),
}
"""Role -> key names that hold it in real datasets (lower case, `-` and spaces as `_`). A name under two roles
(`input`: Alpaca's context after an instruction, aya's prompt alone) takes the first role still free in ROLES
order. Metadata names hold no content (ids, scores, categories, moderation records)."""

METADATA_SUFFIXES = ("_id", "_ids", "_idx", "_url", "_score", "_scores", "_count", "_type", "_source", "_hash",
                     "_date", "_time", "_lang", "_name", "_tag", "_label")
"""Name endings of metadata keys (`conversation_id`, `prompt_id`, `score_chosen` is named in the table)."""

ROLE_KEYS = ("role", "from", "speaker", "author", "sender", "who", "user_type")
"""Keys that hold a turn's role (OpenAI `role`, ShareGPT `from`, other dumps' `speaker` / `author`)."""
CONTENT_KEYS = ("content", "value", "text", "message", "utterance", "body", "msg")
"""Keys that hold a turn's content (OpenAI `content`, ShareGPT `value`, OASST's `text`)."""

SPEAKERS: dict[str, str] = {
    "user": "user", "human": "user", "prompter": "user", "usr": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
    "ai": "assistant", "bard": "assistant", "bing": "assistant", "claude": "assistant",
    "system": "system",
    "observation": "tool", "tool": "tool", "function": "tool", "function_response": "tool", "tool_response": "tool",
    "ipython": "tool", "function_call": "tool call", "tool_call": "tool call",
}
"""A turn's role name, case-insensitive, -> the toolkit's role (ShareGPT `human` / `gpt`, OASST `prompter`, ShareGPT
dumps' `chatgpt` / `bing` / `bard`, Vicuna's `USER` / `ASSISTANT`, ms-swift's agent roles)."""

SHAPES: tuple[tuple[str, dict[str, str], tuple[str, ...], str], ...] = (
    ("chat (OpenAI, TRL)", {"turns": "messages", "prompt": "prompt"}, ("turns",), "chat"),
    ("ShareGPT (LLaMA-Factory, axolotl)", {"turns": "conversations", "system": "system"}, ("turns",), "chat"),
    ("Alpaca", {"prompt": "instruction", "context": "input", "answer": "output", "system": "system",
                "history": "history", "reasoning": "reasoning"}, ("prompt",), "exchange"),
    ("prompt/completion (TRL)", {"prompt": "prompt", "answer": "completion"}, ("answer",), "lists or text"),
    ("text", {"text": "text"}, ("text",), "text"),
    ("query/response (ms-swift)", {"prompt": "query", "answer": "response", "system": "system",
                                   "history": "history", "reasoning": "reasoning"}, ("prompt", "answer"), "exchange"),
    ("a chat under another key (lmsys, WildChat, OASST trees, ms-swift's exchanges)", {"turns": "*"}, ("turns",),
     "chat"),
    ("prompt only (TRL)", {"prompt": "prompt"}, ("prompt",), "lists or text"),
)
"""The shapes read without a data entry, as rows of the role table: (name, role -> the key that holds it, the roles
whose keys make a row this shape, its reader), tried in order; the first whose making keys the row holds reads it.
`*` is any key whose values are turns or a message tree (`is_turns`, `is_tree`). Readers: `chat`, the turns read
as the chat (a system beside them its first turn; a prompt beside them the chat's first user turn, said once);
`exchange`, the prompt and its answer after the system and history (the context joined to the prompt, the reasoning
the answer's thinking block); `lists or text`, TRL's prompt/completion as a chat when they are lists (only the
completion trains), as a text row when strings; `text`, a text row. Other names of a role (OpenOrca's `question`,
aya's `targets`) are refused with the entry that maps them to these fields (`entry_for`)."""


def shape_of(row: dict[str, Any]) -> tuple[str, dict[str, str], str] | None:
    """The first SHAPES row whose making keys the row holds (not None): its name, role -> key map (`*` resolved to
    the row's key of turns, TRL's prompt/completion lists aside; two such keys are all named under `*`, for the
    caller's refusal) and reader; None when no shape reads the row."""
    for name, keys, made, reader in SHAPES:
        if keys.get("turns") == "*":
            conversational = isinstance(row.get("prompt"), list) or isinstance(row.get("completion"), list)
            found = [k for k, v in row.items() if not k.startswith("_") and (is_turns(v) or is_tree(v))
                     and not (conversational and k in ("prompt", "completion"))]
            if found:
                return name, {"turns": found[0], **({"*": ",".join(found)} if len(found) > 1 else {})}, reader
            continue
        if all(row.get(keys[role]) is not None for role in made):
            return name, dict(keys), reader
    return None


PAIR_SHAPES: tuple[tuple[str, dict[str, str], tuple[str, ...], str], ...] = (
    ("OpenAI preference fine-tuning", {"prompt": "input", "chosen": "preferred_output",
                                       "rejected": "non_preferred_output"}, ("prompt", "chosen", "rejected"),
     "input object"),
    ("ms-swift, whole rejected chat", {"turns": "messages", "rejected": "rejected_messages"}, ("turns", "rejected"),
     "last turn"),
    ("ms-swift", {"turns": "messages", "rejected": "rejected_response"}, ("turns", "rejected"), "last turn"),
    ("TRL explicit", {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
     ("prompt", "chosen", "rejected"), "prompt"),
    ("axolotl chat_template.default", {"turns": "messages", "system": "system", "chosen": "chosen",
                                       "rejected": "rejected"}, ("turns", "chosen", "rejected"), "turns"),
    ("LLaMA-Factory ranking, sharegpt", {"turns": "conversations", "system": "system", "chosen": "chosen",
                                         "rejected": "rejected"}, ("turns", "chosen", "rejected"), "turns"),
    ("LLaMA-Factory ranking, alpaca", {"prompt": "instruction", "context": "input", "system": "system",
                                       "history": "history", "chosen": "chosen", "rejected": "rejected"},
     ("prompt", "chosen", "rejected"), "exchange"),
    ("TRL implicit", {"chosen": "chosen", "rejected": "rejected"}, ("chosen", "rejected"), "shared start"),
)
"""The preference pair shapes read without a data entry, as rows of the role table (as SHAPES): (name, role ->
the key that holds it, the roles whose keys make a row this shape, its reader), tried in order; the first whose
making keys the row holds reads it (`pair_shape_of`). Roles: `chosen` / `rejected`, the preference sides (a string,
one assistant turn or a list of turns; a dialog in one string, Anthropic HH's, is split into turns); `prompt`;
`turns`, the prompt as a chat; `system`; `context` and `history` (Alpaca's). Readers (toolkit/data/pairs.py):
`input object`, the prompt an object of the chat's `messages` (and `tools`), read again as the turns' shape;
`last turn`, the turns end with the chosen answer and the rejected side replaces it (a string, or the whole rejected
chat); `prompt`, TRL's prompt (text or turns; a text prompt beside whole conversations is their shared start);
`turns`, the chat before the answers (its system first); `exchange`, the system, history and prompt with its
context; `shared start`, whole conversations (or texts) whose shared start is the prompt (TRL's extract_prompt)."""


def pair_shape_of(row: dict[str, Any]) -> tuple[str, dict[str, str], str] | None:
    """The first PAIR_SHAPES row whose making keys the row holds (not None): its name, role -> key map and
    reader; None when no pair shape reads the row."""
    for name, keys, made, reader in PAIR_SHAPES:
        if all(row.get(keys[role]) is not None for role in made):
            return name, dict(keys), reader
    return None


def pair_side_keys() -> tuple[str, ...]:
    """The keys that hold a preference side in some pair shape (PAIR_SHAPES' `chosen` / `rejected` keys): a row
    holding one is a pair."""
    return tuple(dict.fromkeys(keys[r] for _, keys, _, _ in PAIR_SHAPES for r in ("chosen", "rejected") if r in keys))


FIELDS = {"turns": "messages", "system": "system", "prompt": "instruction", "context": "input", "answer": "output",
          "reasoning": "reasoning", "tools": "tools", "media": "images"}
"""Role -> the row field (a data entry's `columns` key) that reads it."""


@functools.lru_cache(maxsize=1 << 14)
def norm(key: str) -> str:
    """A key as the vocabulary spells names: lower case, runs of non-alphanumerics as `_`. Remembered: a file's
    few key names are normalised once, not once per row and turn."""
    return re.sub(r"[^0-9a-z]+", "_", key.lower()).strip("_") if key.strip("_") else key.lower()


def named_roles(key: str) -> list[str]:
    """The roles whose vocabulary names `key`, in ROLES order (metadata also by METADATA_SUFFIXES)."""
    name = norm(key)
    roles = [r for r in ROLES if name in VOCABULARY[r]]
    if not roles and (name.endswith(METADATA_SUFFIXES) or name.startswith(("unnamed_", "__index_level"))):
        roles = ["metadata"]
    return roles


def speaker(name: Any) -> str | None:
    """A turn's role name as the toolkit's role (SPEAKERS, case-insensitive), or None."""
    return SPEAKERS.get(norm(name)) if isinstance(name, str) else None


def turn_keys(turn: dict[str, Any], role: str | None = None) -> tuple[str, str] | None:
    """The (role key, content key) of a turn by the vocabulary, else by values: the key whose string is a known role
    name (or `role`, a key the data entry's tags name), and the other string key with the longest text. None when
    it is no turn."""
    role = role if role in turn else None
    named_roles, named_contents = _named_turn_keys(tuple(turn))
    role = role or next((k for k in named_roles if isinstance(turn[k], str)), None)
    role = role or next((k for k, v in turn.items() if speaker(v) is not None), None)
    if role is None:
        return None
    content = next((k for k in named_contents if k != role), None)
    if content is None:
        texts = [k for k, v in turn.items() if k != role and isinstance(v, str | list)]
        content = max(texts, key=lambda k: len(str(turn[k])), default=None)
    return None if content is None else (role, content)


@functools.lru_cache(maxsize=1 << 12)
def _named_turn_keys(keys: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Of a turn's keys, in order, those the vocabulary names a role key and those it names a content key: once per
    key set, not once per turn (a file's turns share a few)."""
    return (tuple(k for k in keys if norm(k) in ROLE_KEYS), tuple(k for k in keys if norm(k) in CONTENT_KEYS))


def exchange_keys(turn: dict[str, Any]) -> tuple[str, str] | None:
    """The (asked, answered) keys of an exchange object ({human, assistant}, Capybara's {input, output}): one prompt
    and one answer name, both strings. None when it is no exchange."""
    asked = [k for k, v in turn.items() if isinstance(v, str) and "prompt" in named_roles(k)]
    answered = [k for k, v in turn.items() if isinstance(v, str) and "answer" in named_roles(k)]
    return (asked[0], answered[0]) if len(asked) == 1 and len(answered) == 1 else None


MARKER = re.compile(r"(?:^|\n)[ \t]*(USER|ASSISTANT|SYSTEM|FUNCTION RESPONSE|Human|Assistant|User|System)[ \t]*:[ \t]*")
"""A speaker's marker at the start of a line of a dialog written into one string (Glaive's `USER:` / `ASSISTANT:` /
`FUNCTION RESPONSE:`, Anthropic HH's `Human:` / `Assistant:`)."""
MARKED_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "system": "system",
                "function response": "tool"}
END_MARKS = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "<|end|>")
"""Other tools' end-of-turn tokens written at the end of a turn's text (Glaive's `<|endoftext|>`): not content."""


def split_dialog(text: Any) -> list[dict[str, str]] | None:
    """A dialog written into one string, as turns: at least a user and an assistant marker (MARKER), the text before
    the first marker empty; None when it is no such dialog. Other tools' end-of-turn tokens at a turn's end go."""
    if not isinstance(text, str):
        return None
    cuts = list(MARKER.finditer(text))
    if len(cuts) < 2 or text[:cuts[0].start()].strip():
        return None
    turns = []
    for k, cut in enumerate(cuts):
        body = text[cut.end():cuts[k + 1].start() if k + 1 < len(cuts) else len(text)].strip()
        for mark in END_MARKS:
            body = body.removesuffix(mark).rstrip()
        turns.append({"role": MARKED_ROLES[cut.group(1).lower()], "content": body})
    roles = {t["role"] for t in turns}
    return turns if {"user", "assistant"} <= roles else None


def is_turns(value: Any) -> bool:
    """A list whose objects are turns (a role and a content, by `turn_keys`) or exchanges (`exchange_keys`), or a
    dialog written into one string with speakers' markers (`split_dialog`), whatever key holds it."""
    if isinstance(value, str):
        return split_dialog(value) is not None
    dicts = [t for t in value if isinstance(t, dict)] if isinstance(value, list) else []
    return bool(dicts) and len(dicts) == len(value) and (
        all(turn_keys(t) is not None for t in dicts) or all(exchange_keys(t) is not None for t in dicts))


def is_tree(value: Any) -> bool:
    """A message tree's root (OASST's export): a turn object with a list of `replies` (or `children`)."""
    return isinstance(value, dict) and turn_keys({k: v for k, v in value.items() if k not in TREE_KEYS}) is not None \
        and any(isinstance(value.get(k), list) for k in TREE_KEYS)


TREE_KEYS = ("replies", "children")

PARENT_KEYS = ("parent_id", "parent_message_id", "parent")
"""Keys that link one message per row to its parent (OASST's flat message export: `parent_id`)."""
ID_KEYS = ("message_id", "id", "msg_id")
"""Keys that name a message of a flat export, for its replies' parent key."""


def flat_message(row: Any) -> tuple[str, str] | None:
    """The (id key, parent key) of a row that is one message of a flat message export (OASST's `message_id`,
    `parent_id`, `role: prompter|assistant`, `text`): a message id (a string), a parent key (a string, or None for
    a tree's root), and a role and a text by `turn_keys`. None when it is no such row."""
    if not isinstance(row, dict):
        return None
    ident = next((k for k in ID_KEYS if isinstance(row.get(k), str)), None)
    parent = next((k for k in PARENT_KEYS if k in row and (row[k] is None or isinstance(row[k], str))), None)
    if ident is None or parent is None:
        return None
    keys = turn_keys({k: v for k, v in row.items() if k not in (ident, parent)})
    return (ident, parent) if keys is not None and speaker(row.get(keys[0])) is not None else None


def infer_roles(row: dict[str, Any], content: Any) -> dict[str, str]:
    """Each key of `row` -> its role: `turns` for a list of turns (or a message tree) whatever its name; else by
    the vocabulary, a name of two roles taking the first still free; `metadata` for a key that holds no content
    (`content(key, value)` false) whose name has no role; a named key keeps its role whatever its value in this row
    (FLAN's one-word `targets`, OpenOrca's empty `system_prompt`); `unknown` for content no name tells."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for key, value in row.items():
        if is_turns(value) or is_tree(value):
            out[key] = "turns"
            taken.add("turns")
    single = {"system", "prompt", "context", "answer", "reasoning", "tools", "chosen", "rejected"}
    for key, value in sorted(row.items(), key=lambda kv: _rank(kv[0])):
        if key in out:
            continue
        named = [r for r in named_roles(key) if r != "turns"]  # turns are told by their values alone
        if "metadata" in named and not (set(named) - {"metadata"}):
            out[key] = "metadata"
            continue
        if not named and not content(key, value):  # a key of no known name without content: metadata
            out[key] = "metadata"
            continue
        if value is None or value == [] or (not named and value == ""):
            out[key] = "metadata"
            continue
        role = next((r for r in named if r not in taken or r not in single), None)
        out[key] = role or "unknown"
        taken.add(out[key])
    return out


def _rank(key: str) -> tuple[int, str]:
    """The vocabulary's own order: a key named first for its role (`instruction`) is placed before one named later
    (`input`), so `input` beside an instruction is context and alone is the prompt."""
    name = norm(key)
    for role in ROLES:
        if name in VOCABULARY[role]:
            return VOCABULARY[role].index(name), key
    return 99, key


def entry_for(roles: dict[str, str]) -> tuple[dict[str, Any] | None, list[str]]:
    """The data entry keys (`columns`, `ignore`) that train a row of these roles, and the keys whose role is
    unknown. Every role but metadata is mapped, never ignored: metadata holding text is `ignore:`d, metadata
    without content stays (the log names it). None when the row has no answer to train (no turns, answer or text),
    or unknown keys remain (`candidates` names them with their entries)."""
    columns: dict[str, str] = {}
    for key, role in roles.items():
        if role in FIELDS and key != FIELDS[role]:
            columns[FIELDS[role]] = key
    unknown = [k for k, r in roles.items() if r == "unknown"]
    trains = "turns" in roles.values() or ("answer" in roles.values() and "prompt" in roles.values())
    if unknown or not trains:
        return None, unknown
    return ({"columns": columns} if columns else {}), unknown


CANDIDATES = ("prompt", "answer", "context", "system", "reasoning")
"""The roles an unknown content key may have, as `candidates` names them."""


def candidates(roles: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """For a row with unknown keys or a missing prompt or answer: (role of key, entry) for each way the unknown
    keys can complete it. A missing answer is asked of each unknown key first, then a missing prompt, then context."""
    unknown = [k for k, r in roles.items() if r == "unknown"]
    missing = [r for r in ("prompt", "answer") if r not in roles.values()]
    if "turns" in roles.values():
        missing = []
    out: list[tuple[str, dict[str, Any]]] = []
    for key in unknown:
        for role in ([*missing] or ["context", "system", "reasoning"]):
            trial = {**roles, key: role}
            others = [k for k in unknown if k != key]
            for other in others:  # the other unknown keys take the remaining missing role
                left = [r for r in missing if r not in trial.values()]
                trial[other] = left[0] if left else "context"
            entry, _ = entry_for(trial)
            if entry is not None:
                out.append((f"'{key}' as the {role}", entry))
    return out


SAMPLE_ROWS = 64
"""How many of a file's first rows its column roles are inferred from (`file_roles`)."""


def file_roles(rows: list[Any], content: Any) -> dict[str, str]:
    """Each key of a file's sampled rows (its first SAMPLE_ROWS, as stored) -> its role, inferred once for the
    file: each row's roles (`infer_roles`), and a key takes the role given most often by the rows where it holds
    content (ties: the earliest), so a value that is empty or odd in one row does not change the column's role; a key
    that holds content in no sampled row keeps the role its first row gives it (a named key its name's role)."""
    votes: dict[str, dict[str, int]] = {}
    first: dict[str, str] = {}
    for row in rows:
        if not isinstance(row, dict):
            continue
        roles = infer_roles(row, content)
        for key in row:  # the file's own column order
            role = roles[key]
            first.setdefault(key, role)
            if content(key, row[key]) or is_turns(row[key]) or is_tree(row[key]):
                count = votes.setdefault(key, {})
                count[role] = count.get(role, 0) + 1
    return {key: max(votes[key], key=lambda r: votes[key][r]) if votes.get(key) else role
            for key, role in first.items()}


def shape_names() -> set[str]:
    """The key names the shapes read as they are (SHAPES) hold: they may hold text or turns row by row (TRL's
    `prompt`), so a row's value there never contradicts the file's roles."""
    return {key for _, keys, _, _ in SHAPES for key in keys.values() if key != "*"}


@functools.lru_cache(maxsize=1 << 10)
def _may_contradict(keys: tuple[str, ...], roles: tuple[tuple[str, str], ...]) -> bool:
    """Whether any of a row's keys could contradict the file's roles (`contradiction`'s tests that read no value):
    once per key set, so a file's rows of its usual keys skip inferring their roles (a third of reading them)."""
    file_roles, names = dict(roles), shape_names()
    return any(_may_differ(k, file_roles.get(k), names) for k in keys)


def _may_differ(key: str, theirs: str | None, names: set[str]) -> bool:
    """Whether a key could hold content of another role than the file's by its values: the file gives it a role
    that is not metadata, no shape reads it by name, and the vocabulary names it no role but turns or metadata."""
    return theirs not in (None, "metadata") and key not in names and not set(named_roles(key)) - {"turns", "metadata"}


def contradiction(row: dict[str, Any], roles: dict[str, str], content: Any) -> tuple[str, str, str] | None:
    """A key of `row` whose value contradicts the file's roles (`file_roles`): (key, the file's role, the row's),
    for a key no shape names whose role its values tell (a chat under another name, content of no named role): the
    row holds content there that gives it another role. A column the file's sample holds no content in is left to
    the row's own checks (content that nothing reads is refused there, with the entry for each role it could
    have). None when none does."""
    if not _may_contradict(tuple(row), tuple(sorted(roles.items()))):
        return None  # decided by the keys alone: no key below could be one
    names = shape_names()
    mine = infer_roles(row, content)
    for key, role in mine.items():
        theirs = roles.get(key)
        if theirs == role or not _may_differ(key, theirs, names):
            continue
        value = row[key]
        if content(key, value) or is_turns(value) or is_tree(value):
            return key, theirs, role
    return None
