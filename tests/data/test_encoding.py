"""Tests for the data layer (toolkit/data/): JSONL reading, loss masks with the tiny ChatML tokenizer, length
policy, collator."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from toolkit.builtin.text_model import build_tokenizer
from toolkit.data.collate import padding_collator
from toolkit.data.encoding import IGNORE_INDEX, encode_row, has_generation_tags
from toolkit.data.plan import encode_files
from toolkit.data.sources import iter_jsonl, resolve_data_paths
from toolkit.errors import ToolkitError
from toolkit.templates import CHATML_TEMPLATE

PAD_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# The tiny template without its {% generation %} markers: plain ChatML, which forces the prefix-diff path.
PLAIN_CHATML = CHATML_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")

CHAT = [
    {"role": "system", "content": "You are a helpful math tutor."},
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "17 + 25 = 42."},
]
MULTI = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8."},
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the ChatML template (data.chat_template: chatml): {% generation %} markers."""
    return build_tokenizer(CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tok(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    other = copy.deepcopy(tok)
    other.chat_template = PLAIN_CHATML
    return other


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trained(ids: list[int], labels: list[int]) -> list[int]:
    return [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]


def _check_labels_match_ids(ids: list[int], labels: list[int]) -> None:
    assert len(ids) == len(labels)
    for t, lab in zip(ids, labels, strict=True):
        assert lab in (IGNORE_INDEX, t)


def _load(paths: list[Path], tok: PreTrainedTokenizerFast, *, max_seq_len: int = 512, overlength: str = "drop",
          train_on: str = "assistant"):
    return encode_files(paths, tok, max_seq_len=max_seq_len, overlength=overlength, train_on=train_on)


# --- chat rows ---------------------------------------------------------------------------------------------------


def test_template_flavours(tok: PreTrainedTokenizerFast, plain_tok: PreTrainedTokenizerFast) -> None:
    assert has_generation_tags(tok) is True
    assert has_generation_tags(plain_tok) is False
    no_template = copy.deepcopy(tok)
    no_template.chat_template = None
    assert has_generation_tags(no_template) is False
    spaced = copy.deepcopy(tok)
    spaced.chat_template = CHATML_TEMPLATE.replace("{%- generation %}", "{% generation -%}")
    assert has_generation_tags(spaced) is True


def test_chat_row_trains_exactly_assistant_content(tok: PreTrainedTokenizerFast) -> None:
    ids, labels = encode_row({"messages": CHAT}, tok, "assistant", "f:1")
    assert ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    _check_labels_match_ids(ids, labels)
    trained = _trained(ids, labels)
    assert tok.decode(trained) == "17 + 25 = 42.<|im_end|>"
    assert trained == [*tok.encode("17 + 25 = 42.", add_special_tokens=False), IM_END_ID]
    # The trained span is one contiguous run that ends on <|im_end|>, followed only by the untrained "\n".
    positions = [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX]
    assert positions == list(range(positions[0], positions[0] + len(trained)))
    assert ids[positions[-1]] == IM_END_ID
    assert positions[-1] == len(ids) - 2 and tok.decode(ids[-1:]) == "\n"
    assert labels[0] == IGNORE_INDEX


def test_multi_turn_trains_both_assistant_turns_only(tok: PreTrainedTokenizerFast) -> None:
    ids, labels = encode_row({"messages": MULTI}, tok, "assistant", "f:1")
    _check_labels_match_ids(ids, labels)
    assert tok.decode(_trained(ids, labels)) == "5.<|im_end|>It is 8.<|im_end|>"
    # Decode each maximal run of trained tokens separately: one run per assistant turn.
    runs, current = [], []
    for t, lab in zip(ids, labels, strict=True):
        if lab != IGNORE_INDEX:
            current.append(t)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    assert runs == ["5.<|im_end|>", "It is 8.<|im_end|>"]
    untrained = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX])
    assert "What is 2 + 3?" in untrained and "And 4 + 4?" in untrained
    assert ids.count(IM_END_ID) == 4 and _trained(ids, labels).count(IM_END_ID) == 2


