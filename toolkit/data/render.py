"""Direct renderers of the stock Qwen chat templates the toolkit ships: the same text as the Jinja template, written
in plain Python, with each assistant turn's character span known as it is written.

Rendering a row through Jinja (transformers' sandboxed environment) costs about as much as tokenising it: the
sandbox checks every attribute access. For the templates in `toolkit/chat_templates/` (Qwen2.5, Qwen3, Qwen2.5-VL,
Qwen3-VL) this module writes the rendering directly. A template is recognised only by its exact text (the
tokenizer's `chat_template` equal to a shipped file); any other template, a user's or a hub copy that differs by
one byte, goes through Jinja as before (`toolkit/data/encoding.py` `render_chat`). `data.renderer: jinja` forces
Jinja for every template.

Each renderer mirrors its template branch by branch, including what transformers does before rendering: message
keys whose value is None dropped, `reasoning_content` filled from `thinking` or `reasoning`
(`_alias_reasoning_fields`, in the versions that have it), tools and tool-call arguments made plain JSON data
(`_plain_template_data`) before `tojson` (`json.dumps(ensure_ascii=False)`). What a renderer does not mirror exactly
(a missing tool-call `arguments`, a value that is not a string where the template concatenates strings, a
chat-format marker inside tools or tool calls) raises `Unrendered`, and the caller renders that row through Jinja,
which gives the template's own output or error. tests/data/test_render.py proves byte identity with the Jinja
rendering and mask identity with the Jinja path on every test asset and on generated rows.

The spans are what `chatml_assistant_spans` reads off the rendering (after `<|im_start|>assistant` and its newline,
through `<|im_end|>`), one per assistant message, so masks need no second pass over the text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from transformers.utils import chat_template_utils

from toolkit.templates import IM_END, IM_START, STOCK_FILES, stock_template

Spans = list[tuple[int, int]]
Renderer = Callable[[list[dict[str, Any]], Any], tuple[str, Spans]]
"""(messages, tools) -> (rendering, character spans of the assistant turns in order)."""

_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
               "function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call><|im_end|>\n")
_QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ALIASES = hasattr(chat_template_utils, "_alias_reasoning_fields")  # transformers' versions that alias reasoning
_plain = getattr(chat_template_utils, "_plain_template_data", lambda value: value)  # and those that make data plain


class Unrendered(Exception):
    """A row this renderer does not mirror exactly: render it through Jinja instead."""


def _safe(text: str) -> str:
    """Text from tools or tool calls, which the encoder's checks do not cover: a chat-format marker in it would
    change where turns are read, so such a row goes through Jinja (and its checks)."""
    if IM_START in text or IM_END in text:
        raise Unrendered
    return text


def _tojson(value: Any) -> str:
    """transformers' `tojson` filter on the plain data the template sees."""
    try:
        return _safe(json.dumps(_plain(value), ensure_ascii=False))
    except (TypeError, ValueError):
        raise Unrendered from None


def _s(value: Any) -> str:
    """A value the template concatenates with `+`: only a string is mirrored."""
    if type(value) is not str:
        raise Unrendered
    return value


def _normal(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: None values dropped (render_chat), reasoning aliased (transformers'
    `_alias_reasoning_fields`)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None) if _ALIASES else None
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _tools_block(tools: Any, system: str | None, default: str | None, sep: str) -> str:
    """The system turn of a template given tools: the system prompt (or `default`), `sep`, the tool list."""
    if not isinstance(tools, list):
        raise Unrendered
    head = system if system is not None else (default or "")
    lead = head + sep if (system is not None or default is not None) else ""
    return (IM_START + "system\n" + lead + _TOOLS_HEAD + "".join("\n" + _tojson(t) for t in tools) + _TOOLS_TAIL)


class _Writer:
    """The rendering as a list of pieces, with its length and the spans of assistant turns."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.spans: Spans = []
        self.open: int | None = None

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)

    def assistant(self) -> None:
        """Writes the assistant header and its newline; the turn's span starts after them."""
        self.add(IM_START + "assistant\n")
        self.open = self.size

    def end_assistant(self) -> None:
        self.add(IM_END)
        assert self.open is not None
        self.spans.append((self.open, self.size))
        self.open = None
        self.add("\n")

    def done(self) -> tuple[str, Spans]:
        return "".join(self.parts), self.spans


