"""Multimodal (Qwen2.5-VL, Qwen3-VL) data side: tiny VL models, dummy image data, row encoding, ZeRO-3/FSDP-safe
collator.

A VL row is a chat whose user content may be a list of parts, plus the images those parts refer to:
  {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                {"role": "assistant", "content": "It is red."}],
   "images": ["images/0.png"]}
Image paths are relative to the JSONL file's directory; there is one `{"type": "image"}` placeholder per entry
of `images`, in order. Rows without `images` are text-only and may be mixed freely with image rows.

Works without torchvision: transformers 5.x' stock `Qwen2_5_VLProcessor` insists on a (torchvision-only) video
processor, so the tiny model ships `Qwen2_5_VLImageOnlyProcessor` (same processing, images only), registered with
`AutoProcessor` when this module is imported.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw, UnidentifiedImageError
from transformers import (
    AutoProcessor,
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from toolkit.data import (
    ROLES,
    DataStats,
    RowEncoder,
    chatml_token_mask,
    check_renderable,
    check_turn_order,
    has_generation_tags,
    is_chatml_family,
)
from toolkit.errors import ToolkitError
from toolkit.labels import IGNORE_INDEX
from toolkit.tiny import IM_START, build_tokenizer

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# Small images -> few tokens: at most 112x112 px = 8x8 patches of 14 px = 16 merged (2x2) image tokens.
TINY_MIN_PIXELS = 28 * 28
TINY_MAX_PIXELS = 56 * 56 * 4

# ChatML for VL: content is a string or a list of {"type": "image"} / {"type": "video"} / {"type": "text"} parts.
# Each assistant turn's content + <|im_end|> is a generation block (for return_assistant_tokens_mask).
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


class Qwen2_5_VLImageOnlyProcessor(Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without the video processor, so it builds and loads where torchvision is missing.

    Image handling (token expansion, `mm_token_type_ids`, assistant masks) is inherited unchanged.
    """

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        self.image_token = IMAGE_PAD
        self.video_token = VIDEO_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


# AutoProcessor finds a processor_class named in processor_config.json among registered classes; the key only has to
# be unique (registering under Qwen2_5_VLConfig would hijack real Qwen2.5-VL checkpoints).
AutoProcessor.register(Qwen2_5_VLImageOnlyProcessor, Qwen2_5_VLImageOnlyProcessor, exist_ok=True)