def test_train_on_all_trains_every_token_but_first(tok: PreTrainedTokenizerFast) -> None:
    ids, labels = encode_row({"messages": CHAT}, tok, "all", "f:1")
    assert ids == encode_row({"messages": CHAT}, tok, "assistant", "f:1")[0]
    assert labels == [IGNORE_INDEX, *ids[1:]]
    assert ids[0] == IM_START_ID


def test_prefix_diff_path_matches_generation_tags(tok: PreTrainedTokenizerFast,
                                                  plain_tok: PreTrainedTokenizerFast) -> None:
    """A template without generation markers (prefix-diff path) trains exactly the same tokens as the marked
    one: each assistant turn's content and its <|im_end|>, not the newline the template renders after it."""
    for messages in (CHAT, MULTI):
        ids_gen, labels_gen = encode_row({"messages": messages}, tok, "assistant", "f:1")
        ids_diff, labels_diff = encode_row({"messages": messages}, plain_tok, "assistant", "f:1")
        assert ids_diff == ids_gen
        _check_labels_match_ids(ids_diff, labels_diff)
        assert labels_diff == labels_gen


def test_prefix_diff_train_on_all_matches(tok: PreTrainedTokenizerFast, plain_tok: PreTrainedTokenizerFast) -> None:
    assert encode_row({"messages": MULTI}, plain_tok, "all", "f:1") == encode_row({"messages": MULTI}, tok, "all",
                                                                                    "f:1")


# A template with neither ChatML turns nor generation markers (Llama-2 style [INST] turns).
INST = ("{%- for m in messages %}{%- if m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' </s>' }}"
        "{%- else %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{%- endif %}{%- endfor %}")


def test_prefix_diff_path_for_other_template_families(tok: PreTrainedTokenizerFast) -> None:
    """A prefix-stable template that is not ChatML-shaped is masked by rendering prefixes."""
    inst = copy.deepcopy(tok)
    inst.chat_template = INST
    ids, labels = encode_row({"messages": MULTI}, inst, "assistant", "f:1")
    assert ids == tok.encode(inst.apply_chat_template(MULTI, tokenize=False), add_special_tokens=False)
    assert tok.decode(_trained(ids, labels)) == " 5. </s> It is 8. </s>"


def test_prefix_diff_rejects_unstable_template(tok: PreTrainedTokenizerFast) -> None:
    unstable = copy.deepcopy(tok)
    # Renders the number of messages first, so a shorter conversation is not a prefix of a longer one.
    unstable.chat_template = "{{ messages | length }}" + INST
    with pytest.raises(ToolkitError, match=r"f:7: the chat template is not prefix-stable"):
        encode_row({"messages": CHAT}, unstable, "assistant", "f:7")


# --- prompt/completion and text rows ------------------------------------------------------------------------------


def test_prompt_completion_trains_completion_and_eos(tok: PreTrainedTokenizerFast) -> None:
    row = {"prompt": "What is 2 + 3?", "completion": " 5."}
    ids, labels = encode_row(row, tok, "assistant", "f:1")
    prompt = tok.encode("What is 2 + 3?", add_special_tokens=False)
    completion = tok.encode(" 5.", add_special_tokens=False)
    assert ids == prompt + completion + [IM_END_ID]
    assert labels == [IGNORE_INDEX] * len(prompt) + completion + [IM_END_ID]
    assert tok.decode(_trained(ids, labels)) == " 5.<|im_end|>"


def test_prompt_completion_train_on_all(tok: PreTrainedTokenizerFast) -> None:
    ids, labels = encode_row({"prompt": "What is 2 + 3?", "completion": " 5."}, tok, "all", "f:1")
    assert labels == [IGNORE_INDEX, *ids[1:]]


def test_text_row_trains_all_but_first(tok: PreTrainedTokenizerFast) -> None:
    ids, labels = encode_row({"text": "the quick brown fox"}, tok, "assistant", "f:1")
    assert ids == [*tok.encode("the quick brown fox", add_special_tokens=False), IM_END_ID]
    assert labels == [IGNORE_INDEX, *ids[1:]]
    assert encode_row({"text": "the quick brown fox"}, tok, "all", "f:1") == (ids, labels)


@pytest.mark.parametrize("row", [
    {"messages": CHAT},
    {"prompt": "a", "completion": "b"},
    {"text": "x"},
])
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_first_label_always_ignored(tok: PreTrainedTokenizerFast, row: dict[str, Any], train_on: str) -> None:
    ids, labels = encode_row(row, tok, train_on, "f:1")
    assert labels[0] == IGNORE_INDEX
    assert len(ids) == len(labels)


