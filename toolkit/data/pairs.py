"""Preference pairs: every peer's pair shape mapped to two rows that share a prompt, and a pair's token fit.

A pair becomes a chosen row and a rejected row in TRL's prompt/completion shape (the shape `toolkit/data/shapes.py`
already reads: a string prompt and completion, or lists of messages where only the completion trains), so each side
is rendered and masked by the encoder like any other row. The shapes are rows of the role table
(toolkit/data/roles.py PAIR_SHAPES: role -> key, the roles that make the shape, its reader), read by one path
(`to_pair`); they are (docs/preference.md):

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
  `rejected_messages` (the whole rejected conversation); its `rejected_images` / `rejected_videos` /
  `rejected_audios` (the rejected side's media, which ms-swift asks for beside `rejected_messages`) are read by
  `shared_media`: the row's own media again, or refused.
* axolotl `chat_template.default`: `messages` (the prompt) with `chosen` / `rejected` one assistant message each.

The fit (`fit_pair`): the two encoded sides share their prompt tokens. Over `max_seq_len`, `overlength: error`
raises, `drop` drops the pair, `truncate` cuts the prompt first (from its start, keeping the turns nearest the
completion, down to one token) and then the completions' ends. A pair left without a completion token on either side
is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolkit.data import roles as vocab
from toolkit.data.encoding import IGNORE_INDEX, overlength_message
from toolkit.data.roles import split_dialog
from toolkit.data.shapes import ROLE_NAMES, mapped_roles, prepare_row, shape_row
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
MEDIA_KEYS = ("images", "videos", "audios")
"""A row's media keys; ms-swift names the rejected side's own as `rejected_<key>`."""


def pair_shape(keys: list[str]) -> tuple[str, list[str]] | None:
    """The pair shape (toolkit/data/roles.py PAIR_SHAPES) that reads a row of these keys, and the keys that make it;
    None for a row that is no pair."""
    found = vocab.pair_shape_of(dict.fromkeys(keys, True))
    if found is None:
        return None
    name, roles, _ = found
    made = next(m for n, _, m, _ in vocab.PAIR_SHAPES if n == name)
    return name, [roles[r] for r in made]


def is_pair(row: dict[str, Any]) -> bool:
    """Whether the row is a preference pair (holds a preference side of some pair shape, PAIR_KEYS)."""
    return any(row.get(k) is not None for k in vocab.pair_side_keys())


def _message(turn: Any, at: str, where: str) -> dict[str, Any]:
    """A turn as an OpenAI message: `{role, content}` as it is; other turn keys (ShareGPT's `from` / `value`, any
    role-like and content-like keys, toolkit/data/roles.py `turn_keys`) with a known role name mapped."""
    if isinstance(turn, dict) and "role" in turn and "content" in turn:
        return dict(turn)
    keys = vocab.turn_keys(turn) if isinstance(turn, dict) else None
    name = turn.get(keys[0]) if keys is not None else None
    role = (ROLE_NAMES.get(name) or vocab.speaker(name)) if isinstance(name, str) else None
    if keys is not None and role is not None:
        rest = {k: v for k, v in turn.items() if k not in keys}
        return {"role": role, "content": turn[keys[1]], **rest}
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


def _implicit(chosen: Any, rejected: Any, where: str, rest: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Whole conversations (or texts) whose shared start is the prompt (TRL's extract_prompt)."""
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


