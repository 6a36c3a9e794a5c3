"""`data.chat_template`: a stock template's name, a path (a .jinja file, a tokenizer/model folder) or Jinja text,
resolved to its text in one place (toolkit.templates.resolve_chat_template) wherever the override is applied;
anything else refused before the model loads. final/ saves the template text that trained. The built-in tiny
models carry their family's stock template, so the embedded default trains tool calls as the real model would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from huggingface_hub import ModelCard

from tests.conftest import CHAT, base_recipe, stock_template, write_jsonl
from tests.helpers.inprocess import Call, invoke
from toolkit.builtin.models import TINY_MODEL, builtin_dir, materialize_builtin
from toolkit.checkpoint.model_card import MODEL_CARD
from toolkit.config.load import load_recipe
from toolkit.data.encoding import TextEncoder, encode_row
from toolkit.errors import ToolkitError
from toolkit.model.load import load_processor, load_tokenizer
from toolkit.templates import CHATML_TEMPLATE, TEMPLATE_NAMES, VL_CHATML_TEMPLATE

NAMES = {"qwen2.5": "qwen2.5", "qwen2.5-instruct": "qwen2.5", "qwen3": "qwen3", "qwen2.5-vl": "qwen2.5-vl",
         "qwen3-vl": "qwen3-vl"}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
TOOL_ROW = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "What is 2 + 3? Use the tool."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "2 + 3 = 5."}]}


def _tok(models: dict[str, str], value: str | None) -> Any:
    return load_tokenizer(models["text"], trust_remote_code=False, chat_template=value)


def test_the_built_in_models_carry_their_familys_template(models: dict[str, str]) -> None:
    assert _tok(models, None).chat_template == stock_template("qwen3")
    processor = load_processor(models["vl"], trust_remote_code=False, chat_template=None)
    assert processor.chat_template == stock_template("qwen2.5-vl")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_name_is_its_stock_template(models: dict[str, str], name: str) -> None:
    assert _tok(models, name).chat_template == stock_template(NAMES[name])


def test_chatml_is_the_text_or_vl_chatml_template(models: dict[str, str]) -> None:
    assert _tok(models, "chatml").chat_template == CHATML_TEMPLATE
    assert load_processor(models["vl"], trust_remote_code=False, chat_template="chatml").chat_template == (
        VL_CHATML_TEMPLATE)


def test_a_jinja_file_relative_to_the_working_directory(tmp_path: Path, models: dict[str, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "mine.jinja").write_text(stock_template("qwen2.5"))
    monkeypatch.chdir(tmp_path)
    assert _tok(models, "templates/mine.jinja").chat_template == stock_template("qwen2.5")
    assert load_recipe(None, ["data.chat_template=templates/mine.jinja"]).data.chat_template == "templates/mine.jinja"


@pytest.mark.parametrize("holder", ["chat_template.jinja", "chat_template.json", "tokenizer_config.json",
                                    "tokenizer_config.json (named templates)", "a tokenizer saved by transformers"])
def test_a_folder_gives_its_own_template(tmp_path: Path, models: dict[str, str], holder: str) -> None:
    folder, text = tmp_path / "tok", stock_template("qwen3-vl")
    folder.mkdir()
    if holder == "chat_template.jinja":
        (folder / holder).write_text(text)
    elif holder == "chat_template.json":
        (folder / holder).write_text(json.dumps({"chat_template": text}))
    elif holder == "tokenizer_config.json":
        (folder / holder).write_text(json.dumps({"chat_template": text, "eos_token": "<|im_end|>"}))
    elif holder.startswith("tokenizer_config.json"):
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
            {"name": "tool_use", "template": "{{ 'other' }}"}, {"name": "default", "template": text}]}))
    else:
        _tok(models, "qwen3-vl").save_pretrained(folder)
    assert _tok(models, str(folder)).chat_template == text


def test_literal_jinja_text(models: dict[str, str]) -> None:
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert _tok(models, text).chat_template == text


@pytest.mark.parametrize("value", ["qwen4", "llama3", "Qwen3"])
def test_an_unknown_name_is_refused_at_validation(value: str) -> None:
    """LLaMA-Factory's `template: qwen3` habit with a name the toolkit does not know: refused with the names (it
    used to be taken as the template's text, and trained)."""
    with pytest.raises(ToolkitError) as info:
        load_recipe(None, [f"data.chat_template={value}"])
    message = str(info.value)
    assert "\n" not in message and f"'{value}' is not a template the toolkit knows" in message
    assert f"({', '.join(TEMPLATE_NAMES)})" in message and "a path to a .jinja file" in message
    assert "Jinja text" in message
    with pytest.raises(ToolkitError, match=r"'data\.chat_template': Value error, is empty; give a template name"):
        load_recipe(None, ['data.chat_template=" "'])