def test_encode_row_does_not_alias_ids_and_labels(tok: PreTrainedTokenizerFast) -> None:
    for row in ({"messages": CHAT}, {"text": "the cat"}, {"prompt": "a", "completion": "b"}):
        ids, labels = encode_row(row, tok, "all", "f:1")
        assert ids[0] != IGNORE_INDEX and labels[0] == IGNORE_INDEX
        assert ids is not labels


# --- row validation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "match"), [
    ({"foo": 1, "bar": 2}, r"f:4: a row needs 'messages', 'prompt' and 'completion', or 'text'; found keys \['bar'"),
    ({"prompt": "only a prompt"}, r"f:4: a row needs"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, r"f:4: messages\[0\] must have a role"),
    ({"messages": [{"role": "user", "content": 5}]}, r"f:4: messages\[0\] must have a role"),
    ({"messages": []}, r"f:4: 'messages' must be a non-empty list"),
    ({"messages": "hello"}, r"f:4: 'messages' must be a non-empty list"),
    ({"prompt": 1, "completion": "x"}, r"f:4: 'prompt' and 'completion' must be strings"),
    ({"text": ["a"]}, r"f:4: 'text' must be a string"),
])
def test_bad_rows_are_toolkit_errors(tok: PreTrainedTokenizerFast, row: dict[str, Any], match: str) -> None:
    with pytest.raises(ToolkitError, match=match):
        encode_row(row, tok, "assistant", "f:4")


def test_messages_without_chat_template(tok: PreTrainedTokenizerFast) -> None:
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(ToolkitError, match=r"f:2: .*chat_template"):
        encode_row({"messages": CHAT}, bare, "assistant", "f:2")
    # Non-chat rows still work without a template.
    assert encode_row({"text": "the cat"}, bare, "assistant", "f:2")[0][-1] == IM_END_ID


# --- JSONL reading -----------------------------------------------------------------------------------------------


def test_iter_jsonl_skips_blank_lines_and_numbers_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n')
    assert list(iter_jsonl(path)) == [(1, {"text": "a"}), (4, {"text": "b"})]


def test_malformed_json_names_file_and_line(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"\n{"text": "c"}\n')
    with pytest.raises(ToolkitError, match="not valid JSON") as info:
        _load([path], tok)
    assert f"{path}:3:" in str(info.value)
    # Where on the line: json counts the line's own newline as a line of its own ("line 2 column 1"), so a row cut
    # short used to be reported "at column 1" (hostile pass); it is at the end of the line, and a bad character
    # inside it is at its column.
    assert "(Expecting ',' delimiter at the end of the line)" in str(info.value)
    path.write_text('{"text": "a"}\n{"text": \'b\'}\n')
    with pytest.raises(ToolkitError, match=r":2: not valid JSON \(Expecting value at column 10\)"):
        _load([path], tok)
    # json's messages that end in "at" ("Unterminated string starting at") said "at at column" (hostile pass).
    path.write_text('{"text": "a"}\n{"text": "b')
    with pytest.raises(ToolkitError, match=r":2: not valid JSON \(Unterminated string starting at column 10\)"):
        _load([path], tok)
    array = tmp_path / "bad.json"
    array.write_text('[{"text": "a\tb"}]')
    with pytest.raises(ToolkitError, match=r"not valid JSON \(Invalid control character at line 1, column 13\)"):
        _load([array], tok)


def test_json_list_row_is_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "l.jsonl", [{"text": "a"}, ["text", "b"]])
    with pytest.raises(ToolkitError, match="must be a JSON object, got list") as info:
        list(iter_jsonl(path))
    assert f"{path}:2:" in str(info.value)


def test_row_without_known_keys_in_file(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "k.jsonl", [{"text": "a"}, {"question": "q", "answer": "a"}])
    with pytest.raises(ToolkitError, match=r"found keys \['answer', 'question'\]") as info:
        _load([path], tok)
    assert f"{path}:2:" in str(info.value)


