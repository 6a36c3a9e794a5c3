"""Preference pairs: every peer's pair shape mapped to two rows that share a prompt, and a pair's token fit.

A pair becomes a chosen row and a rejected row in TRL's prompt/completion shape (the shape `toolkit/data/shapes.py`
already reads: a string prompt and completion, or lists of messages where only the completion trains), so each side
is rendered and masked by the encoder like any other row. The shapes (docs/data.md):

* TRL explicit: `prompt`, `chosen`, `rejected`; strings (standard) or lists of messages (conversational). A text
  `prompt` beside whole conversations (HuggingFaceH4/ultrafeedback_binarized: `chosen` and `rejected` start with
  the user turn) is read as TRL's `maybe_extract_prompt` reads it: the prompt is the conversations' shared start.
* TRL implicit: `chosen` and `rejected` only, whole conversations (or texts) sharing a prefix, which is the prompt
  (TRL's `extract_prompt`: messages up to the first that differs; for texts, characters up to the first that
  differs, a space before it going to the completion).
* LLaMA-Factory `ranking: true`, after the entry's `columns` are applied: alpaca (`instruction`, `input`, `system`,
  `history`, string `chosen` / `rejected`) or sharegpt (`conversations` / `messages` turns, `chosen` / `rejected`
  one turn each).
* ms-swift: `messages` ending with the chosen assistant turn and `rejected_response` (a string), or
  `rejected_messages` (the whole rejected conversation).
* axolotl `chat_template.default`: `messages` (the prompt) with `chosen` / `rejected` one assistant message each.

The fit (`fit_pair`): the two encoded sides share their prompt tokens. Over `max_seq_len`, `overlength: error`
raises, `drop` drops the pair, `truncate` cuts the prompt first (from its start, keeping the turns nearest the
completion, down to one token) and then the completions' ends. A pair left without a completion token on either side
is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolkit.data.encoding import IGNORE_INDEX, overlength_message
from toolkit.data.roles import split_dialog
from toolkit.data.shapes import PAIR_KEYS, ROLE_NAMES, prepare_row, shape_row
from toolkit.errors import ToolkitError

if TYPE_CHECKING:
    from toolkit.data.sources import Source

NOT_A_PAIR = ("the stage trains on preference pairs (objective dpo, orpo or simpo) but this row is no pair: a pair "
              "has 'chosen' and 'rejected' (TRL, LLaMA-Factory ranking, axolotl) or 'messages' with "
              "'rejected_response' / 'rejected_messages' (ms-swift); see docs/preference.md for the shapes")
"""Why a row of a preference stage that is no pair is refused."""
MEDIA_IN_COMPLETION = ("a pair's images and videos belong to its prompt, which both sides share; a completion that "
                       "shows one is no pair of answers to one question: move it into the prompt")
"""Why a pair whose chosen or rejected side holds an image or video placeholder is refused."""


PAIR_SHAPES = {
    "TRL explicit": ("prompt", "chosen", "rejected"),
    "TRL implicit": ("chosen", "rejected"),
    "LLaMA-Factory ranking, alpaca": ("instruction", "chosen", "rejected"),
    "LLaMA-Factory ranking, sharegpt": ("conversations", "chosen", "rejected"),
    "ms-swift": ("messages", "rejected_response"),
    "ms-swift, whole rejected chat": ("messages", "rejected_messages"),
    "axolotl chat_template.default": ("messages", "chosen", "rejected"),
    "OpenAI preference fine-tuning": ("input", "preferred_output", "non_preferred_output"),
}
"""The pair shapes by the keys that make them (the module docstring), for naming a file's shape."""


def pair_shape(keys: list[str]) -> str | None:
    """The pair shape whose keys the row has, the most specific first; None for a row that is no pair."""
    fits = [name for name, needs in PAIR_SHAPES.items() if set(needs) <= set(keys)]
    return max(fits, key=lambda name: len(PAIR_SHAPES[name]), default=None)


def is_pair(row: dict[str, Any]) -> bool:
    """Whether the row is a preference pair (has one of PAIR_KEYS)."""
    return any(row.get(k) is not None for k in PAIR_KEYS)


