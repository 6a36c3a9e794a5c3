"""Chat formats: the ChatML training templates and the special tokens they render. Strings only, no imports, no
side effects, so production code (model loading, data) and the tiny test models share them without importing each
other.

Both templates mark each assistant turn's content + <|im_end|> as a `{% generation %}` block, so
`return_assistant_tokens_mask=True` marks exactly the tokens the model should learn to produce.
"""

from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Qwen-VL's vision tokens: an image renders as <|vision_start|><|image_pad|><|vision_end|>, and the processor expands
# the pad to one token per merged patch.
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# ChatML (`data.chat_template: chatml` for text models; the tiny Qwen3's own template).
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

# ChatML for VL (`data.chat_template: chatml` for vision-language models; the tiny VL models' own template): content
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