def build_vl_processor(*, min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS,
                       patch_size: int = 14) -> Qwen2_5_VLImageOnlyProcessor:
    """The tiny models' processor: `toolkit.tiny` tokenizer + Qwen vision tokens + VL ChatML, PIL image processor
    (14-pixel patches for Qwen2.5-VL, 16 for Qwen3-VL; both merge 2x2 patches into one image token)."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, *VISION_TOKENS]})
    tokenizer.chat_template = VL_CHATML_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size,
                                               temporal_patch_size=2, merge_size=2)
    return Qwen2_5_VLImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                        chat_template=VL_CHATML_TEMPLATE)


@contextmanager
def _without_zero3_init() -> Iterator[None]:
    """Build a plain local model even inside a ZeRO-3 run: Qwen2.5-VL creates its sub-models with `_from_config`,
    which would otherwise partition them with `deepspeed.zero.Init`, a collective that only the building rank joins
    (a hang when rank 0 alone writes the model)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _text_config(tok: Any, hidden: int) -> dict[str, Any]:
    return {
        "vocab_size": -(-len(tok) // 64) * 64,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "max_position_embeddings": 4096,
        # M-RoPE splits the rotary half-dim (head_dim 16 / 2 = 8) into temporal, height, width sections.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }


def write_tiny_qwen2_5_vl(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Save a seeded random-weight Qwen2.5-VL (2+2 layers) and its processor to `out_dir`; return the path.

    Loads back with `AutoModelForImageTextToText` / `AutoProcessor.from_pretrained` (after importing this module).
    """
    processor = build_vl_processor()
    hidden = 64
    config = Qwen2_5_VLConfig(
        text_config=_text_config(processor.tokenizer, hidden),
        vision_config=_vision_config(
            hidden, patch_size=14,
            window_size=56,  # 2x2 merged units per window, so windowed attention really splits small images
            fullatt_block_indexes=[1],  # block 0 windowed, block 1 full: both attention paths run
        ),
        **_vision_token_ids(processor.tokenizer),
        tie_word_embeddings=False,
        dtype="float32",
    )
    return _save_tiny(out_dir, Qwen2_5_VLForConditionalGeneration, config, processor, "Qwen2.5-VL", seed)


def write_tiny_qwen3_vl(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Save a seeded random-weight Qwen3-VL (2+2 layers, one DeepStack level) and its processor to `out_dir`."""
    processor = build_vl_processor(min_pixels=32 * 32, max_pixels=64 * 64 * 4, patch_size=16)
    hidden = 64
    text = _text_config(processor.tokenizer, hidden)
    text["rope_parameters"]["mrope_interleaved"] = True
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=_vision_config(
            hidden, patch_size=16, num_position_embeddings=64,
            deepstack_visual_indexes=[1],  # block 1's features are also added to the first decoder layer
        ),
        **_vision_token_ids(processor.tokenizer),
        tie_word_embeddings=False,
        dtype="float32",
    )
    return _save_tiny(out_dir, Qwen3VLForConditionalGeneration, config, processor, "Qwen3-VL", seed)


def _vision_config(out_hidden: int, *, patch_size: int, **extra: Any) -> dict[str, Any]:
    """A 2-block vision tower of width 32 whose 2x2 patch merger projects to the language model's width."""
    return {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": out_hidden,
            "patch_size": patch_size, "spatial_merge_size": 2, "temporal_patch_size": 2, **extra}


def _vision_token_ids(tok: Any) -> dict[str, int]:
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return {"image_token_id": ids[IMAGE_PAD], "video_token_id": ids[VIDEO_PAD],
            "vision_start_token_id": ids[VISION_START], "vision_end_token_id": ids[VISION_END]}


def _save_tiny(out_dir: str | Path, model_class: Any, config: Any, processor: Any, name: str, seed: int) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = processor.tokenizer
    with _without_zero3_init():
        torch.manual_seed(seed)
        model = model_class(config)
        model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                                   do_sample=False)
        model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "README.md").write_text(
        f"# Tiny random-weight {name}\n\n"
        f"Built by `toolkit.vision` (seed={seed}); outputs are meaningless, for tests only.\n"
        "The processor class is registered with AutoProcessor by `import toolkit.vision`.\n"
    )
    return out


def vision_module_names(model: torch.nn.Module) -> dict[str, str]:
    """Name prefixes of the vision tower and its projector (patch merger) in `model`, e.g. to freeze or train them.

    Qwen2-VL / Qwen2.5-VL keep them at `model.visual` and `model.visual.merger`; wrappers (PEFT, DeepSpeed) only add
    leading prefixes, which the returned names include.
    """
    modules = dict(model.named_modules())
    tower = next((n for n in modules if n == "visual" or n.endswith(".visual")), None)
    if tower is None or f"{tower}.merger" not in modules:
        raise ToolkitError(f"{type(model).__name__} has no Qwen-VL vision tower ('visual' with a 'merger').")
    return {"vision_tower": tower, "projector": f"{tower}.merger"}


_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220), "yellow": (240, 220, 40),
    "black": (10, 10, 10), "white": (245, 245, 245), "orange": (250, 140, 20), "purple": (140, 50, 170),
}
_SHAPES = ("square", "circle", "triangle")


