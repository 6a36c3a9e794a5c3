"""The real Qwen tokenizer with Qwen's stock chat templates: every conversation shape trains exactly.

For each template (Qwen2.5-Instruct, Qwen3, and the text rows of Qwen2.5-VL and Qwen3-VL) and each shape, the
token ids must equal the stock rendering tokenised, and the trained tokens must be exactly the assistant turns as
that rendering shows them: one run per turn, written out by hand below, that starts after the header
`<|im_start|>assistant\n` and ends with `<|im_end|>` (the newline after it untrained).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import stock_template
from toolkit.builtin.text_model import QWEN_VOCAB_SIZE
from toolkit.data.encoding import IGNORE_INDEX, encode_row
from toolkit.data.plan import encode_files
from toolkit.errors import ToolkitError
from toolkit.templates import CHATML_TEMPLATE

TEMPLATES = ["qwen2.5", "qwen3", "qwen2.5-vl", "qwen3-vl"]
Q = "What is 17 + 25?"
SINGLE = [{"role": "user", "content": Q}, {"role": "assistant", "content": "42."}]
MULTI = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."},
         {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "It is 8."}]
SYSTEM = [{"role": "system", "content": "Be brief."}, *SINGLE]
THINK_IN_CONTENT = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\nIt is 8."},
]
REASONING_FIELD = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5.", "reasoning_content": "Add them."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8.", "reasoning_content": "Add again."},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
TOOL_CALLS = [
    {"role": "user", "content": "What is 2 + 3? Use the tool."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "2 + 3 = 5."},
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
E = "<|im_end|>"
EMPTY = "<think>\n\n</think>\n\n"

# (shape, row, {template: trained runs, or an error pattern}). Qwen3 drops the think block of history turns and
# renders one (empty when there is no reasoning) on the turns after the last user query.
CASES: list[tuple[str, dict[str, Any], dict[str, list[str] | str]]] = [
    ("single", {"messages": SINGLE}, {
        "qwen2.5": ["42." + E], "qwen3": [EMPTY + "42." + E], "qwen2.5-vl": ["42." + E],
        "qwen3-vl": ["42." + E]}),
    ("multi", {"messages": MULTI}, {
        "qwen2.5": ["5." + E, "It is 8." + E], "qwen3": ["5." + E, EMPTY + "It is 8." + E],
        "qwen2.5-vl": ["5." + E, "It is 8." + E], "qwen3-vl": ["5." + E, "It is 8." + E]}),
    ("system", {"messages": SYSTEM}, {
        "qwen2.5": ["42." + E], "qwen3": [EMPTY + "42." + E], "qwen2.5-vl": ["42." + E],
        "qwen3-vl": ["42." + E]}),
    ("think_in_content", {"messages": THINK_IN_CONTENT}, {
        "qwen2.5": [THINK_IN_CONTENT[1]["content"] + E, THINK_IN_CONTENT[3]["content"] + E],
        "qwen3": ["5." + E, "<think>\nAdd again.\n</think>\n\nIt is 8." + E],
        "qwen2.5-vl": [THINK_IN_CONTENT[1]["content"] + E, THINK_IN_CONTENT[3]["content"] + E],
        "qwen3-vl": [THINK_IN_CONTENT[1]["content"] + E, THINK_IN_CONTENT[3]["content"] + E]}),
    ("reasoning_content", {"messages": REASONING_FIELD}, {
        "qwen2.5": "has 'reasoning_content' but the chat template does not render it",
        "qwen3": ["5." + E, "<think>\nAdd again.\n</think>\n\nIt is 8." + E],
        "qwen2.5-vl": "has 'reasoning_content' but the chat template does not render it",
        "qwen3-vl": "has 'reasoning_content' but the chat template does not render it"}),
    ("tool_calls", {"messages": TOOL_CALLS, "tools": TOOLS}, {
        "qwen2.5": [CALL, "2 + 3 = 5." + E], "qwen3": [CALL, EMPTY + "2 + 3 = 5." + E],
        "qwen2.5-vl": "has 'tools' but the chat template does not render tools",
        "qwen3-vl": [CALL, "2 + 3 = 5." + E]}),
    ("assistant_first", {"messages": [{"role": "assistant", "content": "Hi."}, *SINGLE]},
     dict.fromkeys(TEMPLATES, "starts with an assistant turn")),
    ("trailing_user", {"messages": [*SINGLE, {"role": "user", "content": "Thanks."}]},
     dict.fromkeys(TEMPLATES, "ends with a user turn")),
]


def _tok(qwen_tokenizer: Any, template: str) -> Any:
    tok = copy.copy(qwen_tokenizer)  # shares the (read-only) backend; only the template differs
    tok.chat_template = stock_template(template) if template != "chatml" else CHATML_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def toks(qwen_tokenizer: Any) -> dict[str, Any]:
    return {name: _tok(qwen_tokenizer, name) for name in [*TEMPLATES, "chatml"]}


def trained_runs(ids: list[int], labels: list[int], tok: Any) -> list[tuple[int, int]]:
    """(start, end) token positions of each maximal run of trained tokens."""
    runs, start = [], None
    for i, lab in enumerate([*labels, IGNORE_INDEX]):
        if lab != IGNORE_INDEX and start is None:
            start = i
        elif lab == IGNORE_INDEX and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize(("shape", "row", "expected"), CASES, ids=[c[0] for c in CASES])
def test_stock_template_shapes(toks: dict[str, Any], template: str, shape: str, row: dict[str, Any],
                               expected: dict[str, list[str] | str]) -> None:
    tok, want = toks[template], expected[template]
    if isinstance(want, str):
        with pytest.raises(ToolkitError, match=rf"^data\.jsonl:3: .*{want}"):
            encode_row(row, tok, "assistant", "data.jsonl:3")
        return
    ids, labels = encode_row(row, tok, "assistant", "data.jsonl:3")
    assert ids == tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True,
                                          return_dict=True)["input_ids"]
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels, strict=True))
    runs = trained_runs(ids, labels, tok)
    assert [tok.decode(ids[a:b]) for a, b in runs] == want
    header = tok.encode("<|im_start|>assistant\n")
    for a, b in runs:
        assert ids[a - 3:a] == header or (ids[a - 2:a] == header[:2] and tok.decode(ids[a:a + 1])[0] == "\n"
                                          and template == "qwen2.5")  # "\n<tool_call>": see below
        assert ids[b - 1] == tok.convert_tokens_to_ids("<|im_end|>") and tok.decode(ids[b:b + 1]) == "\n"
    assert sum(b - a for a, b in runs) == sum(lab != IGNORE_INDEX for lab in labels)


def test_qwen25_tool_call_header(toks: dict[str, Any]) -> None:
    """Qwen2.5 renders a tool-call turn as `<|im_start|>assistant\\n<tool_call>...`: the newline is the header's,
    as at inference, where the prompt ends with `<|im_start|>assistant\\n`."""
    tok = toks["qwen2.5"]
    ids, labels = encode_row({"messages": TOOL_CALLS, "tools": TOOLS}, tok, "assistant", "f:1")
    a, _ = trained_runs(ids, labels, tok)[0]
    assert ids[a - 3:a] == tok.encode("<|im_start|>assistant\n") and tok.decode(ids[a:a + 1]) == "<tool_call>"


def test_tools_reach_the_template(toks: dict[str, Any]) -> None:
    tok = toks["qwen3"]
    ids, labels = encode_row({"messages": TOOL_CALLS, "tools": TOOLS}, tok, "assistant", "f:1")
    prompt = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX])
    assert "# Tools" in prompt and '"name": "add", "description": "Add two integers."' in prompt


@pytest.mark.parametrize(("thinking", "template", "want"), [
    ("auto", "qwen3", [EMPTY + "42." + E]),
    ("none", "qwen3", ["42." + E]),
    ("empty", "qwen3", [EMPTY + "42." + E]),
    ("auto", "qwen2.5", ["42." + E]),
    ("empty", "qwen2.5", [EMPTY + "42." + E]),
    ("none", "qwen2.5", ["42." + E]),
])
def test_thinking_modes(toks: dict[str, Any], thinking: str, template: str, want: list[str]) -> None:
    tok = toks[template]
    ids, labels = encode_row({"messages": SINGLE}, tok, "assistant", "f:1", thinking)
    assert [tok.decode(ids[a:b]) for a, b in trained_runs(ids, labels, tok)] == want
    # The ids are the rendering with exactly that change, tokenised.
    text = tok.apply_chat_template(SINGLE, tokenize=False)
    if thinking == "none":
        text = text.replace(EMPTY, "")
    elif thinking == "empty" and EMPTY not in text:
        text = text.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n" + EMPTY)
    assert ids == tok.encode(text)
    # A template with generation markers decides what trains itself: data.thinking other than auto is refused.
    with pytest.raises(ToolkitError, match=r"data\.thinking: none applies to ChatML-family templates without"):
        encode_row({"messages": SINGLE}, toks["chatml"], "assistant", "f:1", "none")
    # Reasoning is never removed by 'none': only empty think blocks are.
    ids, labels = encode_row({"messages": REASONING_FIELD}, toks["qwen3"], "assistant", "f:1", "none")
    assert "<think>\nAdd again.\n</think>" in toks["qwen3"].decode(ids)


@pytest.mark.parametrize(("row", "match"), [
    ({"messages": [*TOOL_CALLS[:2], {"role": "tool", "content": "5"}, TOOL_CALLS[3]]},
     "has 'tool_calls' but the chat template does not render it"),
    ({"messages": SINGLE, "tools": TOOLS}, "has 'tools' but the chat template does not render tools"),
    ({"messages": REASONING_FIELD}, "has 'reasoning_content' but the chat template does not render it"),
    ({"messages": [SINGLE[0], {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "5"},
                   SINGLE[1]]}, "has a tool turn but the chat template has no format for tool results"),
])
def test_chatml_override_refuses_what_it_cannot_render(tmp_path: Path, toks: dict[str, Any], row: dict[str, Any],
                                                       match: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": SINGLE}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ToolkitError, match=match) as info:
        encode_files([path], toks["chatml"], max_seq_len=512, overlength="drop", train_on="assistant")
    assert str(info.value).startswith(f"{path}:2: ")


@pytest.fixture(scope="module")
def tiny_qwen3_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The built-in tiny Qwen3's tokenizer, as `builtin:tiny-qwen3` saves it."""
    from toolkit.builtin.models import TINY_MODEL, materialize_builtin

    return AutoTokenizer.from_pretrained(materialize_builtin(TINY_MODEL, tmp_path_factory.mktemp("builtin")))


