"""The data shapes users bring from LLaMA-Factory, TRL, axolotl and ms-swift (toolkit/data/sources.py maps them to
`messages` rows; toolkit/data/encoding.py reads their training flags): each file is written here in the peer's
documented shape, and must give exactly the training rows of the toolkit's own `messages` rows that mean the same,
or be refused with one line that names the shape and what makes it train."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import PreTrainedTokenizerFast

from tests.conftest import stock_template
from toolkit.builtin.text_model import build_tokenizer
from toolkit.config.identity import resume_invariants
from toolkit.config.schema import DataSource, Recipe
from toolkit.data.encoding import encode_row
from toolkit.data.plan import encode_files
from toolkit.data.sources import Entry, resolve_source
from toolkit.data.store import store_key
from toolkit.errors import ToolkitError

U1, A1 = {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."}
U2, A2 = {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "It is 8."}
SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = [U1, A1, U2, A2]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                           "b": {"type": "number"}}}}}]
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
TOOL_CHAT = [{"role": "user", "content": "Add 2 and 3."},
             {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
             {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]


# The tiny tokenizer carries Qwen3's template, which gives the answer after the last user turn an empty think block.
LAST_ANSWER = "<think>\n\n</think>\n\nIt is 8.<|im_end|>"


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def qwen3(qwen_tokenizer: Any) -> Any:
    """The real Qwen tokenizer with Qwen3's stock template (renders tools and tool calls)."""
    tok = copy.copy(qwen_tokenizer)
    tok.chat_template = stock_template("qwen3")
    return tok


def _samples(sources: list[Any], tok: Any, cache: Path | None = None, **kw: Any) -> list[dict]:
    args = {"max_seq_len": 1024, "overlength": "error", "train_on": "assistant"} | kw
    return encode_files(sources, tok, cache_dir=cache, **args).samples


def _expected(rows: list[dict[str, Any]], tok: Any, train_on: str = "assistant") -> list[dict]:
    return [dict(zip(("input_ids", "labels"), encode_row(r, tok, train_on, "f"), strict=True)) for r in rows]


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trained(sample: dict[str, Any], tok: Any) -> str:
    return tok.decode([t for t, lab in zip(sample["input_ids"], sample["labels"], strict=True) if lab != -100])


# --- shapes that train ----------------------------------------------------------------------------------------