def _message(turn: Any, at: str, where: str) -> dict[str, Any]:
    """An OpenAI `{role, content}` or ShareGPT `{from, value}` turn as an OpenAI message."""
    if isinstance(turn, dict) and "role" in turn and "content" in turn:
        return dict(turn)
    if isinstance(turn, dict) and "from" in turn and "value" in turn and turn["from"] in ROLE_NAMES:
        rest = {k: v for k, v in turn.items() if k not in ("from", "value")}
        return {"role": ROLE_NAMES[turn["from"]], "content": turn["value"], **rest}
    raise ToolkitError(f"{where}: {at} must be a message ({{\"role\", \"content\"}} or {{\"from\", \"value\"}}); "
                       f"found {str(turn)[:80]!r}.")


def _messages(value: Any, at: str, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ToolkitError(f"{where}: '{at}' must be a non-empty list of messages.")
    return [_message(t, f"{at}[{i}]", where) for i, t in enumerate(value)]


def _completion(value: Any, at: str, where: str) -> list[dict[str, Any]] | str:
    """A completion: a string, one assistant message, or a list of messages."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return [_message(value, at, where)]
    return _messages(value, at, where)


def _as_messages(value: list[dict[str, Any]] | str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": value}] if isinstance(value, str) else value


def _sides(prompt: Any, chosen: Any, rejected: Any, rest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chosen and rejected rows (prompt/completion shape); text stays text only when all three are strings."""
    if not (isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)):
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        chosen, rejected = _as_messages(chosen), _as_messages(rejected)
    return {**rest, "prompt": prompt, "completion": chosen}, {**rest, "prompt": prompt, "completion": rejected}


def _text_prefix(chosen: str, rejected: str) -> int:
    """TRL's extract_prompt on texts: characters up to the first that differs, a space before it to the completion."""
    at = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b),
              min(len(chosen), len(rejected)))
    return at - 1 if at > 0 and chosen[at - 1] == " " else at