def test_a_missing_path_is_named_missing(tmp_path: Path, models: dict[str, str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    load_recipe(None, ["data.chat_template=templates/nope.jinja"])  # a saved recipe is re-read elsewhere (export)
    with pytest.raises(ToolkitError, match=r"^data\.chat_template: templates/nope\.jinja does not exist \(paths are "
                       rf"relative to the working directory, {tmp_path}\)"):
        _tok(models, "templates/nope.jinja")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ToolkitError, match=r"the folder empty holds no chat template"):
        _tok(models, "empty")


def test_vl_model_refuses_a_template_without_images(models: dict[str, str]) -> None:
    """A text template would drop every image part of a VL model's rows: refused. A VL template on a text model
    renders its text rows as the VL model does (tools too, with Qwen3-VL's): accepted."""
    for value in ("qwen3", "qwen2.5"):
        with pytest.raises(ToolkitError, match=rf"^data\.chat_template {value} cannot render images .* Use chatml, "
                           "qwen2.5-vl, qwen3-vl, or the model's own template"):
            load_processor(models["vl"], trust_remote_code=False, chat_template=value)
    assert load_processor(models["vl"], trust_remote_code=False, chat_template="qwen3-vl").chat_template == (
        stock_template("qwen3-vl"))
    tok = _tok(models, "qwen3-vl")
    ids, labels = encode_row(TOOL_ROW, tok, "assistant", "f:1")
    assert tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != -100]) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>2 + 3 = 5.<|im_end|>')


def test_refusals_point_at_the_template_in_use(models: dict[str, str]) -> None:
    """The model's own template: name the templates that render the field (there is no override to drop). An
    override: also say that removing it brings back the model's own template."""
    tok = _tok(models, "chatml")
    row = {"messages": [CHAT["messages"][0], {"role": "assistant", "content": "4.", "reasoning_content": "2+2"}]}
    with pytest.raises(ToolkitError) as own:  # a model whose own template is ChatML
        TextEncoder(tok, train_on="assistant").encode([row], [1], lambda n: f"d.jsonl:{n}")
    assert "The model's own template is in use: set data.chat_template to one that renders 'reasoning_content' " \
           "(for a Qwen model: qwen3)" in str(own.value)
    assert "remove data.chat_template" not in str(own.value) and "drop data.chat_template" not in str(own.value)
    with pytest.raises(ToolkitError) as override:
        TextEncoder(tok, train_on="assistant", chat_template="chatml").encode([TOOL_ROW], [1], lambda n: f"d:{n}")
    assert "The template in use is data.chat_template (chatml): use one that renders tools (for a Qwen model: " \
           "qwen2.5, qwen3, qwen3-vl), remove data.chat_template to use the model's own" in str(override.value)


def test_a_stale_built_in_model_is_not_reused(tmp_path: Path) -> None:
    """A cache holding a tiny Qwen3 built before the stock templates (ChatML, no think/tool tokens) is not the
    built-in model any more: the build's folder name carries its version."""
    stale = tmp_path / "tiny-qwen3"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (stale / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    path = Path(materialize_builtin(TINY_MODEL, tmp_path))
    assert path == builtin_dir(TINY_MODEL, tmp_path) != stale
    assert (path / "chat_template.jinja").read_text() == stock_template("qwen3")


def _train(tmp_path: Path, model: str, rows: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
           **data: Any) -> tuple[int, str]:
    write_jsonl(tmp_path / "data.jsonl", rows)
    tree = base_recipe(model)
    tree["data"] |= {"max_seq_len": 256, **data}
    tree["checkpoint"] = {"save_steps": 100}
    tree["stages"][0]["max_steps"] = 2
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    return invoke(Call(["--config", "recipe.yaml"], tmp_path / "run"), tmp_path, monkeypatch)


def test_the_embedded_default_trains_tool_calls(tmp_path: Path, models: dict[str, str], one_thread: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Tool-call rows (tools, an assistant turn with tool_calls, a tool result) train on the built-in tiny Qwen3 as
    on Qwen3 (its plain ChatML template used to refuse them), and final/ keeps Qwen3's template."""
    rc, stderr = _train(tmp_path, models["text"], [TOOL_ROW, CHAT] * 4, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert (tmp_path / "run" / "final" / "chat_template.jinja").read_text() == stock_template("qwen3")


def test_final_holds_the_template_text_that_trained(tmp_path: Path, models: dict[str, str], one_thread: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """data.chat_template: qwen2.5 (a name): final/ saves Qwen2.5's template text (it saved the word), and its model
    card names the stock template."""
    rc, stderr = _train(tmp_path, models["text"], [TOOL_ROW, CHAT] * 4, monkeypatch, chat_template="qwen2.5")
    assert rc == 0, stderr[-3000:]
    final = tmp_path / "run" / "final"
    assert (final / "chat_template.jinja").read_text() == stock_template("qwen2.5")
    assert "qwen2.5" not in json.loads((final / "tokenizer_config.json").read_text()).get("chat_template", "")
    assert "## Chat template\n\nqwen2.5 (data.chat_template)." in ModelCard.load(final / MODEL_CARD).text
