"""The direct renderers of the stock Qwen templates (toolkit/data/render.py): byte for byte the Jinja template's
rendering, the same spans as reading the rendering, and the same token ids and masks as the Jinja path, on every
row of the test assets and on generated rows (tools, tool calls and results, think blocks and reasoning, system
prompts anywhere, several turns, empty turns, unicode, image parts). Any other template goes through Jinja, and
data.renderer: jinja forces it."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoProcessor

import toolkit.data.encoding as encoding
import toolkit.data.sources as sources
import toolkit.data.store as store_module
from tests.conftest import stock_template
from toolkit.builtin.dummy_data import write_dummy_vl_data
from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin
from toolkit.config.schema import DataConfig, DataEntry
from toolkit.data.bpe import TWIN_MIN_ROWS, BpeTwin
from toolkit.data.encoding import TextEncoder, chatml_assistant_spans, render_chat
from toolkit.data.render import RENDERERS, Unrendered, direct_renderer
from toolkit.data.sources import open_source, pieces, read_piece, resolve_source
from toolkit.data.store import open_store
from toolkit.data.vision import VLEncoder
from toolkit.errors import ToolkitError

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TEXT_TEMPLATES = ["qwen2.5", "qwen3", "qwen2.5-vl", "qwen3-vl"]  # the VL ones render a text model's rows too

# --- generated rows ------------------------------------------------------------------------------------------------

PIECES = ["hello", "Ünïcödé", "数学", "😀", "  spaced  ", "\n", "\n\n", "<think>", "</think>", "<tool_response>",
          "</tool_response>", "a\tb", "e\u0301", "{\"k\": 1}", " ", "", "The answer is 42.", "\r\n", "ß"]


def _text(rng: random.Random, empty: float = 0.1) -> str:
    if rng.random() < empty:
        return ""
    return "".join(rng.choice(PIECES) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 6)))


def _call(rng: random.Random) -> dict[str, Any]:
    args = rng.choice([{"a": rng.randint(0, 9), "b": "ü"}, {}, "{\"raw\": true}", {"n": {"x": [1, 2.5, None]}}])
    f = {"name": rng.choice(["add", "search_web", "ç"]), "arguments": args}
    return {"type": "function", "function": f} if rng.random() < 0.8 else f


def _parts(rng: random.Random, images: bool) -> list[dict[str, Any]]:
    return [{"type": "image"} if images and rng.random() < 0.4 else {"type": "text", "text": _text(rng)}
            for _ in range(rng.randint(1, 3))]


def generated_chat(seed: int, *, vision: bool = False, tools: bool = True) -> tuple[list[dict[str, Any]], Any]:
    """A random conversation (and tools): every shape the stock templates branch on."""
    rng = random.Random(seed)
    ms: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        ms.append({"role": "system", "content": _parts(rng, False) if vision and rng.random() < 0.3 else _text(rng)})
    for _ in range(rng.randint(1, 4)):
        ms.append({"role": "user", "content": _parts(rng, True) if vision and rng.random() < 0.5 else _text(rng)})
        if tools and rng.random() < 0.3:
            ms.append({"role": "assistant", "content": _text(rng, 0.5),
                       "tool_calls": [_call(rng) for _ in range(rng.randint(1, 2))]})
            ms += [{"role": "tool", "content": _text(rng)} for _ in range(rng.randint(1, 2))]
        answer: dict[str, Any] = {"role": "assistant", "content": _text(rng)}
        r = rng.random()
        if r < 0.2:
            answer["content"] = "<think>\n" + _text(rng) + "\n</think>\n\n" + answer["content"]
        elif r < 0.35:
            answer["reasoning_content"] = _text(rng)
        elif r < 0.4:
            answer["reasoning"] = _text(rng)  # transformers reads it as reasoning_content
        if vision and rng.random() < 0.2:
            answer["content"] = _parts(rng, False)
        ms.append(answer)
        if rng.random() < 0.1:
            ms += [{"role": "system", "content": _text(rng)}, {"role": "user", "content": _text(rng)},
                   {"role": "assistant", "content": _text(rng)}]
    schema = None
    if tools and rng.random() < 0.3:
        schema = [{"type": "function", "function": {"name": "add", "description": "Add ü 😀", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}][:rng.randint(0, 1)]
    return ms, schema


class _Template:
    """What render_chat reads of a tokenizer: its template and special tokens."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.special_tokens_map: dict[str, str] = {}

    def get_chat_template(self, name: Any, tools: Any) -> str:
        return self.text


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_direct_rendering_is_the_templates_byte_for_byte(name: str) -> None:
    """On generated conversations (also ones the encoder's checks would refuse: the renderer is the template), the
    direct renderer writes exactly the Jinja rendering, and its spans are what reading the rendering finds."""
    template = _Template(stock_template(name))
    rendered = 0
    for seed in range(400):
        messages, tools = generated_chat(seed, vision=name.endswith("-vl"))
        expected, _ = render_chat(template, messages, tools, "row")  # type: ignore[arg-type]
        try:
            text, spans = RENDERERS[name](messages, tools)
        except Unrendered:
            continue
        assert text == expected, (seed, messages, tools)
        assert spans == chatml_assistant_spans(expected, sum(m["role"] == "assistant" for m in messages), "row")
        rendered += 1
    assert rendered >= 390  # the fallback is for rows it does not mirror, not for ordinary ones