def _implicit(row: dict[str, Any], where: str, rest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        at = _text_prefix(chosen, rejected)
        if at == 0 or at >= min(len(chosen), len(rejected)):
            raise ToolkitError(f"{where}: 'chosen' and 'rejected' share no prompt, or one is the other's prefix; "
                               "give a 'prompt' key (TRL's explicit shape).")
        return _sides(chosen[:at], chosen[at:], rejected[at:], rest)
    c, r = _messages(chosen, "chosen", where), _messages(rejected, "rejected", where)
    at = next((i for i, (a, b) in enumerate(zip(c, r, strict=False)) if a != b), min(len(c), len(r)))
    if at == 0 or at >= min(len(c), len(r)):
        raise ToolkitError(f"{where}: 'chosen' and 'rejected' share no leading messages (the prompt), or one is the "
                           "other's prefix; give a 'prompt' key (TRL's explicit shape).")
    return _sides(c[:at], c[at:], r[at:], rest)


def _alpaca_prompt(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """LLaMA-Factory alpaca ranking: system, history ([[query, answer], ...], context), instruction + input."""
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for i, turn in enumerate(row.get("history") or []):
        if not (isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise ToolkitError(f"{where}: history[{i}] must be a [query, answer] pair of strings.")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    if not isinstance(row.get("instruction"), str):
        raise ToolkitError(f"{where}: 'instruction' must be a string (LLaMA-Factory's alpaca ranking shape).")
    query = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
    return [*messages, {"role": "user", "content": query}]


def _openai(row: dict[str, Any], where: str) -> dict[str, Any]:
    """OpenAI's preference fine-tuning row (`input`: {messages, tools, parallel_tool_calls}, `preferred_output` and
    `non_preferred_output`: one assistant message each, in a list) as the axolotl shape: `messages` (the prompt),
    `chosen`, `rejected`, and the input's `tools`."""
    given = row.get("input")
    if not isinstance(given, dict) or not isinstance(given.get("messages"), list):
        raise ToolkitError(f"{where}: 'input' must be an object with 'messages' (OpenAI's preference format).")
    sides = {}
    for key in ("preferred_output", "non_preferred_output"):
        value = row.get(key)
        if not isinstance(value, list) or len(value) != 1:
            raise ToolkitError(f"{where}: '{key}' must be a list of one assistant message (OpenAI's preference "
                               "format).")
        sides[key] = value
    rest = {k: v for k, v in row.items() if k not in ("input", *sides)}
    tools = given.get("tools")
    return {**rest, **({"tools": tools} if tools else {}), "messages": given["messages"],
            "chosen": sides["preferred_output"], "rejected": sides["non_preferred_output"]}


def _by_roles(row: dict[str, Any], where: str) -> None:
    """A pair whose prompt (and system) are under other names (Intel/orca_dpo_pairs' `system` / `question`) is
    refused with the entry that reads it by their roles (toolkit/data/roles.py): the question as LLaMA-Factory's
    alpaca ranking `instruction`, its `system` read beside it."""
    from toolkit.data.roles import infer_roles
    from toolkit.data.shapes import ShapeError, holds_content

    rest = {k: v for k, v in row.items() if k not in (*PAIR_KEYS, "system") and not k.startswith("_")}
    roles = infer_roles(rest, holds_content)
    asked = [k for k, r in roles.items() if r in ("prompt", "turns")]
    if len(asked) == 1 and roles[asked[0]] == "prompt" and isinstance(row[asked[0]], str):
        raise ShapeError(f"{where}: the pair's prompt is '{asked[0]}' (a {roles[asked[0]]} by its name), which no pair "
                         "shape names; read it as the alpaca ranking shape's instruction"
                         f"{' beside its system' if row.get('system') else ''}.",
                         {"columns": {"instruction": asked[0]}})


def to_pair(row: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (chosen, rejected) rows of a pair row in any of the module's shapes; an unreadable pair gets one line."""
    if row.get("preferred_output") is not None or row.get("non_preferred_output") is not None:
        row = _openai(row, where)
    taken = {*PAIR_KEYS, "prompt", "messages", "conversations", "instruction", "input", "system", "history"}
    rest = {k: v for k, v in row.items() if k not in taken}
    if row.get("rejected_response") is not None or row.get("rejected_messages") is not None:  # ms-swift
        messages = _messages(row.get("messages"), "messages", where)
        if messages[-1]["role"] != "assistant":
            raise ToolkitError(f"{where}: 'messages' must end with the chosen assistant turn (ms-swift's shape).")
        if row.get("rejected_messages") is not None:
            rejected = _messages(row["rejected_messages"], "rejected_messages", where)
            if rejected[:-1] != messages[:-1] or rejected[-1]["role"] != "assistant":
                raise ToolkitError(f"{where}: 'rejected_messages' must be 'messages' with another last assistant "
                                   "turn (ms-swift's shape).")
            return _sides(messages[:-1], messages[-1:], rejected[-1:], rest)
        if not isinstance(row["rejected_response"], str):
            raise ToolkitError(f"{where}: 'rejected_response' must be a string (ms-swift's shape).")
        return _sides(messages[:-1], messages[-1:], row["rejected_response"], rest)
    if row.get("chosen") is None or row.get("rejected") is None:
        missing = "chosen" if row.get("chosen") is None else "rejected"
        raise ToolkitError(f"{where}: a preference pair needs 'chosen' and 'rejected'; '{missing}' is missing.")
    dialogs = [split_dialog(row[k]) for k in ("chosen", "rejected")]
    if all(dialogs):  # Anthropic HH: whole dialogs in one string each (`Human:` / `Assistant:`), read as turns
        row = {**row, "chosen": dialogs[0], "rejected": dialogs[1]}
    chosen = _completion(row["chosen"], "chosen", where)
    rejected = _completion(row["rejected"], "rejected", where)
    if row.get("prompt") is not None:  # TRL explicit
        if isinstance(row["prompt"], str) and all(isinstance(c, list) and c[0]["role"] != "assistant"
                                                  for c in (chosen, rejected)):
            # whole conversations beside a text prompt (HuggingFaceH4/ultrafeedback_binarized): TRL's
            # maybe_extract_prompt reads the prompt off the conversations, as for the implicit shape
            return _implicit(row, where, rest)
        prompt = row["prompt"] if isinstance(row["prompt"], str) else _messages(row["prompt"], "prompt", where)
        return _sides(prompt, chosen, rejected, rest)
    for key in ("messages", "conversations"):  # axolotl chat_template.default, LLaMA-Factory sharegpt
        if row.get(key) is not None:
            prompt = _messages(row[key], key, where)
            if row.get("system") and prompt[0]["role"] != "system":
                prompt = [{"role": "system", "content": row["system"]}, *prompt]
            return _sides(prompt, chosen, rejected, rest)
    if row.get("instruction") is not None:  # LLaMA-Factory alpaca
        return _sides(_alpaca_prompt(row, where), chosen, rejected, rest)
    _by_roles(row, where)
    return _implicit(row, where, rest)


def pair_rows(row: dict[str, Any], source: Source, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A preference stage's source row as its chosen and rejected rows, each mapped as any row is
    (`toolkit.data.shapes.shape_row`) after the entry's columns and ignore keys (`prepare_row`): what its store
    encodes, two rows per source row. A row that is no pair is refused in one line, and so is a pair with an image
    or video placeholder in a completion (media are the shared prompt's). A vision pair's `images` and `videos` go
    to both sides (`_sides` keeps the row's other keys on each): the encoder checks that the prompt's `<image>` /
    `<video>` placeholders match them, side by side (a video's frames come from the frame store, sampled once), and
    the collator passes their pixels once per pair (toolkit/data/collate.py `PairCollator`)."""
    row, original = prepare_row(row, source, where)
    if not is_pair(row):
        raise ToolkitError(f"{where}: {NOT_A_PAIR}; the row has keys {original}.")
    chosen, rejected = to_pair(row, where)
    for kind in ("image", "video"):
        if row.get(f"{kind}s") not in (None, []):
            for side, name in ((chosen, "chosen"), (rejected, "rejected")):
                if _shows(side["completion"], kind):
                    raise ToolkitError(f"{where}: the {name} completion holds {'an' if kind == 'image' else 'a'} "
                                       f"{kind}: {MEDIA_IN_COMPLETION}.")
    return (shape_row(chosen, source, where, original, tags={}),
            shape_row(rejected, source, where, original, tags={}))


def _shows(completion: list[dict[str, Any]] | str, kind: str) -> bool:
    """Whether a completion holds an image or a video (`kind`): its `<image>` / `<video>` tag in its text or its
    part (`image` / `image_url`, `video` / `video_url`) in its content."""
    def shows(content: Any) -> bool:
        if isinstance(content, str):
            return f"<{kind}>" in content
        return isinstance(content, list) and any(
            isinstance(p, dict) and (p.get("type") in (kind, f"{kind}_url") or shows(p.get("text"))) for p in content)

    if isinstance(completion, str):
        return shows(completion)
    return any(shows(m.get("content")) for m in completion)


@dataclass
class PairStats:
    """What happened to a stage's pairs."""

    pairs: int = 0
    kept: int = 0
    dropped_overlength: int = 0
    truncated: int = 0
    no_completion: int = 0


def _prompt_length(labels: list[int]) -> int:
    return next((i for i, y in enumerate(labels) if y != IGNORE_INDEX), len(labels))


def fit_pair(chosen: dict[str, list[int]], rejected: dict[str, list[int]], *, max_seq_len: int, overlength: str,
             where: str, stats: PairStats) -> tuple[dict[str, list[int]], dict[str, list[int]]] | None:
    """The pair's two encoded sides (`input_ids`, `labels`) within `max_seq_len` (module docstring), or None when
    dropped (counted in `stats`). Both sides must share the tokens before their first label: the prompt."""
    stats.pairs += 1
    cut = _prompt_length(chosen["labels"])
    if cut != _prompt_length(rejected["labels"]) or chosen["input_ids"][:cut] != rejected["input_ids"][:cut]:
        raise ValueError(f"{where}: the chosen and rejected sides render different prompts")
    if cut >= len(chosen["labels"]) or cut >= len(rejected["labels"]):
        stats.no_completion += 1
        return None
    longest = max(len(chosen["input_ids"]), len(rejected["input_ids"]))
    if longest > max_seq_len:
        if overlength == "error":
            raise ToolkitError(overlength_message(where, longest, max_seq_len))
        if overlength == "drop":
            stats.dropped_overlength += 1
            return None
        stats.truncated += 1
        skip = min(longest - max_seq_len, max(cut - 1, 0))  # the prompt's start goes first; one token stays

        def fit(side: dict[str, list[int]]) -> dict[str, list[int]]:
            return {"input_ids": side["input_ids"][skip:skip + max_seq_len],
                    "labels": side["labels"][skip:skip + max_seq_len]}

        chosen, rejected = fit(chosen), fit(rejected)
        if any(all(y == IGNORE_INDEX for y in side["labels"]) for side in (chosen, rejected)):
            stats.no_completion += 1
            return None
    stats.kept += 1
    return chosen, rejected