def _draw(path: Path, rng: random.Random) -> tuple[str, str]:
    """Write a small PNG (56-112 px a side): a coloured shape on a grey background, or a solid colour."""
    colour = rng.choice(list(_COLOURS))
    shape = rng.choice((*_SHAPES, "solid"))
    w, h = rng.randint(56, 112), rng.randint(56, 112)
    img = Image.new("RGB", (w, h), _COLOURS[colour] if shape == "solid" else (128, 128, 128))
    draw = ImageDraw.Draw(img)
    box = (w // 6, h // 6, w - w // 6, h - h // 6)
    if shape == "square":
        draw.rectangle(box, fill=_COLOURS[colour])
    elif shape == "circle":
        draw.ellipse(box, fill=_COLOURS[colour])
    elif shape == "triangle":
        draw.polygon([(w // 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=_COLOURS[colour])
    img.save(path, format="PNG")
    return colour, shape


def _user(n_images: int, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [*({"type": "image"} for _ in range(n_images)), {"type": "text", "text": text}]}


def write_dummy_vl_data(out_dir: str | Path, num_samples: int, *, seed: int = 0) -> dict[str, Path]:
    """Deterministic two-stage VL curriculum: `vl_stage1.jsonl` (captioning, one image a row) and `vl_stage2.jsonl`
    (~30% text-only rows, the rest one or two images). Images go to `out_dir/images`; returns the JSONL paths."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def image(name: str) -> tuple[str, str, str]:
        colour, shape = _draw(out / "images" / name, rng)
        return f"images/{name}", colour, shape

    stage1, stage2 = [], []
    for i in range(num_samples):
        path, colour, _ = image(f"s1_{i:05d}.png")
        stage1.append({"messages": [_user(1, "What colour is this?"),
                                    {"role": "assistant", "content": f"It is {colour}."}],
                       "images": [path], "difficulty": 1.0})
    for i in range(num_samples):
        kind = rng.random()
        if kind < 0.3:  # text only
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            stage2.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                        {"role": "assistant", "content": f"{a} + {b} = {a + b}."}],
                           "difficulty": 1.0})
        elif kind < 0.75:
            path, colour, shape = image(f"s2_{i:05d}_0.png")
            answer = f"A {colour} {shape}." if shape != "solid" else f"Only {colour}, no shape."
            stage2.append({"messages": [_user(1, "What shape is this, and what colour?"),
                                        {"role": "assistant", "content": answer}],
                           "images": [path], "difficulty": 2.0})
        else:
            (p0, c0, _), (p1, c1, _) = image(f"s2_{i:05d}_0.png"), image(f"s2_{i:05d}_1.png")
            answer = f"Yes, both are {c0}." if c0 == c1 else f"No: the first is {c0} and the second is {c1}."
            stage2.append({"messages": [_user(2, "Are these the same colour?"),
                                        {"role": "assistant", "content": answer}],
                           "images": [p0, p1], "difficulty": 3.0})
    paths = {}
    for name, rows in (("vl_stage1", stage1), ("vl_stage2", stage2)):
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return paths


def _image_parts(messages: Any, where: str) -> int:
    """Number of `{"type": "image"}` parts, after checking the message structure."""
    if not isinstance(messages, list) or not messages:
        raise ToolkitError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects.")
    count = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ToolkitError(f"{where}: messages[{i}] must be an object with a role in {ROLES}.")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(p, dict) and "type" in p for p in content):
            raise ToolkitError(f"{where}: messages[{i}].content must be a string or a list of "
                               "{\"type\": \"text\" | \"image\", ...} parts.")
        for p in content:
            if p["type"] == "image":
                count += 1
            elif p["type"] == "text" and not isinstance(p.get("text"), str):
                raise ToolkitError(f"{where}: messages[{i}] has a text part without a string 'text'.")
            elif p["type"] not in ("image", "text"):
                raise ToolkitError(f"{where}: messages[{i}] has a '{p['type']}' part; only text and image parts "
                                   "are supported.")
    return count


def _load_image(path: Path, where: str) -> Image.Image:
    if not path.is_file():
        raise ToolkitError(f"{where}: image file {path} does not exist (image paths are relative to the JSONL "
                           "file's directory).")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as e:
        raise ToolkitError(f"{where}: image file {path} could not be read as an image ({e}).") from None


def _vision_ids(processor: Any) -> set[int]:
    tok = processor.tokenizer
    return {i for i in tok.convert_tokens_to_ids(VISION_TOKENS) if i is not None and i != tok.unk_token_id}


def _size_kwargs(processor: Any, min_pixels: int | None, max_pixels: int | None) -> dict[str, Any]:
    if min_pixels is None and max_pixels is None:
        return {}
    size = dict(processor.image_processor.size)
    if min_pixels is not None:
        size["shortest_edge"] = min_pixels
    if max_pixels is not None:
        size["longest_edge"] = max_pixels
    return {"images_kwargs": {"size": {k: size[k] for k in ("shortest_edge", "longest_edge")}}}


def encode_vl_row(row: dict[str, Any], processor: Any, *, train_on: str, max_seq_len: int, overlength: str,
                  base_dir: str | Path, where: str, min_pixels: int | None = None, max_pixels: int | None = None,
                  stats: DataStats | None = None) -> dict[str, Any] | None:
    """Token ids, labels and (for image rows) `images` (resolved paths) and `image_grid_thw` of one VL chat row.

    Pixels are not kept: `VLCollator` loads and processes a batch's images when it is built, so memory holds
    token ids only, whatever the number of images. The grid records how many image tokens the row was expanded
    with, and the collator checks that the image still gives that grid.

    Labels: assistant turns + <|im_end|> (from the template's generation markers), or every token with
    train_on="all"; vision tokens and the first token never carry loss. Images are never cut: over `max_seq_len`,
    "error" raises, "drop" returns None, and "truncate" cuts ids/labels only when every vision token lies before
    the cut, otherwise the row is dropped (None) since a partial image matches no `image_grid_thw`.
    `stats`, when given, counts dropped and truncated rows.
    """
    messages = row.get("messages")
    n_parts = _image_parts(messages, where)
    images = row.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise ToolkitError(f"{where}: 'images' must be a list of image paths, got {type(images).__name__}.")
    if n_parts != len(images):
        raise ToolkitError(f"{where}: {n_parts} {{\"type\": \"image\"}} placeholder(s) in 'messages' but "
                           f"{len(images)} path(s) in 'images'; there must be one placeholder per image, in order.")
    template = processor.chat_template
    generation = has_generation_tags(processor)
    if not template or (train_on != "all" and not generation and not is_chatml_family(template)):
        raise ToolkitError(f"{where}: the processor's chat template has neither ChatML turns nor {{% generation %}} "
                           "markers, so assistant tokens cannot be located. Set data.chat_template: chatml (or "
                           "train_on: all).")
    check_turn_order(messages, where, train_on)
    tools = row.get("tools")
    check_renderable(template, messages, tools, where)
    paths = [Path(base_dir) / p for p in images]
    loaded = iter([_load_image(path, where) for path in paths])
    conversation = [
        {**m, "content": [{**p, "image": next(loaded)} if p["type"] == "image" else p for p in m["content"]]}
        if isinstance(m["content"], list) else m
        for m in messages
    ]
    try:
        out = processor.apply_chat_template(
            conversation, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=generation,
            processor_kwargs=_size_kwargs(processor, min_pixels, max_pixels))
    except (ValueError, KeyError, TypeError) as e:
        raise ToolkitError(f"{where}: the row could not be formatted with the chat template ({e}).") from None
    ids = [int(t) for t in out["input_ids"][0]]
    if generation:
        mask = [int(m) for m in out["assistant_masks"][0]]
    else:  # a stock ChatML-family template (Qwen2.5-VL, Qwen3-VL): the turns are read off the token ids
        mask = chatml_token_mask(ids, processor.tokenizer, sum(m["role"] == "assistant" for m in messages), where)
    vision = _vision_ids(processor)
    labels = [IGNORE_INDEX if t in vision or not (train_on == "all" or m) else t
              for t, m in zip(ids, mask, strict=True)]
    if labels:
        labels[0] = IGNORE_INDEX  # nothing predicts the first token
    if len(ids) > max_seq_len:
        last_vision = max((i for i, t in enumerate(ids) if t in vision), default=-1)
        if overlength == "error":
            raise ToolkitError(f"{where}: {len(ids)} tokens, over data.max_seq_len={max_seq_len}. Raise "
                               "max_seq_len, or set data.overlength to drop or truncate.")
        if overlength == "drop" or last_vision >= max_seq_len:
            if stats is not None:
                stats.dropped_overlength += 1
            return None
        ids, labels = ids[:max_seq_len], labels[:max_seq_len]
        if stats is not None:
            stats.truncated += 1
    sample: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if images:
        sample["images"] = [str(path) for path in paths]
        sample["image_grid_thw"] = torch.as_tensor(out["image_grid_thw"]).tolist()
    return sample


def vl_encoder(processor: Any, *, max_seq_len: int, overlength: str, train_on: str, min_pixels: int | None,
               max_pixels: int | None) -> RowEncoder:
    """`encode_vl_row` as a `toolkit.data.RowEncoder`: image paths are taken relative to the row's JSONL file."""
    def encode(row: dict[str, Any], path: Path, where: str, stats: DataStats) -> dict[str, Any] | None:
        return encode_vl_row(row, processor, train_on=train_on, max_seq_len=max_seq_len, overlength=overlength,
                             base_dir=path.parent, where=where, min_pixels=min_pixels, max_pixels=max_pixels,
                             stats=stats)
    return encode


def process_images(processor: Any, paths: list[str], *, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of image files, resized within the pixel bounds like `encode_vl_row` does."""
    images = [_load_image(Path(p), p) for p in paths]
    kwargs = _size_kwargs(processor, min_pixels, max_pixels).get("images_kwargs", {})
    out = processor.image_processor(images=images, return_tensors="pt", **kwargs)
    return out["pixel_values"], out["image_grid_thw"]


class VLCollator:
    """Right-pads ids/labels/attention_mask, loads and processes the rows' images (`pixel_values`, `image_grid_thw`)
    and adds `mm_token_type_ids` (for M-RoPE). Each image must give the grid its row was tokenised with, else the
    image tokens would not match the image features (the file changed since): that is an error naming the file.

    A batch without images still feeds the vision tower one tiny dummy image, appended after the first row's real
    tokens with attention_mask 0 and labels IGNORE_INDEX: it changes no real token and no loss, but every rank then
    runs the vision tower. Otherwise, under ZeRO-3 / FSDP, a rank with a text-only batch skips the tower's parameter
    all-gathers that another rank performs, and the job hangs (hiyouga/LlamaFactory#5616).
    """

    def __init__(self, processor: Any, *, dummy_image: bool = True, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        self.processor = processor
        self.dummy_image = dummy_image
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        tok = processor.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.image_id = tok.convert_tokens_to_ids(IMAGE_PAD)
        self.video_id = tok.convert_tokens_to_ids(VIDEO_PAD)
        self._dummy: tuple[list[int], torch.Tensor, torch.Tensor] | None = None

    def dummy(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(token ids, pixel_values, image_grid_thw) of the smallest black image (one merged patch, 28x28 px for
        Qwen2.5-VL), made by the processor's own image processor."""
        if self._dummy is None:
            ip = self.processor.image_processor
            side = ip.patch_size * ip.merge_size
            img = Image.new("RGB", (side, side))
            out = ip(images=[img], size={"shortest_edge": side * side, "longest_edge": side * side},
                     return_tensors="pt")
            grid = out["image_grid_thw"]
            n = int(grid.prod()) // ip.merge_size ** 2
            tok = self.processor.tokenizer
            ids = tok.convert_tokens_to_ids([VISION_START, *[IMAGE_PAD] * n, VISION_END])
            self._dummy = (ids, out["pixel_values"], grid)
        return self._dummy

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [list(r["input_ids"]) for r in rows]
        labels = [list(r["labels"]) for r in rows]
        attn = [[1] * len(x) for x in ids]
        paths = [p for r in rows for p in r.get("images", [])]
        batch: dict[str, torch.Tensor] = {}
        if paths:
            batch["pixel_values"], batch["image_grid_thw"] = process_images(
                self.processor, paths, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
            expected = [g for r in rows for g in r.get("image_grid_thw", [])]
            if batch["image_grid_thw"].tolist() != expected:
                changed = next(p for p, g, e in zip(paths, batch["image_grid_thw"].tolist(), expected, strict=True)
                               if g != e)
                raise ToolkitError(f"Image {changed} no longer has the size it was tokenised with: it changed "
                                   "during the run. Restore it, or restart so the data is tokenised again.")
        elif self.dummy_image:
            dummy_ids, pixels, grid = self.dummy()
            ids[0] += dummy_ids
            labels[0] += [IGNORE_INDEX] * len(dummy_ids)
            attn[0] += [0] * len(dummy_ids)
            batch["pixel_values"], batch["image_grid_thw"] = pixels, grid
        width = max(len(x) for x in ids)
        batch["input_ids"] = torch.tensor([x + [self.pad_id] * (width - len(x)) for x in ids])
        batch["labels"] = torch.tensor([x + [IGNORE_INDEX] * (width - len(x)) for x in labels])
        batch["attention_mask"] = torch.tensor([x + [0] * (width - len(x)) for x in attn])
        batch["mm_token_type_ids"] = ((batch["input_ids"] == self.image_id).int()
                                      + 2 * (batch["input_ids"] == self.video_id).int())
        return batch