def _exchange_prompt(row: dict[str, Any], keys: dict[str, str], where: str) -> list[dict[str, Any]]:
    """The prompt of an exchange (LLaMA-Factory's alpaca ranking): system, history ([[query, answer], ...]), the
    prompt with its context."""
    messages = [{"role": "system", "content": row[keys["system"]]}] if row.get(keys["system"]) else []
    for i, turn in enumerate(row.get(keys["history"]) or []):
        if not (isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise ToolkitError(f"{where}: {keys['history']}[{i}] must be a [query, answer] pair of strings.")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    if not isinstance(row.get(keys["prompt"]), str):
        raise ToolkitError(f"{where}: '{keys['prompt']}' must be a string (LLaMA-Factory's alpaca ranking shape).")
    context = row.get(keys["context"])
    query = row[keys["prompt"]] + (f"\n{context}" if context else "")
    return [*messages, {"role": "user", "content": query}]


def _from_input_object(row: dict[str, Any], keys: dict[str, str], where: str) -> dict[str, Any]:
    """OpenAI's preference fine-tuning row (the prompt an object: {messages, tools, parallel_tool_calls}; each side
    one assistant message, in a list) as the row of the turns' shape: `messages` (the prompt), `chosen`, `rejected`,
    and the object's `tools`."""
    given, name = row.get(keys["prompt"]), "OpenAI's preference format"
    if not isinstance(given, dict) or not isinstance(given.get("messages"), list):
        raise ToolkitError(f"{where}: '{keys['prompt']}' must be an object with 'messages' ({name}).")
    sides = {}
    for side in ("chosen", "rejected"):
        value = row.get(keys[side])
        if not isinstance(value, list) or len(value) != 1:
            raise ToolkitError(f"{where}: '{keys[side]}' must be a list of one assistant message ({name}).")
        sides[side] = value
    rest = {k: v for k, v in row.items() if k not in keys.values()}
    tools = given.get("tools")
    return {**rest, **({"tools": tools} if tools else {}), "messages": given["messages"], **sides}


def _by_roles(row: dict[str, Any], where: str, roles: dict[str, str] | None) -> None:
    """A pair whose prompt (and system) are under other names (Intel/orca_dpo_pairs' `system` / `question`) is
    refused with the entry that reads it by their roles (the file's, toolkit/data/roles.py `file_roles`, else the
    row's): the question as LLaMA-Factory's alpaca ranking `instruction`, its `system` read beside it."""
    from toolkit.data.shapes import ShapeError, holds_content

    rest = {k: v for k, v in row.items() if k not in (*vocab.pair_side_keys(), "system") and not k.startswith("_")}
    mine = vocab.infer_roles(rest, holds_content)
    roles = {k: (roles or {}).get(k, r) for k, r in mine.items()}
    asked = [k for k, r in roles.items() if r in ("prompt", "turns")]
    if len(asked) == 1 and roles[asked[0]] == "prompt" and isinstance(row[asked[0]], str):
        raise ShapeError(f"{where}: the pair's prompt is '{asked[0]}' (a {roles[asked[0]]} by its name), which no pair "
                         "shape names; read it as the alpaca ranking shape's instruction"
                         f"{' beside its system' if row.get('system') else ''}.",
                         {"columns": {"instruction": asked[0]}})


def _one_side(row: dict[str, Any], where: str) -> None:
    """Refuse a row that holds a preference side of some pair shape but not all of its keys: the shape that misses
    the fewest, naming what is missing."""
    near = [(sum(row.get(keys[r]) is None for r in made), name, keys, made) for name, keys, made, _ in vocab.PAIR_SHAPES
            if any(row.get(keys[r]) is not None for r in ("chosen", "rejected") if r in keys)]
    if not near:
        raise ToolkitError(f"{where}: {NOT_A_PAIR}; the row has keys {sorted(row)}.")
    _, name, keys, made = min(near, key=lambda n: n[0])
    missing = next(keys[r] for r in made if row.get(keys[r]) is None)
    sides = " and ".join(f"'{keys[r]}'" for r in ("chosen", "rejected") if r in keys)
    raise ToolkitError(f"{where}: a preference pair needs {sides} ({name}: {', '.join(keys[r] for r in made)}); "
                       f"'{missing}' is missing.")


def to_pair(row: dict[str, Any], where: str, roles: dict[str, str] | None = None
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (chosen, rejected) rows of a pair row, read by the roles of its pair shape (toolkit/data/roles.py
    PAIR_SHAPES: the first row of the table whose making keys the row holds decides the keys and the reader), one
    path for every shape; an unreadable pair gets one line. `roles` are the file's column roles (`file_roles`),
    which the refusal of a prompt under another name advises by."""
    shape = vocab.pair_shape_of(row)
    if shape is None:
        _one_side(row, where)
    _, keys, reader = shape  # type: ignore[misc]
    if reader == "input object":
        return to_pair(_from_input_object(row, keys, where), where, roles)
    taken = {k for _, ks, _, _ in vocab.PAIR_SHAPES for k in ks.values()}
    rest = {k: v for k, v in row.items() if k not in taken}
    if reader == "last turn":  # the turns end with the chosen answer; the rejected side replaces it
        turns = _messages(row.get(keys["turns"]), keys["turns"], where)
        if turns[-1]["role"] != "assistant":
            raise ToolkitError(f"{where}: '{keys['turns']}' must end with the chosen assistant turn (ms-swift's "
                               "shape).")
        other = row[keys["rejected"]]
        if isinstance(other, list):  # the whole rejected chat
            rejected = _messages(other, keys["rejected"], where)
            if rejected[:-1] != turns[:-1] or rejected[-1]["role"] != "assistant":
                raise ToolkitError(f"{where}: '{keys['rejected']}' must be '{keys['turns']}' with another last "
                                   "assistant turn (ms-swift's shape).")
            return _sides(turns[:-1], turns[-1:], rejected[-1:], rest)
        if not isinstance(other, str):
            raise ToolkitError(f"{where}: '{keys['rejected']}' must be a string (ms-swift's shape).")
        return _sides(turns[:-1], turns[-1:], other, rest)
    given = [row[keys["chosen"]], row[keys["rejected"]]]
    dialogs = [split_dialog(v) for v in given]
    if all(dialogs):  # Anthropic HH: whole dialogs in one string each (`Human:` / `Assistant:`), read as turns
        given = dialogs
    if reader == "shared start":
        _by_roles(row, where, roles)
        return _implicit(*given, where, rest)
    chosen, rejected = _completion(given[0], "chosen", where), _completion(given[1], "rejected", where)
    if reader == "prompt":
        prompt = row[keys["prompt"]]
        if isinstance(prompt, str) and all(isinstance(c, list) and c[0]["role"] != "assistant"
                                           for c in (chosen, rejected)):
            # whole conversations beside a text prompt (HuggingFaceH4/ultrafeedback_binarized): TRL's
            # maybe_extract_prompt reads the prompt off the conversations, as for the implicit shape
            return _implicit(*given, where, rest)
        prompt = prompt if isinstance(prompt, str) else _messages(prompt, keys["prompt"], where)
        return _sides(prompt, chosen, rejected, rest)
    if reader == "turns":  # the chat before the answers, its system first
        prompt = _messages(row[keys["turns"]], keys["turns"], where)
        system = row.get(keys["system"]) if "system" in keys else None
        if system and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system}, *prompt]
        return _sides(prompt, chosen, rejected, rest)
    if reader == "exchange":
        return _sides(_exchange_prompt(row, keys, where), chosen, rejected, rest)
    raise ValueError(f"pair shape reader {reader!r} is not one of toolkit/data/pairs.py's")


def shared_media(row: dict[str, Any], where: str) -> dict[str, Any]:
    """The row without ms-swift's `rejected_images` / `rejected_videos` / `rejected_audios` when each is the row's
    own `images` / `videos` / `audios` again (ms-swift >= 3.8 asks for them beside `rejected_messages`, the same
    files for a pair of answers to one picture): the media both sides share, read once, as the prompt's. Media of
    the rejected side that differ (ms-swift's image-preference rows: one answer, two pictures) are refused in one
    line: a pair here is two answers to one prompt, and its media are that prompt's."""
    for media in MEDIA_KEYS:
        key = f"rejected_{media}"
        if row.get(key) is None:
            continue
        if row[key] != row.get(media):
            raise ToolkitError(f"{where}: '{key}' is not the row's '{media}' ({str(row[key])[:60]} against "
                               f"{str(row.get(media))[:60]}): a pair whose sides show different media is not built; a "
                               "pair's images and videos belong to its prompt, which both sides share.")
        row = {k: v for k, v in row.items() if k != key}
    return row


def pair_rows(row: dict[str, Any], source: Source, where: str, roles: dict[str, str] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A preference stage's source row as its chosen and rejected rows, each mapped as any row is
    (`toolkit.data.shapes.shape_row`) after the entry's columns and ignore keys (`prepare_row`): what its store
    encodes, two rows per source row. A row that is no pair is refused in one line, and so is a pair with an image
    or video placeholder in a completion, or other media on its rejected side (`shared_media`: media are the shared
    prompt's). A vision pair's `images` and `videos` go
    to both sides (`_sides` keeps the row's other keys on each): the encoder checks that the prompt's `<image>` /
    `<video>` placeholders match them, side by side (a video's frames come from the frame store, sampled once), and
    the collator passes their pixels once per pair (toolkit/data/collate.py `PairCollator`). `roles` are the file's
    column roles (`file_roles`, by its stored names), which refusals advise by."""
    row, original = prepare_row(row, source, where)
    row = shared_media(row, where)
    if not is_pair(row):
        raise ToolkitError(f"{where}: {NOT_A_PAIR}; the row has keys {original}.")
    chosen, rejected = to_pair(row, where, mapped_roles(roles, source))
    if any(row.get(media) not in (None, []) for media in MEDIA_KEYS):  # a placeholder of either kind: VideoDPO's
        for kind in ("image", "video"):  # rows tag the frames of their answer videos `<image>` beside `videos`
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