def test_bad_role_in_file(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "narrator", "content": "x"}]}])
    with pytest.raises(ToolkitError, match="must have a role") as info:
        _load([path], tok)
    assert f"{path}:1:" in str(info.value)


def test_missing_file_is_error(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ToolkitError, match="does not exist") as info:
        _load([missing], tok)
    assert str(missing) in str(info.value)


def test_resolve_data_paths() -> None:
    assert resolve_data_paths(["dummy:stage1", "a/b.jsonl"], Path("/d")) == [Path("/d/stage1.jsonl"),
                                                                             Path("a/b.jsonl")]
    assert resolve_data_paths([], Path("/d")) == []


# --- encode_files: stats and length policy ---------------------------------------------------------------------


def test_encode_files_stats_and_difficulty(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", [{"messages": CHAT, "difficulty": 2}, {"text": "the cat", "id": "t"}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "What is 2 + 3?", "completion": " 5."}])
    data = _load([a, b], tok)
    expected = [encode_row({"messages": CHAT}, tok, "assistant", ""),
                encode_row({"text": "the cat"}, tok, "assistant", ""),
                encode_row({"prompt": "What is 2 + 3?", "completion": " 5."}, tok, "assistant", "")]
    assert data.samples == [{"input_ids": i, "labels": lab} for i, lab in expected]
    assert data.difficulty == [2, None, None]
    st = data.stats
    assert (st.rows, st.kept, st.dropped_overlength, st.truncated, st.no_label_tokens) == (3, 3, 0, 0, 0)
    assert st.tokens == sum(len(i) for i, _ in expected)
    assert st.label_tokens == sum(len(_trained(i, lab)) for i, lab in expected)
    assert st.summary().startswith(f"3 rows, 3 kept ({st.tokens} tokens, {st.label_tokens} trained)")


def _long_and_short(tmp_path: Path, tok: PreTrainedTokenizerFast) -> tuple[Path, int, int]:
    short = {"text": "the cat"}
    long = {"text": "the quick brown fox jumps over the lazy dog " * 4}
    n_short = len(encode_row(short, tok, "all", "")[0])
    n_long = len(encode_row(long, tok, "all", "")[0])
    return _write_jsonl(tmp_path / "len.jsonl", [short, long, short]), n_short, n_long


def test_overlength_drop(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path, n_short, n_long = _long_and_short(tmp_path, tok)
    assert n_short < 10 < n_long
    data = _load([path], tok, max_seq_len=10, overlength="drop")
    st = data.stats
    assert (st.rows, st.kept, st.dropped_overlength, st.truncated) == (3, 2, 1, 0)
    assert [len(s["input_ids"]) for s in data.samples] == [n_short, n_short]


def test_overlength_truncate(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path, n_short, _ = _long_and_short(tmp_path, tok)
    data = _load([path], tok, max_seq_len=10, overlength="truncate")
    st = data.stats
    assert (st.rows, st.kept, st.dropped_overlength, st.truncated) == (3, 3, 0, 1)
    full_ids, full_labels = encode_row({"text": "the quick brown fox jumps over the lazy dog " * 4}, tok, "all", "")
    assert data.samples[1] == {"input_ids": full_ids[:10], "labels": full_labels[:10]}
    assert st.tokens == 2 * n_short + 10


def test_overlength_exactly_max_is_kept(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path, n_short, _ = _long_and_short(tmp_path, tok)
    data = _load([path], tok, max_seq_len=n_short, overlength="drop")
    st = data.stats
    assert (st.rows, st.kept, st.dropped_overlength, st.truncated) == (3, 2, 1, 0)
    assert [len(s["input_ids"]) for s in data.samples] == [n_short, n_short]
    with pytest.raises(ToolkitError, match=f"over data.max_seq_len={n_short - 1}"):
        _load([path], tok, max_seq_len=n_short - 1, overlength="error")


def test_overlength_error_names_file_and_line(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path, _, n_long = _long_and_short(tmp_path, tok)
    with pytest.raises(ToolkitError, match=f"{n_long} tokens, over data.max_seq_len=10") as info:
        _load([path], tok, max_seq_len=10, overlength="error")
    assert str(info.value).startswith(f"{path}:2:")


def test_truncated_away_assistant_is_skipped(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    long_user = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 4},
                 {"role": "assistant", "content": "Sure."}]
    path = _write_jsonl(tmp_path / "t.jsonl", [{"messages": long_user}, {"messages": CHAT}])
    n_chat = len(encode_row({"messages": CHAT}, tok, "assistant", "")[0])
    data = _load([path], tok, max_seq_len=n_chat, overlength="truncate")
    st = data.stats
    # The first row is cut inside the user turn: it is counted as truncated and then skipped for having no loss.
    assert (st.rows, st.kept, st.truncated, st.no_label_tokens, st.dropped_overlength) == (2, 1, 1, 1, 0)
    assert data.samples == [dict(zip(("input_ids", "labels"), encode_row({"messages": CHAT}, tok, "assistant", ""),
                                     strict=True))]


def test_messages_without_assistant_is_skipped(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                               plain_tok: PreTrainedTokenizerFast) -> None:
    rows = [{"messages": CHAT[:2]}, {"messages": CHAT}]
    path = _write_jsonl(tmp_path / "n.jsonl", rows)
    for tokenizer in (tok, plain_tok):
        st = _load([path], tokenizer).stats
        assert (st.rows, st.kept, st.no_label_tokens) == (2, 1, 1)
    # With train_on=all the same row has loss and is kept.
    st = _load([path], tok, train_on="all").stats
    assert (st.rows, st.kept, st.no_label_tokens) == (2, 2, 0)


# --- collator ----------------------------------------------------------------------------------------------------


def test_collator_pads(tok: PreTrainedTokenizerFast) -> None:
    collate = padding_collator(tok)
    a_ids, a_labels = encode_row({"messages": CHAT}, tok, "assistant", "")
    b_ids, b_labels = encode_row({"text": "the cat"}, tok, "assistant", "")
    batch = collate([{"input_ids": a_ids, "labels": a_labels}, {"input_ids": b_ids, "labels": b_labels}])
    n, m = len(a_ids), len(b_ids)
    assert m < n
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, n)
    assert batch["input_ids"].tolist() == [a_ids, b_ids + [PAD_ID] * (n - m)]
    assert batch["labels"].tolist() == [a_labels, b_labels + [IGNORE_INDEX] * (n - m)]
    assert batch["attention_mask"].tolist() == [[1] * n, [1] * m + [0] * (n - m)]
    assert batch["input_ids"].dtype == torch.long


def test_collator_small_exact(tok: PreTrainedTokenizerFast) -> None:
    batch = padding_collator(tok)([{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]},
                                 {"input_ids": [8], "labels": [IGNORE_INDEX]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


# --- bytes that are not UTF-8, paths that are directories ---------------------------------------------------------


def test_non_utf8_bytes_name_file_line_and_offset(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = tmp_path / "latin1.jsonl"
    first = (json.dumps({"text": "caf\u00e9"}, ensure_ascii=False) + "\n").encode()
    path.write_bytes(first + b'{"text": "caf\xe9"}\n')
    with pytest.raises(ToolkitError) as info:
        _load([path], tok)
    offset = len(first) + len(b'{"text": "caf')
    assert str(info.value).startswith(f"{path}:2: byte 0xe9 at byte offset {offset} of the file is not UTF-8")


def test_data_path_that_is_a_directory(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ToolkitError, match=f"Data file {tmp_path} is a directory"):
        _load([tmp_path], tok)


# --- what trains: per-turn flags and row keys, honoured exactly or refused ----------------------------------------
# The stock Qwen templates (the ChatML span path, and VL rows) are in tests/data/test_qwen_templates.py; here the
# {% generation %} path (the tiny tokenizer's template) and the prefix-render path (INST).

def _weighted(messages: list[dict[str, Any]], **flags: Any) -> list[dict[str, Any]]:
    """`messages` with flags (e.g. weight=0) on the first assistant turn."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return [dict(m, **flags) if i == first else m for i, m in enumerate(messages)]


@pytest.mark.parametrize("flags", [{"weight": 0}, {"weight": 0.0}, {"training": False},
                                   {"weight": 0, "training": False}])
@pytest.mark.parametrize("template", ["generation", "prefix"])
def test_turn_left_out_by_its_flag(tok: PreTrainedTokenizerFast, template: str, flags: dict[str, Any]) -> None:
    t = copy.deepcopy(tok)
    if template == "prefix":
        t.chat_template = INST
    ids, labels = encode_row({"messages": _weighted(MULTI, **flags)}, t, "assistant", "f:1")
    plain_ids, plain_labels = encode_row({"messages": MULTI}, t, "assistant", "f:1")
    assert ids == plain_ids  # the flag changes what trains, never the rendering
    want = {"generation": "It is 8.<|im_end|>", "prefix": " It is 8. </s>"}[template]
    assert tok.decode(_trained(ids, labels)) == want
    kept = [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX]
    assert all(labels[i] == plain_labels[i] for i in kept)  # the turn that trains is masked exactly as before
    # Flags that say "train" (or a 0 on a turn that never trains) change nothing.
    for same in ({"weight": 1}, {"training": True}):
        assert encode_row({"messages": _weighted(MULTI, **same)}, t, "assistant", "f:1") == (plain_ids, plain_labels)
    user_zero = [dict(MULTI[0], weight=0), *MULTI[1:]]
    assert encode_row({"messages": user_zero}, t, "assistant", "f:1") == (plain_ids, plain_labels)


def test_every_turn_left_out_is_a_row_without_loss(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    rows = [{"messages": [dict(m, weight=0) if m["role"] == "assistant" else m for m in MULTI]}, {"messages": CHAT}]
    st = _load([_write_jsonl(tmp_path / "w.jsonl", rows)], tok).stats
    assert (st.rows, st.kept, st.no_label_tokens) == (2, 1, 1)


def test_generation_blocks_that_are_not_one_per_turn_refuse_weights(tok: PreTrainedTokenizerFast) -> None:
    """A template whose {% generation %} block covers only the last turn: its one mask run cannot be matched to
    two turns, so a weight is refused rather than guessed (without weights the template's mask is used as is)."""
    last_only = copy.deepcopy(tok)
    last_only.chat_template = (
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] == 'assistant' and loop.last %}{%- generation %}{{ m['content'] + '<|im_end|>' }}"
        "{%- endgeneration %}{%- else %}{{ m['content'] + '<|im_end|>' }}{%- endif %}{{ '\\n' }}{%- endfor %}")
    assert tok.decode(_trained(*encode_row({"messages": MULTI}, last_only, "assistant", "f:1"))) == \
        "It is 8.<|im_end|>"
    with pytest.raises(ToolkitError, match=r"^f:1: .*mark 1 span\(s\) for 2 assistant turn\(s\), so per-turn "
                                           r"weights cannot be applied exactly"):
        encode_row({"messages": _weighted(MULTI, weight=0)}, last_only, "assistant", "f:1")


@pytest.mark.parametrize(("messages", "train_on", "match"), [
    (_weighted(MULTI, weight=0.5), "assistant", r"messages\[1\]\.weight is 0\.5; only 0 .* or 1 .* is supported"),
    (_weighted(MULTI, weight=2), "assistant", r"messages\[1\]\.weight is 2; only 0"),
    (_weighted(MULTI, weight="0"), "assistant", r"messages\[1\]\.weight is '0'; only 0"),
    (_weighted(MULTI, weight=True), "assistant", r"messages\[1\]\.weight is True; only 0"),
    (_weighted(MULTI, training="no"), "assistant", r"messages\[1\]\.training is 'no'; it must be true or false"),
    (_weighted(MULTI, weight=1, training=False), "assistant", r"messages\[1\] has weight 1 and training False, "
                                                              "which disagree"),
    (_weighted(MULTI, train_detail=[{"begin_offset": 0, "end_offset": 1, "train": False}]), "assistant",
     r"messages\[1\]\.train_detail \(per-span training\) is not supported"),
    ([dict(MULTI[0], weight=1), *MULTI[1:]], "assistant", r"messages\[0\]\.weight asks a user turn to train, but "
                                                          "only assistant turns train"),
    ([dict(MULTI[0], training=True), *MULTI[1:]], "assistant", r"messages\[0\]\.training asks a user turn"),
    (_weighted(MULTI, weight=0), "all", r"messages\[1\]\.weight leaves the turn out of training, but "
                                        "data.train_on is all"),
    ([dict(MULTI[0], weight=0), *MULTI[1:]], "all", r"messages\[0\]\.weight leaves a user turn out of training"),
])
def test_turn_flags_that_cannot_be_honoured(tok: PreTrainedTokenizerFast, messages: list[dict[str, Any]],
                                            train_on: str, match: str) -> None:
    with pytest.raises(ToolkitError, match=rf"^f:3: {match}"):
        encode_row({"messages": messages}, tok, train_on, "f:3")


@pytest.mark.parametrize(("row", "match"), [
    ({"messages": CHAT, "text": "more"}, r"the row has 'messages', 'text', which are 2 row shapes; keep one"),
    ({"messages": CHAT, "prompt": "p", "completion": "c"}, r"the row has 'messages', 'prompt', 'completion', which"),
    ({"prompt": "p", "completion": "c", "text": "t"}, r"the row has 'prompt', 'completion', 'text', which are 2"),
    ({"prompt": "p", "text": "t"}, r"the row has 'prompt', 'text', which are 2 row shapes"),
    ({"text": "t", "weight": 2.0}, r"the row has 'weight': per-row loss weighting is not supported"),
    ({"messages": CHAT, "sample_weight": 0}, r"the row has 'sample_weight': per-row loss weighting"),
    ({"prompt": "p", "completion": "c", "label": False}, r"the row has a true/false 'label' \(KTO preference data\)"),
    ({"prompt": "p", "chosen": "a", "rejected": "b"}, r"the row has 'chosen': preference pairs train in a preference "
     r"stage: set the stage's objective: dpo"),
    ({"text": "t", "labels": [1, 2]}, r"the row has 'labels': pre-tokenised rows are not supported"),
    ({"messages": CHAT, "train_on": "all"}, r"the row has 'train_on': data.train_on sets it for every row"),
    ({"messages": CHAT, "system": "Be brief."}, r"the row has 'system': put the system prompt as the first message"),
    ({"text": "t", "tools": [{"type": "function"}]}, r"the row has 'tools', which needs a chat \('messages'\)"),
    ({"messages": CHAT, "images": ["a.png"]}, r"the row has 'images', which needs a vision-language model"),
    ({"messages": CHAT, "videos": ["a.mp4"]}, r"the row has 'videos', which needs a vision-language model"),
])
def test_row_keys_that_would_be_ignored_are_refused(tok: PreTrainedTokenizerFast, row: dict[str, Any],
                                                    match: str) -> None:
    with pytest.raises(ToolkitError, match=rf"^f:5: {match}"):
        encode_row(row, tok, "assistant", "f:5")


def test_null_columns_and_plain_extras_are_not_keys(tok: PreTrainedTokenizerFast) -> None:
    """A null where another shape's key would be (a table of mixed rows), and extras that change nothing (an id, a
    class 'label' that is not a KTO true/false) train like the bare row."""
    plain = encode_row({"messages": CHAT}, tok, "assistant", "f:1")
    assert encode_row({"messages": CHAT, "text": None, "prompt": None, "weight": None, "id": 7, "label": "math"},
                      tok, "assistant", "f:1") == plain


def test_the_size_guard_tokenises_what_max_seq_len_needs_not_its_floor(tok: PreTrainedTokenizerFast) -> None:
    """Issue 48: a pair of 100k short messages (3.5 MB) cost +290 MB: each side renders to 1.5M characters, over
    the guard's 1M-character floor, and the guard's first prefix (twice its limit) took the whole text, tokenised
    with offsets. The prefix now grows from a few characters per token max_seq_len needs: Python's allocations
    (the offsets and ids) stay under 1 MiB (some 40 MiB before), and the tokens are the text's own first ones."""
    import tracemalloc

    from toolkit.data.encoding import SizeGuard, TextEncoder, encode_with_offsets

    guard = SizeGuard(TextEncoder(tok, train_on="assistant"), 128)
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n" * 25_000
    assert guard.limit is not None and len(text) > guard.limit  # (the vocabulary scan done before measuring)
    tracemalloc.start()
    [(ids, _, _)], long = guard.encode_with_offsets([text])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert long == {0} and len(ids) > 2 * 129
    assert peak < 1 << 20, peak / 2**20
    assert ids[:129].tolist() == encode_with_offsets(tok, [text[:20_000]])[0][0][:129].tolist()