@pytest.mark.parametrize(("shape", "row", "expected"), [*CASES, ("thinking_with_tools", {"messages": [
    *TOOL_CALLS[:3], {"role": "assistant", "content": "2 + 3 = 5.", "reasoning_content": "The tool said 5."}],
    "tools": TOOLS}, {})], ids=[*(c[0] for c in CASES), "thinking_with_tools"])
def test_tiny_qwen3_renders_and_trains_as_qwen3(toks: dict[str, Any], tiny_qwen3_tok: Any, shape: str,
                                                row: dict[str, Any], expected: dict[str, list[str] | str]) -> None:
    """The embedded default's tokenizer renders every shape (tools, tool calls and results, think blocks) to the
    text the real Qwen3 tokenizer with its stock template renders, trains the same text, and refuses what Qwen3
    refuses; its template tokens are single ids as Qwen's are."""
    real, tiny = toks["qwen3"], tiny_qwen3_tok
    if isinstance(expected.get("qwen3"), str):
        with pytest.raises(ToolkitError, match=expected["qwen3"]):
            encode_row(row, tiny, "assistant", "f:1")
        return
    got, want = encode_row(row, tiny, "assistant", "f:1"), encode_row(row, real, "assistant", "f:1")
    assert tiny.decode(got[0]) == real.decode(want[0])
    trained = [[t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX] for ids, labels in (got, want)]
    assert tiny.decode(trained[0]) == real.decode(trained[1])
    for token in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert got[0].count(tiny.convert_tokens_to_ids(token)) == want[0].count(real.convert_tokens_to_ids(token))