def test_unmirrored_rows_and_unknown_templates_go_through_jinja() -> None:
    """A tool call without arguments (Jinja's own error), a marker inside a tool schema: not rendered directly. A
    template one byte off a stock one, or data.renderer: jinja, gets no direct renderer."""
    no_arguments = [{"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]
    with pytest.raises(Unrendered):
        RENDERERS["qwen3"](no_arguments, None)
    with pytest.raises(Unrendered):
        RENDERERS["qwen3"]([*no_arguments[:1], {"role": "assistant", "content": "a"}],
                           [{"name": "<|im_end|>"}])
    assert direct_renderer(stock_template("qwen3"))[0] is RENDERERS["qwen3"]
    assert direct_renderer(stock_template("qwen3") + " ")[0] is None
    assert direct_renderer(stock_template("qwen3"), "jinja")[0] is None
    assert DataConfig().renderer == "auto"


# --- the encoder: ids and masks against the Jinja path ---------------------------------------------------------------

def asset_rows() -> list[tuple[str, dict[str, Any]]]:
    """Every row of tests/assets/ and tests/assets/wild/ that reads as rows (pair files as their two sides), as
    training reads it; files that are refused before encoding have no rows."""
    out = []
    wild = [p for p in (ASSETS / "wild").iterdir() if p.is_file() and p.suffix != ".md"]
    for path in sorted([*ASSETS.glob("*.json*"), *wild]):
        for pairs in (False, True):
            try:
                source = resolve_source(DataEntry(str(path)), path.parent)
                open_source(source)
                for piece in pieces(source, 1000):
                    rows, numbers = read_piece(source, piece, pairs=pairs)
                    out += [(f"{path.name}:{n}", row) for row, n in zip(rows, numbers, strict=True)
                            if isinstance(row, dict)]
            except ToolkitError:
                continue
    return out


def _encoded(encoder: Any, row: dict[str, Any], where: str) -> tuple[list[int], list[int]] | str:
    try:
        batch = encoder.encode([row], [1], lambda _: where)
    except ToolkitError as e:
        return str(e)
    return batch.ids.tolist(), batch.mask.tolist()


@pytest.fixture(scope="module")
def toks(qwen_tokenizer: Any) -> dict[str, Any]:
    out = {}
    for name in TEXT_TEMPLATES:
        out[name] = tok = copy.copy(qwen_tokenizer)  # shares the read-only backend; only the template differs
        tok.chat_template = stock_template(name)
    return out


def test_masks_equal_the_jinja_paths_on_every_asset_and_generated_row(toks: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The real Qwen tokenizer under each stock template, data.thinking auto / empty / none, train_on assistant
    and all: the same ids and masks (or the same error) as the Jinja path, row by row; and the direct path renders
    every asset row without Jinja."""
    rows = asset_rows()
    assert len(rows) > 30
    generated = [(f"gen:{seed}", {"messages": generated_chat(seed, tools=True)[0]}) for seed in range(60)]
    jinja_calls = []
    real = encoding.render_chat

    def counted(*args: Any, **kw: Any) -> Any:
        jinja_calls.append(1)
        return real(*args, **kw)

    same = 0
    for name, tok in toks.items():
        for thinking, train_on in (("auto", "assistant"), ("none", "assistant"), ("empty", "all")):
            if name != "qwen3" and thinking == "empty":
                continue
            ref = TextEncoder(tok, train_on=train_on, thinking=thinking, renderer="jinja")
            new = TextEncoder(tok, train_on=train_on, thinking=thinking)
            twin = TextEncoder(tok, train_on=train_on, thinking=thinking)  # tokenised by the tiktoken twin
            twin.prepare_for(TWIN_MIN_ROWS)
            assert twin.twin is not None
            for where, row in [*rows, *generated]:
                expected = _encoded(ref, row, where)
                with monkeypatch.context() as m:
                    m.setattr(encoding, "render_chat", counted)
                    got = _encoded(new, row, where)
                    by_twin = _encoded(twin, row, where)
                assert got == expected, (name, thinking, where)
                assert by_twin == expected, (name, thinking, where, "twin")
                same += not isinstance(got, str)
    assert same > 500
    assert not jinja_calls  # no asset or generated row fell back to Jinja


def test_a_forced_jinja_store_and_a_direct_one_are_the_same_bytes(toks: dict[str, Any], tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The token store of a chat file prepared by the direct renderer has the same sha256 as the one the Jinja
    path prepares (data.renderer: jinja is its own store), and which renderer was chosen is said once. So has one
    prepared by two worker processes that tokenise with the tiktoken twin (built before they fork, as for a large
    file: the row threshold set to 0 here)."""
    data = tmp_path / "chat.jsonl"
    with data.open("w") as f:
        for seed in range(40):
            messages, tools = generated_chat(seed)
            messages = [{("reasoning_content" if k == "reasoning" else k): v for k, v in m.items()} for m in messages]
            f.write(json.dumps({"messages": messages, "tools": tools}) + "\n")
    source = resolve_source(DataEntry(str(data)), tmp_path)
    digests = {}
    with caplog.at_level(logging.INFO, logger="toolkit.data.encoding"):
        encoding._SAID.clear()
        for renderer in ("auto", "jinja", "auto"):
            encoder = TextEncoder(toks["qwen3"], train_on="assistant", empty_answers="skip", renderer=renderer)
            store = open_store(source, encoder, tmp_path / "cache", num_proc=1)
            assert store.path is not None and len(store) == 40
            digests[renderer] = hashlib.sha256((store.path / "data.arrow").read_bytes()).hexdigest()
    said = [r.message for r in caplog.records if "chat rows rendered" in r.message]
    assert said == ["data: chat rows rendered by the direct renderer of the stock qwen3 template",
                    "data: chat rows rendered through the Jinja chat template (data.renderer: jinja)"]
    assert digests["auto"] == digests["jinja"]
    assert len(list((tmp_path / "cache" / "stores").glob("*/data.arrow"))) == 2
    monkeypatch.setattr(store_module, "ROWS_PER_PROCESS", 10)  # two workers for 40 rows, in pieces of 10
    monkeypatch.setattr(store_module, "PIECE_ROWS", 10)
    monkeypatch.setattr(sources, "_jsonl_piece_bytes", lambda per_row, rows: per_row * rows)  # no 64 KB floor
    users = tmp_path / "twin-users"  # the processes that tokenised by the twin (forked workers inherit the patch)
    real_encode = BpeTwin.encode

    def encode(self: BpeTwin, text: str) -> Any:
        with users.open("a") as f:
            f.write(f"{os.getpid()}\n")
        return real_encode(self, text)

    monkeypatch.setattr(BpeTwin, "encode", encode)
    split = {}
    for threshold in (10**9, 0):  # the fast tokenizer alone, then the twin
        monkeypatch.setattr(encoding, "TWIN_MIN_ROWS", threshold)
        with caplog.at_level(logging.INFO, logger="toolkit.data.bpe"):
            encoder = TextEncoder(toks["qwen3"], train_on="assistant", empty_answers="skip")
            store = open_store(source, encoder, tmp_path / f"cache-{threshold}", num_proc=2)
        assert (encoder.twin is not None) == (threshold == 0)
        assert store.path is not None and store.meta["prepared"]["processes"] == 2
        split[threshold] = hashlib.sha256((store.path / "data.arrow").read_bytes()).hexdigest()
    assert split[0] == split[10**9]
    assert len(set(users.read_text().split()) - {str(os.getpid())}) == 2  # both workers used the twin


def test_vl_rows_with_images_equal_the_jinja_path(tmp_path: Path) -> None:
    """A vision-language processor (the built-in tiny Qwen2.5-VL's), under both VL stock templates: image rows
    (image parts where the generated rows have them, their files written) give the same ids, masks and image grids
    as the Jinja path."""
    processor = AutoProcessor.from_pretrained(materialize_builtin(TINY_VL_MODEL, tmp_path / "model"))
    write_dummy_vl_data(tmp_path, 4)
    image = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "images").glob("*.png"))[0]
    compared = 0
    for name in ("qwen2.5-vl", "qwen3-vl"):
        processor.chat_template = stock_template(name)
        ref = VLEncoder(processor, train_on="assistant", renderer="jinja")
        new = VLEncoder(processor, train_on="assistant")
        for seed in range(60):
            messages, tools = generated_chat(seed, vision=True, tools=name == "qwen3-vl")
            n = sum(p.get("type") == "image" for m in messages if isinstance(m["content"], list)
                    for p in m["content"])
            row = {"messages": messages, "images": [image] * n, **({"tools": tools} if tools is not None else {})}
            results = []
            for encoder in (ref, new):
                try:
                    batch = encoder.encode([row], [1], lambda _: "row", tmp_path)
                    results.append((batch.ids.tolist(), batch.mask.tolist(), batch.grids))
                except ToolkitError as e:
                    results.append(str(e))
            assert results[0] == results[1], (name, seed)
            compared += not isinstance(results[0], str) and n > 0
    assert compared > 20
