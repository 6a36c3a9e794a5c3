"""Preference pairs (toolkit/data/pairs.py): every peer's pair shape gives the same chosen and rejected rows, which
render through the shapes and the encoder to two sequences sharing their prompt tokens; the fit under max_seq_len
cuts the prompt first and drops (and counts) a pair without a completion.

The rows follow each tool's documented shape: TRL's preference dataset formats (docs "Dataset formats and types"),
LLaMA-Factory's data/README.md ranking entries (dpo_en_demo.json), ms-swift's custom dataset docs (DPO:
`rejected_response`), axolotl's rlhf docs (`chat_template.default`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer
from trl.data_utils import apply_chat_template

from toolkit.config.schema import DataEntry, Recipe
from toolkit.data.encoding import IGNORE_INDEX, TextEncoder, encode_row
from toolkit.data.pairs import PairStats, fit_pair, is_pair, to_pair
from toolkit.data.shapes import to_messages
from toolkit.data.sources import resolve_source
from toolkit.errors import ToolkitError

Q, GOOD, BAD = "What is the capital of France?", "Paris.", "Lyon, I think."
USER = {"role": "user", "content": Q}

CONVERSATIONAL = {
    "trl explicit": {"prompt": [USER], "chosen": [{"role": "assistant", "content": GOOD}],
                     "rejected": [{"role": "assistant", "content": BAD}]},
    "trl implicit": {"chosen": [USER, {"role": "assistant", "content": GOOD}],
                     "rejected": [USER, {"role": "assistant", "content": BAD}]},
    "llama-factory sharegpt": {"conversations": [{"from": "human", "value": Q}],
                               "chosen": {"from": "gpt", "value": GOOD}, "rejected": {"from": "gpt", "value": BAD}},
    "llama-factory alpaca": {"instruction": Q, "input": "", "chosen": GOOD, "rejected": BAD},
    "ms-swift rejected_response": {"messages": [USER, {"role": "assistant", "content": GOOD}],
                                   "rejected_response": BAD},
    "ms-swift rejected_messages": {"messages": [USER, {"role": "assistant", "content": GOOD}],
                                   "rejected_messages": [USER, {"role": "assistant", "content": BAD}]},
    "axolotl chat_template.default": {"messages": [USER], "chosen": {"role": "assistant", "content": GOOD},
                                      "rejected": {"role": "assistant", "content": BAD}},
}


@pytest.fixture(scope="module")
def tokenizer(models: dict[str, str]) -> Any:
    return AutoTokenizer.from_pretrained(models["text"])


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text(json.dumps(CONVERSATIONAL["trl explicit"]) + "\n")
    return resolve_source(DataEntry(str(path)), Path())


def encoded(side: dict[str, Any], source: Any, tokenizer: Any) -> dict[str, list[int]]:
    ids, labels = encode_row(to_messages(side, source, "pairs.jsonl:1"), tokenizer, "assistant", "pairs.jsonl:1")
    return {"input_ids": ids, "labels": labels}


def completion_text(side: dict[str, list[int]], tokenizer: Any) -> str:
    return tokenizer.decode([t for t, y in zip(side["input_ids"], side["labels"], strict=True) if y != IGNORE_INDEX])


@pytest.mark.parametrize("shape", list(CONVERSATIONAL))
def test_every_pair_shape_renders_the_same_two_sequences(shape: str, source: Any, tokenizer: Any) -> None:
    row = CONVERSATIONAL[shape]
    assert is_pair(row)
    expected = [encoded(s, source, tokenizer) for s in to_pair(CONVERSATIONAL["trl explicit"], "x")]
    chosen, rejected = (encoded(s, source, tokenizer) for s in to_pair(row, "pairs.jsonl:1"))
    assert [chosen, rejected] == expected
    assert GOOD in completion_text(chosen, tokenizer) and BAD in completion_text(rejected, tokenizer)
    assert Q not in completion_text(chosen, tokenizer)  # the prompt never trains
    stats = PairStats()
    assert fit_pair(chosen, rejected, max_seq_len=512, overlength="error", where="x", stats=stats) == (chosen,
                                                                                                      rejected)
    assert (stats.pairs, stats.kept) == (1, 1)


@pytest.mark.parametrize("newline", [False, True], ids=["default", "completion_newline"])
def test_a_completion_ends_at_im_end_or_with_trl_s_newline(newline: bool, source: Any, tokenizer: Any) -> None:
    """TRL cuts a conversational completion as the rendering of prompt + completion less that of the prompt with
    its generation header (trl.data_utils.apply_chat_template): through `<|im_end|>` and the newline after it. By
    default ours ends at `<|im_end|>`, as an SFT turn does; data.completion_newline trains TRL's tokens exactly."""
    row = CONVERSATIONAL["trl explicit"]
    trl_texts = apply_chat_template(row, tokenizer)
    encoder = TextEncoder(tokenizer, train_on="assistant", pairs=True, completion_newline=newline)
    sides = encoder.encode([to_messages(side, source, "x") for side in to_pair(row, "x")], [0, 1],
                           lambda _: "pairs.jsonl:1")
    for k, key in enumerate(("chosen", "rejected")):
        side = sides.sample(k)
        trained = [t for t, y in zip(side["input_ids"], side["labels"], strict=True) if y != IGNORE_INDEX]
        theirs = tokenizer(trl_texts[key], add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(theirs[-2:]) == "<|im_end|>\n"  # the newline TRL trains
        assert trained == (theirs if newline else theirs[:-1]), key
        prompt = tokenizer(trl_texts["prompt"], add_special_tokens=False)["input_ids"]
        assert side["input_ids"][:len(prompt)] == prompt  # the same prompt, so the same log-probs as TRL's
    assert encoder.options().get("completion_newline", False) is newline  # another store, never the same tokens


def test_completion_newline_without_a_pair_stage_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data\.completion_newline is true but no stage trains on preference pairs"):
        Recipe.model_validate({"data": {"completion_newline": True}, "stages": [{"name": "sft", "data": ["x"]}]})


def test_standard_text_pairs_stay_text_and_the_implicit_prompt_is_the_shared_prefix() -> None:
    explicit = to_pair({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, "x")
    assert explicit[0] == {"prompt": "The sky is", "completion": " blue."}
    implicit = to_pair({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "x")
    assert implicit == explicit  # TRL's extract_prompt: the space before the difference starts the completion
    with_history = to_pair({"instruction": "Add", "input": "2 and 2", "system": "Be brief.",
                            "history": [["Hi", "Hello."]], "chosen": "4", "rejected": "5"}, "x")
    assert with_history[1]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                         {"role": "assistant", "content": "Hello."},
                                         {"role": "user", "content": "Add\n2 and 2"}]
    assert with_history[1]["completion"] == [{"role": "assistant", "content": "5"}]


def test_the_prompt_is_cut_first_and_a_pair_without_a_completion_is_dropped(source: Any, tokenizer: Any) -> None:
    long_prompt = {"prompt": [{"role": "user", "content": "word " * 60 + Q}],
                   "chosen": [{"role": "assistant", "content": GOOD}],
                   "rejected": [{"role": "assistant", "content": BAD + " " + BAD}]}
    chosen, rejected = (encoded(s, source, tokenizer) for s in to_pair(long_prompt, "x"))
    longest = max(len(chosen["input_ids"]), len(rejected["input_ids"]))
    limit = longest - 20
    stats = PairStats()
    fitted = fit_pair(chosen, rejected, max_seq_len=limit, overlength="truncate", where="x", stats=stats)
    assert fitted is not None and stats.truncated == 1
    for before, after in zip((chosen, rejected), fitted, strict=True):
        assert after["input_ids"] == before["input_ids"][20:]  # 20 prompt tokens off its start, the completion whole
        assert completion_text(after, tokenizer) == completion_text(before, tokenizer)
    assert max(len(s["input_ids"]) for s in fitted) == limit
    assert fit_pair(chosen, rejected, max_seq_len=limit, overlength="drop", where="x", stats=stats) is None
    with pytest.raises(ToolkitError, match=r"over data\.max_seq_len"):
        fit_pair(chosen, rejected, max_seq_len=limit, overlength="error", where="x", stats=stats)
    short = fit_pair(chosen, rejected, max_seq_len=4, overlength="truncate", where="x", stats=stats)
    assert short is not None and all(len(s["input_ids"]) == 4 and s["labels"][0] == IGNORE_INDEX for s in short)
    assert fit_pair(chosen, rejected, max_seq_len=1, overlength="truncate", where="x", stats=stats) is None
    empty = {"input_ids": chosen["input_ids"][:5], "labels": [IGNORE_INDEX] * 5}
    assert fit_pair(empty, empty, max_seq_len=512, overlength="error", where="x", stats=stats) is None
    assert (stats.pairs, stats.kept, stats.dropped_overlength, stats.no_completion) == (6, 2, 1, 2)


@pytest.mark.parametrize("row, message", [
    ({"chosen": "a"}, "'rejected' is missing"),
    ({"messages": [USER], "rejected_response": BAD}, "must end with the chosen assistant turn"),
    ({"messages": [USER, {"role": "assistant", "content": GOOD}], "rejected_response": 3}, "must be a string"),
    ({"messages": [USER, {"role": "assistant", "content": GOOD}],
      "rejected_messages": [{"role": "user", "content": "other"}, {"role": "assistant", "content": BAD}]},
     "another last assistant turn"),
    ({"chosen": "same", "rejected": "same"}, "share no prompt"),
    ({"chosen": [{"role": "assistant", "content": GOOD}], "rejected": [{"role": "assistant", "content": BAD}]},
     "share no leading messages"),
    ({"prompt": [USER], "chosen": [{"speaker": "x"}], "rejected": BAD}, r"chosen\[0\] must be a message"),
    ({"instruction": 3, "chosen": GOOD, "rejected": BAD}, "'instruction' must be a string"),
])
def test_an_unreadable_pair_is_refused_in_one_line(row: dict[str, Any], message: str) -> None:
    with pytest.raises(ToolkitError, match=message):
        to_pair(row, "pairs.jsonl:3")


def test_the_role_table_decides_the_pair_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pair shapes are rows of the role table (toolkit/data/roles.py PAIR_SHAPES): a row of the table added for
    stack-exchange-paired's `question` / `response_j` / `response_k` columns (lvwerra/stack-exchange-paired's card:
    `response_j` the better answer) makes such a row a pair read by TRL's explicit reader, with no code path of its
    own; without the row it is no pair, and refused as one."""
    from toolkit.data import roles as vocab
    from toolkit.data.pairs import pair_shape

    row = {"qid": 7, "question": Q, "response_j": GOOD, "response_k": BAD, "metadata": ["https://example.org/q/7"]}
    assert not is_pair(row) and pair_shape(list(row)) is None
    with pytest.raises(ToolkitError, match=r"^x: the stage trains on preference pairs .* this row is no pair"):
        to_pair(row, "x")
    stack = ("stack-exchange-paired (a test's row)", {"prompt": "question", "chosen": "response_j",
                                                       "rejected": "response_k"}, ("prompt", "chosen", "rejected"),
             "prompt")
    monkeypatch.setattr(vocab, "PAIR_SHAPES", (*vocab.PAIR_SHAPES, stack))
    assert is_pair(row) and pair_shape(list(row)) == (stack[0], ["question", "response_j", "response_k"])
    rest = {"qid": 7, "metadata": row["metadata"]}
    assert to_pair(row, "x") == ({**rest, "prompt": Q, "completion": GOOD}, {**rest, "prompt": Q, "completion": BAD})
    with pytest.raises(ToolkitError, match=r"^x: a preference pair needs 'response_j' and 'response_k' \(stack-"
                                           r"exchange-paired .*\); 'response_k' is missing"):
        to_pair({"question": Q, "response_j": GOOD}, "x")


def test_a_pair_refusal_advises_by_the_files_roles() -> None:
    """A pair whose prompt is under a name no pair shape reads is refused with the entry its role gives, by the
    file's column roles (inferred once, `file_roles`) where the row's own name tells none; a turn's keys are read
    by their values (role-like and content-like keys) in every pair shape."""
    from toolkit.data.shapes import ShapeError

    row = {"zq_ask": Q, "chosen": GOOD, "rejected": BAD}
    with pytest.raises(ToolkitError, match=r"share no prompt") as info:
        to_pair(row, "x")
    assert not isinstance(info.value, ShapeError)
    with pytest.raises(ShapeError, match=r"^x: the pair's prompt is 'zq_ask'") as said:
        to_pair(row, "x", {"zq_ask": "prompt", "chosen": "chosen", "rejected": "rejected"})
    assert said.value.fix == {"columns": {"instruction": "zq_ask"}}
    speakers = {"messages": [{"speaker": "human", "text": Q}], "chosen": {"speaker": "bot", "text": GOOD},
                "rejected": {"speaker": "bot", "text": BAD}}
    assert to_pair(speakers, "x") == to_pair(CONVERSATIONAL["axolotl chat_template.default"], "x")