def test_real_tokenizer_and_tiny_qwen3_load_with_from_pretrained(qwen3_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    assert tok.encode("Hello world") == [9707, 1879] and len(tok) == 151669
    assert model.config.vocab_size == QWEN_VOCAB_SIZE == model.get_input_embeddings().weight.shape[0]
    assert tok.chat_template == stock_template("qwen3")
    ids, labels = encode_row({"messages": MULTI}, tok, "assistant", "f:1")
    assert tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]) == (
        "5." + E + EMPTY + "It is 8." + E)


def _recipe(tmp_path: Path, model: Path, rows: list[dict[str, Any]], **data: Any) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(model)},
              "data": {"max_seq_len": 512, **data},
              "stages": [{"name": "chat", "data": [str(path)], "max_steps": 1},
                         {"name": "again", "data": [str(path)], "max_steps": 1}]}
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    return tmp_path / "recipe.yaml"


def test_inspect_data_marks_trained_tokens(tmp_path: Path, qwen3_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from toolkit.commands.cli import main

    rows = [{"messages": MULTI}, {"messages": TOOL_CALLS, "tools": TOOLS}, {"messages": SINGLE}]
    recipe = _recipe(tmp_path, qwen3_dir, rows)
    assert main(["inspect-data", "--config", str(recipe), "--stage", "chat", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "=== stage 'chat'" in out and "=== stage 'again'" not in out
    assert "stage 'chat' data: 3 rows, 3 kept" in out and "tokens per row: p50" in out and "of tokens trained" in out
    path = tmp_path / "chat.jsonl"  # rows are named by their place in the file
    row1 = out.split(f"--- {path}:1 ")[1].split(f"--- {path}:2 ")[0]
    assert ("<|im_start|>assistant\n[[5.<|im_end|>]]\n<|im_start|>user\nAnd 4 + 4?<|im_end|>\n"
            "<|im_start|>assistant\n[[<think>\n\n</think>\n\nIt is 8.<|im_end|>]]\n") in row1
    row2 = out.split(f"--- {path}:2 ")[1]
    assert "# Tools" in row2 and "[[" + CALL + "]]" in row2 and f"--- {path}:3 " not in out
    # data.thinking: none drops the empty think block from what is trained.
    assert main(["inspect-data", "--config", str(recipe), "--rows", "1", "data.thinking=none"]) == 0
    assert "<|im_start|>assistant\n[[It is 8.<|im_end|>]]" in capsys.readouterr().out
    assert main(["inspect-data", "--config", str(recipe), "--stage", "nope"]) == 2
    assert "error: --stage 'nope' is not a stage of the recipe; its stages are ['chat', 'again']" in (
        capsys.readouterr().err)


def test_inspect_data_colours_on_a_terminal(qwen3_dir: Path, toks: dict[str, Any]) -> None:
    from toolkit.commands.inspect_data import GREEN, RESET, mark_trained

    tok = toks["qwen3"]
    ids, labels = encode_row({"messages": SINGLE}, tok, "assistant", "f:1")
    text = mark_trained(ids, labels, tok, colour=True)
    assert text.endswith(f"<|im_start|>assistant\n{GREEN}{EMPTY}42.{E}{RESET}\n") and "[[" not in text


# --- vision-language: stock Qwen2.5-VL / Qwen3-VL templates through the processor -----------------------------------

IMG = {"type": "image"}
VL_CASES: list[tuple[str, dict[str, Any], dict[str, list[str] | str]]] = [
    ("single", {"messages": [{"role": "user", "content": [IMG, {"type": "text", "text": "Colour?"}]},
                             {"role": "assistant", "content": "Red."}], "images": ["a.png"]},
     {key: ["Red." + E] for key in ["qwen2.5-vl", "qwen3-vl"]}),
    ("multi_system", {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [IMG, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, IMG]},
        {"role": "assistant", "content": "<think>\nLook.\n</think>\n\nBlue."}], "images": ["a.png", "b.png"]},
     {key: ["Red." + E, "<think>\nLook.\n</think>\n\nBlue." + E] for key in ["qwen2.5-vl", "qwen3-vl"]}),
    ("tool_calls", {"messages": TOOL_CALLS, "tools": TOOLS}, {
        "qwen2.5-vl": "has 'tools' but the chat template does not render tools",
        "qwen3-vl": [CALL, "2 + 3 = 5." + E]}),
    ("reasoning_content", {"messages": REASONING_FIELD}, dict.fromkeys(
        ["qwen2.5-vl", "qwen3-vl"], "has 'reasoning_content' but the chat template does not render it")),
    ("trailing_user", {"messages": [*SINGLE, {"role": "user", "content": "Thanks."}]},
     dict.fromkeys(["qwen2.5-vl", "qwen3-vl"], "ends with a user turn")),
]


@pytest.fixture(scope="module")
def vl_processors(qwen_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from toolkit.builtin.vl_model import Qwen2_5_VLImageOnlyProcessor

    images = tmp_path_factory.mktemp("vl-images")
    for name, colour in (("a.png", "red"), ("b.png", "blue")):
        Image.new("RGB", (56, 56), colour).save(images / name)
    out = {}
    for name, patch in (("qwen2.5-vl", 14), ("qwen3-vl", 16)):
        tok = _tok(qwen_tokenizer, name)
        image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=patch,
                                                   temporal_patch_size=2, merge_size=2)
        out[name] = Qwen2_5_VLImageOnlyProcessor(image_processor=image_processor, tokenizer=tok,
                                                 chat_template=tok.chat_template)
    return out, images


@pytest.mark.parametrize("template", ["qwen2.5-vl", "qwen3-vl"])
@pytest.mark.parametrize(("shape", "row", "expected"), VL_CASES, ids=[c[0] for c in VL_CASES])
def test_stock_vl_template_shapes(vl_processors: tuple[dict[str, Any], Path], template: str, shape: str,
                                  row: dict[str, Any], expected: dict[str, list[str] | str]) -> None:
    from PIL import Image

    from toolkit.data.vision import encode_vl_row

    processors, images = vl_processors
    processor, want = processors[template], expected[template]
    kwargs = {"train_on": "assistant", "max_seq_len": 4096, "overlength": "error", "base_dir": images,
              "where": "vl.jsonl:2"}
    if isinstance(want, str):
        with pytest.raises(ToolkitError, match=rf"^vl\.jsonl:2: .*{want}"):
            encode_vl_row(row, processor, **kwargs)
        return
    sample = encode_vl_row(row, processor, **kwargs)
    ids, labels = sample["input_ids"], sample["labels"]
    loaded = iter([Image.open(images / p).convert("RGB") for p in row.get("images", [])])
    conversation = [{**m, "content": [{**p, "image": next(loaded)} if p["type"] == "image" else p
                                      for p in m["content"]]} if isinstance(m["content"], list) else m
                    for m in row["messages"]]
    stock = processor.apply_chat_template(conversation, tools=row.get("tools"), tokenize=True, return_dict=True)
    assert ids == [int(t) for t in stock["input_ids"][0]]
    tok = processor.tokenizer
    runs = trained_runs(ids, labels, tok)
    assert [tok.decode(ids[a:b]) for a, b in runs] == want
    for a, b in runs:
        assert ids[a - 3:a] == tok.encode("<|im_start|>assistant\n") and tok.decode(ids[b:b + 1]) == "\n"
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == (len(row.get("images", [])) and sum(
        int(torch.tensor(g).prod()) // 4 for g in sample["image_grid_thw"]))


def test_final_saves_the_template_override(tmp_path: Path, qwen3_dir: Path) -> None:
    """docs/data.md: with data.chat_template set, final/ holds the tokenizer with the override (the format the run
    trained); the model's own template stays in the base model's directory."""
    from toolkit.model.load import load_tokenizer

    tok = load_tokenizer(str(qwen3_dir), trust_remote_code=False, chat_template="chatml")
    tok.save_pretrained(tmp_path)  # what checkpoint.save_final does with the run's tokenizer
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == CHATML_TEMPLATE
    assert (qwen3_dir / "chat_template.jinja").read_text() == stock_template("qwen3")


def test_vl_token_masking_equals_generation_markers(vl_processors: tuple[dict[str, Any], Path]) -> None:
    """The tiny VL processor (its own small tokenizer): reading the turns off the token ids trains exactly what the
    {% generation %} markers of its ChatML template mark."""
    from toolkit.builtin.vl_model import build_vl_processor
    from toolkit.data.vision import encode_vl_row
    from toolkit.templates import VL_CHATML_TEMPLATE

    _, images = vl_processors
    marked, plain = build_vl_processor(VL_CHATML_TEMPLATE), build_vl_processor(VL_CHATML_TEMPLATE)
    plain.chat_template = VL_CHATML_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    kwargs = {"train_on": "assistant", "max_seq_len": 4096, "overlength": "error", "base_dir": images, "where": "f:1"}
    for _, row, _ in VL_CASES[:2]:
        assert encode_vl_row(row, plain, **kwargs) == encode_vl_row(row, marked, **kwargs)
    assert encode_vl_row({"messages": MULTI}, plain, **kwargs) == encode_vl_row({"messages": MULTI}, marked, **kwargs)


def test_thinking_key_is_validated() -> None:
    from toolkit.config.load import load_recipe

    assert load_recipe(None, ["data.thinking=none"]).data.thinking == "none"
    assert load_recipe(None).data.thinking == "auto"
    with pytest.raises(ToolkitError, match=r"data\.thinking"):
        load_recipe(None, ["data.thinking=maybe"])


# --- per-turn weights: "weight": 0 (or "training": false) leaves exactly that turn out ----------------------------

def _without_turn(messages: list[dict[str, Any]], k: int, flag: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages with `flag` on the k-th assistant turn."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [dict(m, **flag) if i == turns[k] else m for i, m in enumerate(messages)]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("shape", ["multi", "tool_calls", "think_in_content"])
@pytest.mark.parametrize("flag", [{"weight": 0}, {"training": False}])
def test_turn_weights_with_stock_templates(toks: dict[str, Any], template: str, shape: str,
                                           flag: dict[str, Any]) -> None:
    """The ChatML span path: leaving out turn k trains exactly the other turns' runs of the stock rendering (Qwen3's
    history rewrite included), on the same token ids."""
    _, row, expected = next(c for c in CASES if c[0] == shape)
    want = expected[template]
    if isinstance(want, str):  # a shape this template refuses, weights or not
        return
    tok = toks[template]
    ids, _ = encode_row(row, tok, "assistant", "f:1")
    for k in range(len(want)):
        got_ids, labels = encode_row(dict(row, messages=_without_turn(row["messages"], k, flag)), tok, "assistant",
                                     "f:1")
        assert got_ids == ids
        assert [tok.decode(got_ids[a:b]) for a, b in trained_runs(got_ids, labels, tok)] == \
            [run for i, run in enumerate(want) if i != k]


@pytest.mark.parametrize("thinking", ["none", "empty"])
def test_turn_weights_with_thinking_modes(toks: dict[str, Any], thinking: str) -> None:
    """data.thinking edits the rendering first; the flag then leaves out its turn of that rendering."""
    tok = toks["qwen3"]
    ids, labels = encode_row({"messages": MULTI}, tok, "assistant", "f:1", thinking)
    runs = [tok.decode(ids[a:b]) for a, b in trained_runs(ids, labels, tok)]
    got_ids, got_labels = encode_row({"messages": _without_turn(MULTI, 1, {"weight": 0})}, tok, "assistant", "f:1",
                                     thinking)
    assert got_ids == ids
    assert [tok.decode(got_ids[a:b]) for a, b in trained_runs(got_ids, got_labels, tok)] == runs[:1]


@pytest.mark.parametrize("template", ["qwen2.5-vl", "qwen3-vl"])
def test_turn_weights_with_stock_vl_templates(vl_processors: tuple[dict[str, Any], Path], template: str) -> None:
    """VL rows through the stock templates (turns read off the token ids): the flagged turn is left out."""
    from toolkit.data.vision import encode_vl_row

    processors, images = vl_processors
    processor = processors[template]
    _, row, expected = next(c for c in VL_CASES if c[0] == "multi_system")
    kwargs = {"train_on": "assistant", "max_seq_len": 4096, "overlength": "error", "base_dir": images, "where": "f:1"}
    full = encode_vl_row(row, processor, **kwargs)
    tok = processor.tokenizer
    for k, flag in ((0, {"weight": 0}), (1, {"training": False})):
        got = encode_vl_row(dict(row, messages=_without_turn(row["messages"], k, flag)), processor, **kwargs)
        assert got["input_ids"] == full["input_ids"] and got["image_grid_thw"] == full["image_grid_thw"]
        runs = trained_runs(got["input_ids"], got["labels"], tok)
        assert [tok.decode(got["input_ids"][a:b]) for a, b in runs] == [r for i, r in enumerate(expected[template])
                                                                         if i != k]
    with pytest.raises(ToolkitError, match=r"^f:1: messages\[2\]\.weight is 0\.5; only 0"):
        encode_vl_row(dict(row, messages=_without_turn(row["messages"], 0, {"weight": 0.5})), processor, **kwargs)