def _qwen3_tool_calls(w: _Writer, calls: Any, after_content: bool) -> None:
    """An assistant turn's tool calls as Qwen3's and Qwen3-VL's templates write them: each `<tool_call>` on a line
    of its own (a newline before every call but a first one that no content precedes)."""
    if not calls:
        return
    if not isinstance(calls, list):
        raise Unrendered
    for k, tc in enumerate(calls):
        if k > 0 or after_content:
            w.add("\n")
        name, args = _call(tc, truthy_function=True)
        w.add('<tool_call>\n{"name": "' + name + '", "arguments": '
              + (_safe(args) if type(args) is str else _tojson(args)) + "}\n</tool_call>")


def _call(tc: Any, truthy_function: bool) -> tuple[str, Any]:
    """A tool call's name and arguments (the `function` object when there is one)."""
    if not isinstance(tc, dict):
        raise Unrendered
    f = tc.get("function")
    if (f if truthy_function else "function" in tc):
        tc = f
    if not isinstance(tc, dict) or "arguments" not in tc or type(tc.get("name")) is not str:
        raise Unrendered
    return _safe(tc["name"]), tc["arguments"]


def render_qwen3(messages: list[dict[str, Any]], tools: Any) -> tuple[str, Spans]:
    """qwen3.jinja."""
    ms = _normal(messages)
    if not ms:
        raise Unrendered
    w = _Writer()
    first = ms[0]
    if tools:
        w.add(_tools_block(tools, _s(first.get("content")) if first.get("role") == "system" else None, None,
                           "\n\n"))
    elif first.get("role") == "system":
        w.add(IM_START + "system\n" + _s(first.get("content")) + IM_END + "\n")
    last_query = len(ms) - 1
    for index in range(len(ms) - 1, -1, -1):
        m = ms[index]
        c = m.get("content")
        if m.get("role") == "user" and type(c) is str and not (c.startswith("<tool_response>")
                                                              and c.endswith("</tool_response>")):
            last_query = index
            break
    for i, m in enumerate(ms):
        role = m.get("role")
        c = m.get("content")
        content = c if type(c) is str else ""
        if role == "user" or (role == "system" and i > 0):
            w.add(IM_START + role + "\n" + content + IM_END + "\n")
        elif role == "assistant":
            r = m.get("reasoning_content")
            reasoning = ""
            if type(r) is str:
                reasoning = r
            elif "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            w.assistant()
            if i > last_query and (i == len(ms) - 1 or reasoning):
                w.add("<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n"))
            else:
                w.add(content)
            _qwen3_tool_calls(w, m.get("tool_calls"), bool(content))
            w.end_assistant()
        elif role == "tool":
            if i == 0 or ms[i - 1].get("role") != "tool":
                w.add(IM_START + "user")
            w.add("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == len(ms) - 1 or ms[i + 1].get("role") != "tool":
                w.add(IM_END + "\n")
        elif role != "system":
            raise Unrendered
    return w.done()


def render_qwen25(messages: list[dict[str, Any]], tools: Any) -> tuple[str, Spans]:
    """qwen2.5.jinja."""
    ms = _normal(messages)
    if not ms:
        raise Unrendered
    w = _Writer()
    first = ms[0]
    system = _s(first.get("content")) if first.get("role") == "system" else None
    if tools:
        w.add(_tools_block(tools, system, _QWEN25_SYSTEM, "\n\n"))
    else:
        w.add(IM_START + "system\n" + (system if system is not None else _QWEN25_SYSTEM) + IM_END + "\n")
    for i, m in enumerate(ms):
        role = m.get("role")
        calls = m.get("tool_calls")
        if role == "user" or (role == "system" and i > 0):
            w.add(IM_START + role + "\n" + _s(m.get("content")) + IM_END + "\n")
        elif role == "assistant" and not calls:
            w.assistant()
            w.add(_s(m.get("content")))
            w.end_assistant()
        elif role == "assistant":
            if not isinstance(calls, list):
                raise Unrendered
            content = m.get("content")
            w.add(IM_START + "assistant")
            w.open = w.size + 1  # the span starts after the newline that the content or the first tool call opens
            if content:
                w.add("\n" + _s(content))
            for tc in calls:
                name, args = _call(tc, truthy_function=False)
                w.add('\n<tool_call>\n{"name": "' + name + '", "arguments": ' + _tojson(args) + "}\n</tool_call>")
            w.end_assistant()
        elif role == "tool":
            if i == 0 or ms[i - 1].get("role") != "tool":
                w.add(IM_START + "user")
            w.add("\n<tool_response>\n" + _s(m.get("content")) + "\n</tool_response>")
            if i == len(ms) - 1 or ms[i + 1].get("role") != "tool":
                w.add(IM_END + "\n")
        elif role != "system":
            raise Unrendered
    return w.done()


def _is_image(part: dict[str, Any]) -> bool:
    return (part.get("type") == "image") or "image" in part or "image_url" in part


def _is_video(part: dict[str, Any]) -> bool:
    return part.get("type") == "video" or "video" in part


def _parts(content: Any, *, media: bool) -> str:
    """A content list as the VL templates render it: images and videos as their vision tokens (`media`), text
    parts as their text, anything else as nothing."""
    if not isinstance(content, list):
        raise Unrendered
    out = []
    for part in content:
        if not isinstance(part, dict):
            raise Unrendered
        if media and _is_image(part):
            out.append(_VISION)
        elif media and _is_video(part):
            out.append(_VIDEO)
        elif "text" in part:
            out.append(_s(part["text"]))
    return "".join(out)


def render_qwen25_vl(messages: list[dict[str, Any]], tools: Any) -> tuple[str, Spans]:
    """qwen2.5-vl.jinja (it renders no tools: a row with them is refused before rendering)."""
    ms = _normal(messages)
    w = _Writer()
    for i, m in enumerate(ms):
        role = m.get("role")
        if i == 0 and role != "system":
            w.add(IM_START + "system\nYou are a helpful assistant." + IM_END + "\n")
        if type(role) is not str:
            raise Unrendered
        c = m.get("content")
        body = _s(c) if isinstance(c, str) else _parts(c, media=True)
        if role == "assistant":
            w.assistant()
            w.add(body)
            w.end_assistant()
        else:
            w.add(IM_START + role + "\n" + body + IM_END + "\n")
    return w.done()


def render_qwen3_vl(messages: list[dict[str, Any]], tools: Any) -> tuple[str, Spans]:
    """qwen3-vl.jinja."""
    ms = _normal(messages)
    if not ms:
        raise Unrendered
    w = _Writer()
    first = ms[0]
    system = None
    if first.get("role") == "system":
        c = first.get("content")
        system = c if isinstance(c, str) else _parts(c, media=False)
    if tools:
        w.add(_tools_block(tools, system, None, "\n\n"))
    elif system is not None:
        w.add(IM_START + "system\n" + system + IM_END + "\n")
    for i, m in enumerate(ms):
        role = m.get("role")
        c = m.get("content")
        if role == "user":
            w.add(IM_START + "user\n" + (c if isinstance(c, str) else _parts(c, media=True)) + IM_END + "\n")
        elif role == "assistant":
            w.assistant()
            w.add(c if isinstance(c, str) else _parts(c, media=False))
            _qwen3_tool_calls(w, m.get("tool_calls"), bool(c))
            w.end_assistant()
        elif role == "tool":
            if i == 0 or ms[i - 1].get("role") != "tool":
                w.add(IM_START + "user")
            w.add("\n<tool_response>\n" + (c if isinstance(c, str) else _parts(c, media=True))
                  + "\n</tool_response>")
            if i == len(ms) - 1 or ms[i + 1].get("role") != "tool":
                w.add(IM_END + "\n")
        elif role != "system":
            raise Unrendered
    return w.done()


RENDERERS: dict[str, Renderer] = {"qwen2.5": render_qwen25, "qwen3": render_qwen3, "qwen2.5-vl": render_qwen25_vl,
                                  "qwen3-vl": render_qwen3_vl}
"""The direct renderer of each stock template, by its name in toolkit.templates.STOCK_FILES."""
_BY_TEXT: dict[str, str] | None = None


def stock_name(template: Any) -> str | None:
    """The stock template's name when `template` is exactly a shipped file's text, else None."""
    global _BY_TEXT
    if not isinstance(template, str):
        return None
    if _BY_TEXT is None:
        _BY_TEXT = {stock_template(name): name for name in STOCK_FILES if name in RENDERERS}
    return _BY_TEXT.get(template)


def direct_renderer(template: Any, choice: str = "auto") -> tuple[Renderer | None, str]:
    """The direct renderer for `template` (None: render through Jinja) and the line that says which was chosen.
    `choice` is data.renderer: 'auto' uses a direct renderer where there is one, 'jinja' never does."""
    name = stock_name(template)
    if choice == "jinja":
        return None, "data: chat rows rendered through the Jinja chat template (data.renderer: jinja)"
    if name is None:
        return None, ("data: chat rows rendered through the Jinja chat template (not a stock template the direct "
                      "renderer knows)")
    return RENDERERS[name], f"data: chat rows rendered by the direct renderer of the stock {name} template"