def test_sharegpt_with_a_copied_columns_mapping(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """LLaMA-Factory's registry maps `messages: conversations`; copied onto a path entry, the renamed `messages`
    holds from/value turns, read by their keys."""
    row = {"conversations": [{"from": "human", "value": U1["content"]}, {"from": "gpt", "value": A1["content"]}]}
    path = _jsonl(tmp_path / "share.jsonl", [row])
    want = _expected([{"messages": [U1, A1]}], tok)
    assert _samples([path], tok) == want
    assert _samples([Entry(str(path), None, (("messages", "conversations"),))], tok) == want


def test_conversations_with_role_and_content_turns(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _jsonl(tmp_path / "c.jsonl", [{"conversations": [SYSTEM, *CHAT]}])
    assert _samples([path], tok) == _expected([{"messages": [SYSTEM, *CHAT]}], tok)


def test_llama_factory_v1_rows(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """v1: content parts with `value`, a per-message `loss_weight` 0/1."""
    def v1(m: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return {"role": m["role"], "content": [{"type": "text", "value": m["content"]}], **kw}

    path = _jsonl(tmp_path / "v1.jsonl", [{"messages": [v1(U1), v1(A1, loss_weight=0.0), v1(U2),
                                                        v1(A2, loss_weight=1.0)]}])
    got = _samples([path], tok)
    assert got == _expected([{"messages": [U1, dict(A1, weight=0), U2, A2]}], tok)
    assert _trained(got[0], tok) == LAST_ANSWER


def test_text_parts_on_a_text_model(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """OpenAI / TRL content parts are joined for a text model; a non-text part is refused in one line."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
    path = _jsonl(tmp_path / "parts.jsonl", [{"messages": [{"role": "user", "content": parts}, A1]}])
    assert _samples([path], tok) == _expected([{"messages": [U1, A1]}], tok)
    bad = _jsonl(tmp_path / "image.jsonl", [{"messages": [{"role": "user", "content": [{"type": "image"}]}, A1]}])
    with pytest.raises(ToolkitError, match=r"image.jsonl:1: messages\[0\]\.content has a 'image' part; this model "
                                           "reads text only"):
        _samples([bad], tok)


def test_trl_conversational_prompt_completion(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """Only the completion trains; an assistant turn of the prompt is context (under train_on: all, all trains)."""
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": [SYSTEM, U1, A1, U2], "completion": [A2]}])
    got = _samples([path], tok)
    assert got == _expected([{"messages": [SYSTEM, U1, dict(A1, weight=0), U2, A2]}], tok)
    assert _trained(got[0], tok) == LAST_ANSWER
    assert _samples([path], tok, train_on="all") == _expected([{"messages": [SYSTEM, *CHAT]}], tok, "all")
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": [U1], "completion": "5."}])
    with pytest.raises(ToolkitError, match=r"mixed.jsonl:1: 'prompt' and 'completion' must both be strings, or both "
                                           r"lists of messages \(TRL's conversational shape\)"):
        _samples([mixed], tok)


def test_ms_swift_rows(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """query/response/history/system rows and `conversation` pairs (ms-swift's documented shapes)."""
    qr = {"system": "Be brief.", "query": U2["content"], "response": A2["content"],
          "history": [[U1["content"], A1["content"]]]}
    pairs = {"system": "Be brief.", "conversation": [{"human": U1["content"], "assistant": A1["content"]},
                                                     {"human": U2["content"], "assistant": A2["content"]}]}
    path = _jsonl(tmp_path / "swift.jsonl", [qr, pairs])
    assert _samples([path], tok) == _expected([{"messages": [SYSTEM, *CHAT]}] * 2, tok)


def test_tool_calls_openai_sharegpt_and_ms_swift(tmp_path: Path, qwen3: Any) -> None:
    """The same tool exchange as OpenAI's `tool_calls` and `tool` messages, ShareGPT's function_call/observation
    turns and ms-swift's tool_call/tool_response roles (arguments as JSON text, tools as a JSON string)."""
    openai = {"messages": TOOL_CHAT, "tools": TOOLS}
    swift = {"tools": json.dumps(TOOLS), "messages": [
        TOOL_CHAT[0],
        {"role": "tool_call", "content": json.dumps({"name": "add", "arguments": json.dumps(CALL["arguments"])})},
        {"role": "tool_response", "content": "5"}, TOOL_CHAT[3]]}
    share = {"tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "Add 2 and 3."}, {"from": "function_call", "value": json.dumps(CALL)},
        {"from": "observation", "value": "5"}, {"from": "gpt", "value": "It is 5."}]}
    path = _jsonl(tmp_path / "tools.jsonl", [openai, swift, share])
    got = _samples([path], qwen3)
    assert got == _expected([openai] * 3, qwen3)
    assert "<tool_call>" in _trained(got[0], qwen3)
    two = {"tools": TOOLS, "messages": [TOOL_CHAT[0], {"role": "tool_call", "content": json.dumps(CALL)},
                                        {"role": "tool_call", "content": json.dumps(CALL)},
                                        {"role": "tool_response", "content": "5"}, {"role": "tool_response",
                                                                                    "content": "5"}, TOOL_CHAT[3]]}
    parallel = dict(TOOL_CHAT[1], tool_calls=TOOL_CHAT[1]["tool_calls"] * 2)
    assert _samples([_jsonl(tmp_path / "two.jsonl", [two])], qwen3) == _expected(
        [{"tools": TOOLS, "messages": [TOOL_CHAT[0], parallel, TOOL_CHAT[2], TOOL_CHAT[2], TOOL_CHAT[3]]}], qwen3)


@pytest.mark.parametrize("flag", [{"train": False}, {"training": False}, {"loss": False}, {"loss_scale": 0},
                                  {"loss_weight": 0}, {"weight": 0}, {"loss_scale": 0.0, "train": False}])
def test_every_peers_turn_flag_is_honoured(tmp_path: Path, tok: PreTrainedTokenizerFast, flag: dict) -> None:
    """axolotl's train/training, ms-swift's loss/loss_scale, LLaMA-Factory's loss_weight, OpenAI's weight: the
    flagged turn does not train, exactly as weight 0."""
    path = _jsonl(tmp_path / "f.jsonl", [{"messages": [U1, dict(A1, **flag), U2, A2]},
                                         {"messages": [U1, dict(A1, loss=None)]}])  # ms-swift's default
    got = _samples([path], tok)
    assert got == _expected([{"messages": [U1, dict(A1, weight=0), U2, A2]}, {"messages": [U1, A1]}], tok)
    assert _trained(got[0], tok) == LAST_ANSWER


@pytest.mark.parametrize(("flag", "error"), [
    ({"loss_scale": 2.0}, r"messages\[1\]\.loss_scale is 2\.0; only 0 \(do not train this turn\) or 1"),
    ({"loss_weight": 0.5}, r"messages\[1\]\.loss_weight is 0\.5; only 0"),
    ({"train": "no"}, r"messages\[1\]\.train is 'no'; it must be true or false"),
    ({"loss": 1.5}, r"messages\[1\]\.loss is 1\.5; it must be true or false"),
    ({"train": False, "loss": True}, r"messages\[1\] has train False and loss True, which disagree"),
])
def test_turn_flags_that_cannot_be_honoured(tmp_path: Path, tok: PreTrainedTokenizerFast, flag: dict,
                                            error: str) -> None:
    path = _jsonl(tmp_path / "f.jsonl", [{"messages": [U1, dict(A1, **flag)]}])
    with pytest.raises(ToolkitError, match=rf"^{path}:1: {error}"):
        _samples([path], tok)


def test_per_part_train_flags(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """axolotl's per-part `train`: honoured when every part of the turn agrees, refused when they differ."""
    def parts(*flags: bool) -> list[dict[str, Any]]:
        return [{"type": "text", "text": t, "train": f} for t, f in zip(("It is ", "8."), flags, strict=True)]

    path = _jsonl(tmp_path / "p.jsonl", [{"messages": [U1, A1, U2, {"role": "assistant",
                                                                     "content": parts(False, False)}]}])
    got = _samples([path], tok)
    assert got == _expected([{"messages": [U1, A1, U2, dict(A2, weight=0)]}], tok)
    bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": [U1, {"role": "assistant", "content": parts(True, False)}]}])
    with pytest.raises(ToolkitError, match=r"bad.jsonl:1: messages\[1\] has parts with different training flags "
                                           r"\(train: False; train: True\); a turn trains whole"):
        _samples([bad], tok)


AXOLOTL = {"conversations": [{"speaker": "customer", "text": U1["content"]},
                             {"speaker": "agent", "text": A1["content"]}]}
TAGS = (("assistant_tag", "agent"), ("content_tag", "text"), ("role_tag", "speaker"), ("user_tag", "customer"))


def test_tags_map_keys_and_roles_of_any_file(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """A chat with its own key and role names (axolotl's message_property_mappings): refused with the exact
    mapping, then trained with it as the entry's tags; the tags are part of the store's key."""
    path = _jsonl(tmp_path / "ax.jsonl", [AXOLOTL])
    with pytest.raises(ToolkitError, match=r"ax.jsonl:1: the turns in 'conversations' have keys \['speaker', 'text'\] "
                                           r".*Give the data entry \{tags: \{role_tag: speaker, content_tag: text, "
                                           r"user_tag: customer, assistant_tag: agent\}\}\."):
        _samples([path], tok)
    want = _expected([{"messages": [U1, A1]}], tok)
    assert _samples([Entry(str(path), tags=TAGS)], tok, tmp_path / "cache") == want
    messages = _jsonl(tmp_path / "m.jsonl", [{"messages": AXOLOTL["conversations"]}])
    assert _samples([Entry(str(messages), tags=TAGS)], tok) == want
    entry = DataSource(path=str(path), tags=dict(TAGS)).entry()
    assert entry.tags == TAGS
    with pytest.raises(ValueError, match=r"tags: 'role' is not a tag \(did you mean role_tag\?\)"):
        DataSource(path=str(path), tags={"role": "speaker"})

    class Enc:
        fingerprint = "f"

        @staticmethod
        def options() -> dict[str, Any]:
            return {}

    plain = store_key(resolve_source(Entry(str(path)), tmp_path), "d", Enc())
    tagged = store_key(resolve_source(Entry(str(path), tags=TAGS), tmp_path), "d", Enc())
    assert "tags" not in plain and plain != tagged


def test_unknown_roles_name_the_tags(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "customer", "content": "hi"}, A1]}])
    with pytest.raises(ToolkitError, match=r"r.jsonl:1: messages\[0\] must have a role in .*; its role is 'customer': "
                                           r"map role names with the data entry's tags \(user_tag"):
        _samples([path], tok)


@pytest.mark.parametrize(("row", "error"), [
    ({"prompt": "2 + 2?", "completions": ["It is", " 4."], "labels": [True, True]},
     r"the row has 'completions': TRL's stepwise-supervision rows"),
    ({"image": {"bytes": "..."}, "messages": [U1, A1]},
     r"the row has 'image' \(TRL's and Qwen-VL's image column\) that is not a path or a list of paths; give the "
     r"image paths as a list in 'images'"),
    ({"query": "2 + 2?"}, r"a row needs .*'query' is a prompt with no answer beside it"),
    ({"conversation": [{"human": "hi"}]}, r".*found keys \['conversation'\] \('conversation' of no role the "
                                          r"vocabulary names\), none a chat, a text or a prompt with its answer"),
    ({"messages": [U1, {"role": "tool_call", "content": "add(2, 3)"}]},
     r"messages\[1\] is a tool call whose content is not JSON"),
    ({"dialog": [U1, A1], "chat": [U2, A2]}, r"the row holds chats under keys 'dialog', 'chat'; train one: "
                                              r"columns: \{messages: dialog\}; columns: \{messages: chat\}"),
    ({"messages": [{"role": "user", "content": "<video>What happens?"}, A1], "videos": ["clip.mp4"]},
     r"the row has 'videos', which needs a vision-language model \(this model reads text only\)"),
    ({"messages": [{"role": "user", "content": "<video>What happens?"}, A1]},
     r"the text holds '<video>': '<video>' tags need one video each in the row's 'videos'"),
])
def test_shapes_refused_with_their_reason(tmp_path: Path, tok: PreTrainedTokenizerFast, row: dict,
                                          error: str) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(ToolkitError, match=rf"^{path}:1: {error}"):
        _samples([path], tok)


def test_trl_image_column_on_a_text_model(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """TRL's one `image` becomes `images`, which a text model names as what it cannot read."""
    path = _jsonl(tmp_path / "i.jsonl", [{"image": "a.png", "messages": [U1, A1]}])
    with pytest.raises(ToolkitError, match=r"the row has 'images', which needs a vision-language model"):
        _samples([path], tok)


def test_unread_message_keys_are_counted(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    from toolkit.data.plan import _selections

    path = _jsonl(tmp_path / "x.jsonl", [{"messages": [dict(U1, lang="en"), dict(A1, lang="en", score=3)]},
                                         {"messages": [dict(U1, lang="en"), dict(A1, weight=1)]}])
    (store, _), = _selections([path], tok, max_seq_len=512, overlength="error", train_on="assistant",
                              thinking="auto", cache_dir=tmp_path / "cache", encoder=None, num_proc=1)
    assert store.unread_keys == {"lang": 2, "score": 1}


# --- LLaMA-Factory's registry ---------------------------------------------------------------------------------

def _png(path: Path, colour: str) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (56, 56), colour).save(path)


def _registry(root: Path) -> Path:
    """A `data/` folder in LLaMA-Factory's layout: alpaca (JSON array, default formatting, and mapped columns),
    sharegpt with tags, openai, a multimodal sharegpt entry (file and images in subfolders), and entries that
    point at files that are not there, at the hub or at preference data."""
    data = root / "data"
    data.mkdir(parents=True)
    (data / "alpaca_demo.json").write_text(json.dumps([
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5."},
        {"instruction": "Say hi.", "input": "", "output": "Hi.", "system": "Be brief.",
         "history": [["What is 1 + 1?", "2."]]}]))
    _jsonl(data / "qa.jsonl", [{"question": U1["content"], "answer": A1["content"], "sys": "Be brief."}])
    _jsonl(data / "agents.jsonl", [{"dialog": AXOLOTL["conversations"], "sys": "Be brief."}])
    _jsonl(data / "chat" / "openai.jsonl", [{"messages": [SYSTEM, dict(U1, lang="en"), *CHAT[1:]]}])
    (data / "json").mkdir()
    (data / "json" / "mllm.json").write_text(json.dumps([{"messages": [
        {"role": "user", "content": "<image>What colour is this?"}, {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "And these?<image><image>"}, {"role": "assistant", "content": "Blue, green."}],
        "images": ["imgs/red.png", "imgs/blue.png", "imgs/green.png"]}]))
    for colour in ("red", "blue", "green"):
        _png(data / "imgs" / f"{colour}.png", colour)
    registry = {
        "alpaca_demo": {"file_name": "alpaca_demo.json"},
        "qa_mapped": {"file_name": "qa.jsonl", "columns": {"prompt": "question", "response": "answer",
                                                           "system": "sys", "history": "history"}},
        "agents": {"file_name": "agents.jsonl", "formatting": "sharegpt",
                   "columns": {"messages": "dialog", "system": "sys"}, "tags": dict(TAGS)},
        "openai_chat": {"file_name": "chat/*.jsonl", "formatting": "openai"},
        "mllm_demo": {"file_name": "json/mllm.json", "formatting": "sharegpt",
                      "columns": {"messages": "messages", "images": "images"},
                      "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                               "assistant_tag": "assistant"}},
        "missing_file": {"file_name": "not_here.json"},
        "hub_only": {"hf_hub_url": "someone/not-cached"},
        "script": {"script_url": "my_script"},
        "ms_only": {"ms_hub_url": "someone/ms-data"},
        "kto": {"file_name": "qa.jsonl", "formatting": "sharegpt", "tags": {"kto_tag": "label"}},
        "sampled": {"file_name": "qa.jsonl", "num_samples": 10},
    }
    (data / "dataset_info.json").write_text(json.dumps(registry, indent=2))
    return data


def test_llama_factory_registry(tmp_path: Path, tok: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
                                ) -> None:
    data = _registry(tmp_path)
    monkeypatch.chdir(tmp_path)  # dataset_dir defaults to data, from the working directory

    def entry(name: str, **kw: Any) -> Entry:
        return DataSource(dataset=name, **kw).entry()

    assert _samples([entry("alpaca_demo")], tok, tmp_path / "cache") == _expected([
        {"messages": [{"role": "user", "content": "Add the numbers.\n2 and 3"}, A1]},
        {"messages": [SYSTEM, {"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2."},
                      {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]}], tok)
    assert _samples([entry("qa_mapped")], tok) == _expected([{"messages": [SYSTEM, U1, A1]}], tok)
    assert _samples([entry("agents", dataset_dir=str(data))], tok) == _expected([{"messages": [SYSTEM, U1, A1]}], tok)
    assert _samples([entry("openai_chat")], tok) == _expected([{"messages": [SYSTEM, *CHAT]}], tok)
    with pytest.raises(ToolkitError, match=r"the row has 'images', which needs a vision-language model"):
        _samples([entry("mllm_demo")], tok)  # a text model; the VL test below trains it

    refusals = {
        "alpaca_dem": r"data/dataset_info.json has no dataset 'alpaca_dem'; close names: alpaca_demo",
        "missing_file": r"^Data file data/not_here.json does not exist",
        "hub_only": r"^data/dataset_info.json entry 'hub_only' has hf_hub_url someone/not-cached: Data entry "
                    r"someone/not-cached is not a local path, and no hub dataset 'someone/not-cached' is in the local "
                    r"Hugging Face cache",
        "script": r"entry 'script' has script_url 'my_script' and no file_name or hf_hub_url, which this toolkit "
                  r"does not read",
        "ms_only": r"entry 'ms_only' has ms_hub_url",
        "kto": r"entry 'kto' is a KTO dataset \(kto_tag\), which is not supported",
        "sampled": r"entry 'sampled' has num_samples, which is not supported",
    }
    for name, error in refusals.items():
        with pytest.raises(ToolkitError, match=error):
            _samples([entry(name)], tok)
    with pytest.raises(ToolkitError, match=r"^Data entry data is a LLaMA-Factory data folder \(its dataset_info.json "
                                           r"names alpaca_demo, .*\); name a dataset of it: \{dataset: alpaca_demo, "
                                           r"dataset_dir: data\}"):
        _samples(["data"], tok)
    with pytest.raises(ToolkitError, match=r"Data entry \{dataset: x\}: no registry elsewhere/dataset_info.json"):
        _samples([entry("x", dataset_dir="elsewhere")], tok)


def test_registry_entries_in_a_recipe(tmp_path: Path) -> None:
    """`{dataset, dataset_dir}` entries beside paths: a weight each, `dataset: a,b` refused with the fix, and the
    resume hash of a recipe without them as before (no new keys in it)."""
    from toolkit.config.stages import resolve_stages

    stages = [{"name": "s", "max_steps": 1, "data": [{"dataset": "alpaca_demo", "weight": 2},
                                                      {"path": "x.jsonl", "weight": 1}]}]
    recipe = Recipe.model_validate({"stages": stages})
    (stage,) = resolve_stages(recipe)
    assert stage.entries[0] == Entry(None, dataset="alpaca_demo", dataset_dir="data")
    assert stage.paths == ("data/dataset_info.json:alpaca_demo", "x.jsonl") and stage.weights == (2.0, 1.0)
    tree = resume_invariants(recipe)["stages"][0]["data"]
    assert tree[1] == {"path": "x.jsonl", "weight": 1.0}
    with pytest.raises(ValueError, match=r"dataset 'alpaca_demo,qa' names 2 datasets; list them as separate data "
                                         r"entries \(\{dataset: alpaca_demo\}, \{dataset: qa\}\)"):
        DataSource(dataset="alpaca_demo,qa")
    with pytest.raises(ValueError, match=r"a data entry needs a path or a dataset"):
        DataSource(path="x.jsonl", dataset="qa")


def test_registry_multimodal_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaMA-Factory's mllm layout: `<image>` placeholders become image parts in order, one per path of
    `images`, the paths relative to dataset_dir (not to the file's folder)."""
    from transformers import AutoProcessor

    from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin
    from toolkit.data.vision import VLEncoder

    processor = AutoProcessor.from_pretrained(materialize_builtin(TINY_VL_MODEL, tmp_path / "models"))
    data = _registry(tmp_path)
    monkeypatch.chdir(tmp_path)
    encoder = VLEncoder(processor, train_on="assistant")
    got = encode_files([DataSource(dataset="mllm_demo").entry()], processor.tokenizer, max_seq_len=4096,
                       overlength="error", train_on="assistant", encoder=encoder).samples
    parts = {"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": [{"type": "text", "text": "And these?"}, {"type": "image"}, {"type": "image"}]},
        {"role": "assistant", "content": "Blue, green."}], "images": ["red.png", "blue.png", "green.png"]}
    want = encoder.encode([parts], [1], lambda n: "f", base_dir=data / "imgs").sample(0)
    assert got[0]["input_ids"] == want["input_ids"] and got[0]["labels"] == want["labels"]
    assert got[0]["images"] == [str((data / "imgs" / f"{c}.png").absolute()) for c in ("red", "blue", "green")]


def test_a_run_trains_on_registry_entries(tmp_path: Path, models: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Through a recipe: two registry datasets with mixture weights, and the message key nothing reads named once
    in the stage's data log."""
    import yaml

    from tests.conftest import base_recipe
    from tests.helpers.inprocess import Call, invoke

    _registry(tmp_path)
    recipe = base_recipe(models["text"]) | {"stages": [
        {"name": "lf", "max_steps": 1, "data": [{"dataset": "alpaca_demo", "weight": 1},
                                                {"dataset": "openai_chat", "dataset_dir": "data", "weight": 1}]}]}
    recipe["train"] = {"micro_batch_size": 1, "grad_accum": 2}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rc, stderr = invoke(Call(["--config", "recipe.yaml"], tmp_path / "run"), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert "stage 'lf' data: 3 rows, 3 kept" in caplog.text
    assert "stage 'lf' data: messages carry keys not read: lang (1 rows)" in caplog.text


def test_registry_hub_entry_from_the_local_cache(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An `hf_hub_url` entry reads as that hub id does (local cache only), its registry `split` or the entry's."""
    from tests.data.test_sources import _cached_hub_dataset, offline_hf_home

    home = offline_hf_home(tmp_path, monkeypatch)
    _cached_hub_dataset(home, "someone/tiny-chat", {"train": [{"messages": CHAT}], "test": [{"messages": [U1, A1]}]})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({
        "hub_chat": {"hf_hub_url": "someone/tiny-chat", "formatting": "openai", "split": "test"}}))
    monkeypatch.chdir(tmp_path)
    assert _samples([DataSource(dataset="hub_chat").entry()], tok) == _expected([{"messages": [U1, A1]}], tok)
    assert _samples([DataSource(dataset="hub_chat", split="train").entry()], tok) == _expected([{"messages": CHAT}],
                                                                                                 tok)


# --- data from the wild (issue 38): real rows of tests/assets/wild/ (origins in its README) ----------------------

WILD = Path(__file__).parents[1] / "assets" / "wild"
IMAGES = ("images/001.jpg", "cats/001.jpg", "cats/002.jpg", "image_path.png", "image_path1.png", "image_path2.png",
          "000000033471.jpg", "coco/train2017/000000000009.jpg", "path/to/image_0.jpg", "path/to/image_1.jpg",
          "mllm_demo_data/1.jpg", "xxx/x.jpg", "images/rlaif_v_0.png", "images/sky.png", "kitten.png", "puppy.png")
"""The image files the corpus's rows name, written as small pictures beside a copy of the file."""
VIDEOS = ("mllm_demo_data/1.mp4", "videos/005.mp4", "xxx/x.mp4", "academic_source/Charades/RW587.mp4")
"""The video files the corpus's rows name, written as small videos of known frames (tests/helpers/video_files.py)."""
FRAMES = tuple(f"path/to/frame{k}.jpg" for k in range(1, 5))
"""The frame list of qwenvl_frame_list.jsonl."""
TRAINS = {  # file -> (model, the data entry keys its refusals give, applied in turn)
    "tatsu_alpaca.jsonl": ("text", {}),
    "dolly.jsonl": ("text", {"columns": {"input": "context", "output": "response"}}),
    "ultrachat.jsonl": ("text", {}),
    "openai_chat.jsonl": ("text", {}),
    "llamafactory_v1.jsonl": ("text", {}),
    "ms_swift_query.csv": ("text", {}),
    "ms_swift_alpaca.csv": ("text", {}),
    "trl_conversational.jsonl": ("text", {}),
    "glaive_function_calling.jsonl": ("text", {}),
    "gsm8k.jsonl": ("text", {"columns": {"instruction": "question", "output": "answer"}}),
    "ms_swift_query.jsonl": ("vl", {}),
    "qwenvl_single.json": ("vl", {}),
    "qwenvl_image_list.jsonl": ("vl", {}),
    "qwenvl_video.jsonl": ("vl", {}),
    "llamafactory_mllm_video_demo.json": ("vl", {}),
    "ms_swift_video.jsonl": ("vl", {}),
    "qwenvl_frame_list.jsonl": ("vl", {}),
    "llava_video.jsonl": ("vl", {}),
}
REFUSED = {  # file -> the refusal (no data entry trains these rows)
    "openai_video_url.jsonl": r"has a video_url part that is not a video file's path or a list of frame paths "
                              r"\('https://qianwen-res",
    "openai_audio.jsonl": r"has a 'input_audio' part: audio does not train: .*Qwen2-Audio and Qwen2.5-Omni do",
    "openai_vision_url.jsonl": r"has an image_url part that is not an image file's path",
    "llamafactory_dataset_info.json": r"the file holds one object, not an array, and it is not a row",
    "empty_answer.jsonl": r"messages\[2\] is an assistant turn with no content, which would train a bare end-of-turn "
                          r"token; .*set data.empty_answers: skip",
}
FIX = re.compile(r" Give the data entry (\{.*\})\.$")


def wild_copy(tmp: Path, name: str) -> Path:
    """A copy of the corpus file in `tmp`, with the image files its rows name."""
    from PIL import Image

    from tests.helpers.video_files import write_frames, write_video

    for rel in IMAGES:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (56, 56), "red").save(tmp / rel)
    if "video" in name or "frame" in name:
        for rel in VIDEOS:
            write_video(tmp / rel, 8)
        write_frames([tmp / rel for rel in FRAMES])
    shutil.copy(WILD / name, tmp / name)
    return tmp / name


@pytest.fixture(scope="module")
def vl_processor(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoProcessor

    from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin

    return AutoProcessor.from_pretrained(materialize_builtin(TINY_VL_MODEL, tmp_path_factory.mktemp("vl")))


def _wild_samples(entry: Entry, kind: str, tok: Any, processor: Any, **kw: Any) -> Any:
    from toolkit.data.vision import VLEncoder

    encoder = VLEncoder(processor, train_on="assistant") if kind == "vl" else None
    return encode_files([entry], processor.tokenizer if kind == "vl" else tok, max_seq_len=4096, overlength="error",
                        train_on="assistant", encoder=encoder, **kw)


def trains_after_fixes(path: Path, kind: str, tok: Any, processor: Any) -> tuple[Any, dict[str, Any], Entry]:
    """The file read as training reads it; each refusal that offers YAML applied as a recipe gives it (through the
    recipe's own schema), until it trains. Returns the rows, the keys applied and the entry."""
    applied: dict[str, Any] = {}
    for _ in range(4):
        entry = DataSource(path=str(path), **applied).entry()
        try:
            return _wild_samples(entry, kind, tok, processor), applied, entry
        except ToolkitError as e:
            fix = FIX.search(str(e))
            assert fix is not None, f"refused without the data entry that trains it: {e}"
            for key, value in yaml.safe_load(fix.group(1)).items():
                applied[key] = ({**applied.get(key, {}), **value} if isinstance(value, dict)
                                else sorted({*applied.get(key, []), *value}))
    raise AssertionError(f"{path} still refused after the fixes {applied}")


@pytest.mark.parametrize("name", sorted(TRAINS))
def test_wild_files_train_or_their_refusal_gives_the_entry_that_does(name: str, tmp_path: Path,
                                                                      tok: PreTrainedTokenizerFast,
                                                                      vl_processor: Any) -> None:
    """Rule 3: every corpus file trains as it is, or each refusal names the data entry (YAML) that trains it; the
    YAML is applied as a recipe gives it and the file trains, every row kept."""
    kind, fix = TRAINS[name]
    data, applied, _ = trains_after_fixes(wild_copy(tmp_path, name), kind, tok, vl_processor)
    assert applied == fix
    assert data.stats.kept == data.stats.rows > 0 and data.stats.label_tokens > 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_wild_files_that_cannot_train_are_refused_in_one_line(name: str, tmp_path: Path,
                                                               tok: PreTrainedTokenizerFast, vl_processor: Any) -> None:
    """Audio, image and video URLs, a registry given as a data file and an empty answer: one line each, never
    trained."""
    path = wild_copy(tmp_path, name)
    kind = "vl" if "video" in name or "vision" in name else "text"
    with pytest.raises(ToolkitError, match=REFUSED[name]):
        _wild_samples(Entry(str(path)), kind, tok, vl_processor)


def _decoded(sample: dict[str, Any], tok: Any) -> str:
    return tok.decode(sample["input_ids"])


def test_tatsu_alpaca_trains_once_from_its_fields(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """tatsu-lab/alpaca's rendered `text` beside its fields: the fields train, once, and the choice is logged;
    `columns: {text: text}` trains the text instead (the user's word wins)."""
    from toolkit.data.plan import _selections

    path = wild_copy(tmp_path, "tatsu_alpaca.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    samples = _samples([path], tok)
    assert "Below is an instruction" not in _decoded(samples[0], tok)
    assert _trained(samples[0], tok).startswith("<think>\n\n</think>\n\n" + rows[0]["output"][:20])
    assert "Twitter, Instagram, Telegram" in _decoded(samples[2], tok)
    (store, _), = _selections([path], tok, max_seq_len=1024, overlength="error", train_on="assistant",
                              thinking="auto", cache_dir=None, encoder=None, num_proc=1)
    assert any(n.startswith("'text' renders instruction/input/output") and c == 3 for n, c in store.notes.items())
    as_text = _samples([DataSource(path=str(path), columns={"text": "text"}).entry()], tok)
    assert "### Instruction:\nGive three tips" in _trained(as_text[0], tok)


def test_dolly_trains_with_its_context(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """Dolly's `context` passage trains in the prompt once mapped; the old advice (`columns: {output: response}`
    alone) is refused naming `context` and the column that reads it, never trained without it."""
    path = wild_copy(tmp_path, "dolly.jsonl")
    with pytest.raises(ToolkitError, match=r"dolly.jsonl:1: .*'instruction' a prompt, 'context' a context, "
                                           r"'response' an answer.* Give the data entry \{columns: \{input: context, "
                                           r"output: response\}\}"):
        _samples([path], tok)
    half = DataSource(path=str(path), columns={"output": "response"}).entry()
    with pytest.raises(ToolkitError, match=r"'context' holds content .* Give the data entry \{columns: \{input: "
                                           r"context\}\}"):
        _samples([half], tok)
    entry = DataSource(path=str(path), columns={"input": "context", "output": "response"}).entry()
    first = _samples([entry], tok)[0]
    assert "collapse of Ansett Australia" in _decoded(first, tok)
    assert "collapse of Ansett" not in _trained(first, tok)


def test_ultrachat_prompt_beside_messages_trains_once(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """UltraChat's `prompt` repeats the first user turn of its `messages`: the chat trains, the prompt once."""
    sample = _samples([wild_copy(tmp_path, "ultrachat.jsonl")], tok)[0]
    assert _decoded(sample, tok).count("Create a fully-developed protagonist") == 1
    assert "Name: Ava" in _trained(sample, tok) and "Certainly!" in _trained(sample, tok)


def test_llamafactory_v1_reasoning_and_tool_call_parts(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """LLaMA-Factory v1's `reasoning` part is the turn's thinking (Qwen3's think block, as its template writes
    `reasoning_content`), its `tool_call` part a tool call."""
    trained = _trained(_samples([wild_copy(tmp_path, "llamafactory_v1.jsonl")], tok)[0], tok)
    assert "<think>\nI need to use the multiply function to calculate 6*8.\n</think>" in trained
    assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 8}}\n</tool_call>' in trained


def test_openai_system_and_answer_row_trains(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """A row of a system prompt and an answer alone (OpenAI's format accepts it) trains; the file is not refused."""
    samples = _samples([wild_copy(tmp_path, "openai_chat.jsonl")], tok)
    assert "William Shakespeare" in _trained(samples[1], tok)
    assert "Paris\n" not in _trained(samples[0], tok)  # weight 0 stays untrained


def test_csv_cells_are_text(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """ms-swift's own CSV examples: all-digit cells (`00000`) are text, as ms-swift reads them."""
    samples = _samples([wild_copy(tmp_path, "ms_swift_query.csv")], tok)
    assert _decoded(samples[0], tok).startswith("<|im_start|>system\n00000<|im_end|>")
    assert _trained(samples[0], tok).endswith("22222<|im_end|>")
    alpaca = _samples([wild_copy(tmp_path, "ms_swift_alpaca.csv")], tok)
    assert "11111\n22222" in _decoded(alpaca[0], tok)


def test_image_placeholders_and_image_keys(tmp_path: Path, vl_processor: Any) -> None:
    """`<image>` in ms-swift's `query`, Qwen-VL's `image` (a path or a list) and a pretty-printed one-row JSON
    file: image tokens where the placeholders were, never the placeholder as text."""
    tok = vl_processor.tokenizer
    for name, images in (("ms_swift_query.jsonl", [1, 2, 0]), ("qwenvl_single.json", [1]),
                         ("qwenvl_image_list.jsonl", [2])):
        data = _wild_samples(Entry(str(wild_copy(tmp_path, name))), "vl", tok, vl_processor)
        assert [len(s.get("images", [])) for s in data.samples] == images, name
        assert not any("<image>" in _decoded(s, tok) for s in data.samples), name


def test_glaive_names_its_chat(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """Glaive's `system` + `chat` (a dialog in one string, `USER:` / `ASSISTANT:` markers): split into turns, the
    system prompt without its `SYSTEM:` marker, Glaive's `<|endoftext|>` not trained as text."""
    sample = _samples([wild_copy(tmp_path, "glaive_function_calling.jsonl")], tok)[0]
    shown, trained = _decoded(sample, tok), _trained(sample, tok)
    assert "<|im_start|>system\nYou are a helpful assistant" in shown and "SYSTEM:" not in shown
    assert "USER:" not in shown and "ASSISTANT:" not in shown and "<|endoftext|>" not in shown
    assert trained.count("<|im_end|>") == shown.count("<|im_start|>assistant")


def test_empty_answers_skip(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """data.empty_answers: skip keeps an empty answer untrained and says so in the stage's log; the row, with
    nothing else to train, is skipped and counted."""
    from toolkit.data.encoding import TextEncoder
    from toolkit.data.plan import _selections

    path = wild_copy(tmp_path, "empty_answer.jsonl")
    encoder = TextEncoder(tok, train_on="assistant", empty_answers="skip")
    (store, selection), = _selections([path], tok, max_seq_len=1024, overlength="error", train_on="assistant",
                                      thinking="auto", cache_dir=None, encoder=encoder, num_proc=1)
    assert selection.stats.no_label_tokens == 1 and selection.stats.kept == 0
    assert store.notes == {"assistant turns with no content left untrained (data.empty_answers: skip)": 1}


def test_keys_without_content_are_named_in_the_log(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """Rule 1: Dolly's `category` and UltraChat's `prompt_id` hold no content: kept out, named once per stage."""
    from toolkit.data.plan import _selections

    dolly = DataSource(path=str(wild_copy(tmp_path, "dolly.jsonl")),
                       columns={"input": "context", "output": "response"}).entry()
    (store, _), (other, _) = _selections([dolly, wild_copy(tmp_path, "ultrachat.jsonl")], tok, max_seq_len=1024,
                                         overlength="error", train_on="assistant", thinking="auto", cache_dir=None,
                                         encoder=None, num_proc=1)
    assert store.notes == {"metadata and keys without content, not read: category": 2}
    assert other.notes["metadata and keys without content, not read: prompt_id"] == 1


@pytest.mark.parametrize(("key", "value", "content"), [
    ("context", "Virgin Australia, the trading name", True), ("context", "", False), ("category", "closed_qa", False),
    ("prompt_id", "d938b65dfe31f05f80eb8572964c6673eddbd68eff3db6bd234d7f1e3b86c2af", False),
    ("source", "a long passage of words", False), ("picture", "cats/001.jpg", True), ("score", 4.5, False),
    ("tools", [{"name": "multiply"}], True), ("keywords", ["apple", "pear"], False), ("id", 3, False),
])
def test_what_holds_content(key: str, value: Any, content: bool) -> None:
    """The rule docs/data.md states: names of ids, scores, categories, sources hold none; text with words, a
    media file, objects do."""
    from toolkit.data.shapes import holds_content

    assert holds_content(key, value) is content


def test_content_keys_are_refused_unless_ignored(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """A key holding content that nothing reads is refused with `ignore:`; on a turn too; ignore drops it."""
    row = {"messages": [U1, A1], "rationale": "Because two and three make five."}
    path = _jsonl(tmp_path / "r.jsonl", [row])
    with pytest.raises(ToolkitError, match=r"r.jsonl:1: the row's key 'rationale' holds content \(text of 32 "
                                           r"characters\) that no shape reads .*rationale is a reasoning\. Give the "
                                           r"data entry \{columns: \{reasoning: rationale\}\}\."):
        _samples([path], tok)
    think = [U1, dict(A1, reasoning_content=row["rationale"])]  # the template's thinking block, never dropped
    mapped = DataSource(path=str(path), columns={"reasoning": "rationale"}).entry()
    assert _samples([mapped], tok) == _expected([{"messages": think}], tok)
    noted = _jsonl(tmp_path / "n.jsonl", [{"messages": [U1, A1], "note": "Checked by two graders."}])
    with pytest.raises(ToolkitError, match=r"note is of no role the vocabulary names; candidates: 'note' as the "
                                           r"context: \{columns: \{input: note\}\}.*or, if it is metadata, drop it "
                                           r"knowingly with ignore"):
        _samples([noted], tok)
    assert _samples([DataSource(path=str(noted), ignore=["note"]).entry()], tok) == _expected([row], tok)
    turn = _jsonl(tmp_path / "t.jsonl", [{"messages": [U1, dict(A1, thoughts="Two plus three, so five.")]}])
    with pytest.raises(ToolkitError, match=r"the turns carry key 'thoughts', which holds content"):
        _samples([turn], tok)


def test_ignore_is_part_of_the_store_key_and_the_resume_check(tmp_path: Path) -> None:
    """A data entry's `ignore` changes which rows are accepted: it keys the token store and the resume check,
    and an entry without it keeps its earlier keys."""

    class Enc:
        fingerprint = "f"

        @staticmethod
        def options() -> dict[str, Any]:
            return {}

    path = _jsonl(tmp_path / "d.jsonl", [{"messages": [U1, A1]}])
    plain = store_key(resolve_source(Entry(str(path)), tmp_path), "d", Enc())
    ignoring = store_key(resolve_source(DataSource(path=str(path), ignore=["note"]).entry(), tmp_path), "d", Enc())
    assert plain != ignoring and "ignore" not in plain

    def invariants(entry: dict[str, Any]) -> dict[str, Any]:
        return resume_invariants(Recipe.model_validate({"stages": [{"name": "s", "data": [entry]}]}))

    assert invariants({"path": str(path)}) != invariants({"path": str(path), "ignore": ["note"]})
    assert '"ignore":' not in json.dumps(invariants({"path": str(path)}))


def test_a_prompt_that_is_not_the_chats_first_turn(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """`prompt` beside `messages` that do not start with it: two shapes, refused with the entry that trains the
    chat."""
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "Something else.", "messages": [U1, A1]}])
    with pytest.raises(ToolkitError, match=r"p.jsonl:1: the row has 'messages' and a 'prompt' that is not its first "
                                           r"user turn.* Give the data entry \{ignore: \[prompt\]\}\."):
        _samples([path], tok)
    assert _samples([DataSource(path=str(path), ignore=["prompt"]).entry()], tok) == _expected([{"messages": [U1, A1]}],
                                                                                              tok)


def test_image_url_parts_of_a_file(tmp_path: Path, vl_processor: Any) -> None:
    """OpenAI's `image_url` part ({"url": path}) and LLaMA-Factory v1's (`value`: path) name an image file: read as
    an image of the row; `video_url` parts name video files, read as videos of the row."""
    wild_copy(tmp_path, "gsm8k.jsonl")  # writes the corpus's image files
    question = {"type": "text", "text": "What are the differences between these two cats?"}
    row = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cats/001.jpg"}},
                                                     {"type": "image_url", "value": "cats/002.jpg"}, question]},
                        {"role": "assistant", "content": "The first cat is an orange tabby."}]}
    data = _wild_samples(Entry(str(_jsonl(tmp_path / "u.jsonl", [row]))), "vl", None, vl_processor)
    assert [len(s["images"]) for s in data.samples] == [2]
    from tests.helpers.video_files import write_video

    write_video(tmp_path / "a.mp4", 8)
    video = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "a.mp4"}},
                                                       {"type": "video_url", "value": "a.mp4"}, question]},
                          row["messages"][1]]}
    data = _wild_samples(Entry(str(_jsonl(tmp_path / "v.jsonl", [video]))), "vl", None, vl_processor)
    assert [[p.startswith("video:") for p in s["images"]] for s in data.samples] == [[True, True]]


def test_an_empty_answer_as_content_parts_is_an_empty_answer(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """Issue 48's mutation audit: `[{"type": "text", "text": ""}]` (OpenAI) or `[{"type": "text", "value": ""}]`
    (LLaMA-Factory v1) is an empty answer as `""` is: refused in one line, never trained as a bare end token."""
    for part in ({"type": "text", "text": ""}, {"type": "text", "value": ""}):
        path = _jsonl(tmp_path / "parts.jsonl", [{"messages": [U1, {"role": "assistant", "content": [part]}]}])
        with pytest.raises(ToolkitError, match=r"messages\[1\] is an assistant turn with no content, which would "
                                               r"train a bare end-of-turn token"):
            _samples([path], tok)


def test_two_llamafactory_v1_tool_call_parts_in_one_turn_are_both_kept(tmp_path: Path,
                                                                       tok: PreTrainedTokenizerFast) -> None:
    """Issue 48's mutation audit: a v1 turn with two `tool_call` parts (parallel calls) trains both, in order, not
    only the last."""
    first = json.dumps({"name": "multiply", "arguments": {"a": 6, "b": 8}})
    second = json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})
    row = {"messages": [{"role": "user", "content": [{"type": "text", "value": "6*8 and 1+2?"}]},
                        {"role": "assistant", "content": [{"type": "tool_call", "value": first},
                                                          {"type": "tool_call", "value": second}]}],
           "tools": [{"type": "function", "function": {"name": n, "description": n, "parameters": {
               "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
               for n in ("multiply", "add")]}
    trained = _trained(_samples([_jsonl(tmp_path / "calls.jsonl", [row])], tok)[0], tok)
    assert trained.count("<tool_call>") == 2
    assert trained.index('"name": "multiply"') < trained.index('"name": "add"')
