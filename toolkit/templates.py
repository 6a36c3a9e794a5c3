"""Chat formats: the ChatML training templates, the special tokens they render, the stock Qwen templates shipped in
`toolkit/chat_templates/`, and `resolve_chat_template`, the one reader of `data.chat_template`. No heavy imports and
no side effects, so production code (model loading, data, recipe validation) and the tiny test models share them
without importing each other.

Both ChatML templates mark each assistant turn's content + <|im_end|> as a `{% generation %}` block, so
`return_assistant_tokens_mask=True` marks exactly the tokens the model should learn to produce.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import ToolkitError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Qwen-VL's vision tokens: an image renders as <|vision_start|><|image_pad|><|vision_end|>, and the processor expands
# the pad to one token per merged patch.
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# ChatML (`data.chat_template: chatml` for text models).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ChatML for VL (`data.chat_template: chatml` for vision-language models): content
# is a string or a list of {"type": "image"} / {"type": "video"} / {"type": "text"} parts.
VL_CHATML_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- render(message['content']) + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- render(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

STOCK_DIR = Path(__file__).resolve().parent / "chat_templates"
"""The stock templates as Qwen's checkpoints ship them (sources in its README.md)."""
STOCK_FILES = {"qwen2.5": "qwen2.5.jinja", "qwen2.5-instruct": "qwen2.5.jinja", "qwen3": "qwen3.jinja",
               "qwen2.5-vl": "qwen2.5-vl.jinja", "qwen3-vl": "qwen3-vl.jinja"}
TEMPLATE_NAMES = ("chatml", *STOCK_FILES)
"""The names `data.chat_template` takes ('chatml': CHATML_TEMPLATE, or VL_CHATML_TEMPLATE for a VL model)."""
_TEMPLATE_FORMS = (f"a template name ({', '.join(TEMPLATE_NAMES)}), a path to a .jinja file or to a tokenizer/model "
                   "folder (relative to the working directory), or the template's Jinja text")


def stock_template(name: str) -> str:
    """The text of a stock template by name (a key of STOCK_FILES)."""
    return (STOCK_DIR / STOCK_FILES[name]).read_text(encoding="utf-8")


def is_jinja_text(value: str) -> bool:
    return "{{" in value or "{%" in value


def _looks_like_path(value: str) -> bool:
    """A value that is meant as a path even when nothing is there (so a missing file is named as missing, not as
    an unknown template name)."""
    if "/" in value or "\\" in value or value.startswith(("~", ".")) or Path(value).suffix in (".jinja", ".json"):
        return True
    try:
        return Path(value).exists()
    except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte
        return False


def chat_template_problem(value: str) -> str | None:
    """Why `data.chat_template: value` is none of its forms (None when it is one), checked at recipe validation,
    before the model loads. Paths are only read (and a missing one named) by `resolve_chat_template`: a saved
    recipe is re-read from other working directories (export, resume)."""
    if not value.strip():
        return f"is empty; give {_TEMPLATE_FORMS}, or leave it out for the model's own template"
    if is_jinja_text(value) or value in TEMPLATE_NAMES or _looks_like_path(value):
        return None
    return f"'{value}' is not a template the toolkit knows, an existing path or Jinja text; give {_TEMPLATE_FORMS}"


def resolve_chat_template(value: str, *, vision: bool) -> str:
    """The Jinja text that `data.chat_template` stands for: a stock template by name, a .jinja file, a tokenizer or
    model folder's own template (chat_template.jinja, chat_template.json, or tokenizer_config.json's
    chat_template), or the value itself when it is Jinja text. For a vision-language model (`vision`), a template
    that never mentions images is refused: it would drop the image parts of every row (a text model's rows render
    with a VL template as the VL model renders its text rows)."""
    if (problem := chat_template_problem(value)) is not None:
        raise ToolkitError(f"data.chat_template: {problem}.")
    if is_jinja_text(value):
        text, what = value, "the Jinja text"
    elif value == "chatml":
        text, what = (VL_CHATML_TEMPLATE if vision else CHATML_TEMPLATE), "chatml"
    elif value in STOCK_FILES:
        text, what = stock_template(value), value
    else:
        text, what = _template_at(Path(value).expanduser(), value), value
    if vision and "image" not in text:
        vl = ", ".join(n for n in TEMPLATE_NAMES if n.endswith("-vl"))
        raise ToolkitError(f"data.chat_template {what} cannot render images (it never mentions them) and the model is "
                           f"a vision-language model: its image parts would be dropped. Use chatml, {vl}, or the "
                           "model's own template (remove the field).")
    return text


def _template_at(path: Path, value: str) -> str:
    """The template a path holds: a template file (a .json one: its 'chat_template'), or a folder's own."""
    if not path.exists():
        raise ToolkitError(f"data.chat_template: {value} does not exist (paths are relative to the working "
                           f"directory, {Path.cwd()}); give {_TEMPLATE_FORMS}.")
    if path.is_dir():
        for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
            if (path / name).is_file() and (text := _template_in_file(path / name, value)):
                return text
        raise ToolkitError(f"data.chat_template: the folder {value} holds no chat template (no chat_template.jinja, "
                           "chat_template.json, or 'chat_template' in tokenizer_config.json).")
    text = _template_in_file(path, value)
    if not text:
        raise ToolkitError(f"data.chat_template: {value} holds no chat template (empty, or a JSON file without a "
                           "'chat_template').")
    return text


def _template_in_file(path: Path, value: str) -> str | None:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ToolkitError(f"data.chat_template: {path} cannot be read as UTF-8 text ({e}).") from None
    if path.suffix != ".json":
        return raw.strip() and raw
    try:
        found = json.loads(raw).get("chat_template")
    except (ValueError, AttributeError):
        raise ToolkitError(f"data.chat_template: {path} (from {value}) is not a JSON object.") from None
    if isinstance(found, list):  # tokenizer_config.json's named templates: [{name, template}, ...]
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) and found else None
