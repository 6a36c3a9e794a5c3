"""Tiny random-weight Qwen2.5-VL and Qwen3-VL models for tests and offline demos (the VL side of
`toolkit.builtin.text_model`).

Each is built in-process and deterministically from a config: the `toolkit.builtin.text_model` tokenizer plus Qwen's
vision tokens, its family's stock chat template (Qwen2.5-VL's, Qwen3-VL's), a PIL image processor, and a seeded
2+2-layer model, saved so it loads through the normal `from_pretrained` path (`builtin:tiny-qwen2.5-vl` /
`builtin:tiny-qwen3-vl` via `toolkit.builtin.models.materialize_builtin`).

Works without torchvision: transformers 5.x' stock `Qwen2_5_VLProcessor` insists on a (torchvision-only) video
processor, so the tiny models ship `Qwen2_5_VLImageOnlyProcessor` (same processing, images only). AutoProcessor only
finds it once registered: `register_image_only_processor()` does that, called where such a processor is built
(`build_vl_processor`) or loaded (`toolkit.model.load.load_processor`); importing this module registers nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoProcessor,
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from toolkit.builtin.text_model import build_tokenizer
from toolkit.strategies.deepspeed import without_zero3_init
from toolkit.templates import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, VISION_TOKENS, stock_template

# Small images -> few tokens: at most 112x112 px = 8x8 patches of 14 px = 16 merged (2x2) image tokens.
TINY_MIN_PIXELS = 28 * 28
TINY_MAX_PIXELS = 56 * 56 * 4


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


class Qwen3VLImageOnlyProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without the video processor (as `Qwen2_5_VLImageOnlyProcessor`): the tiny Qwen3-VL's, so
    its class renders a video as Qwen3-VL does (a `<t seconds>` timestamp before each frame pair). Video pixels are
    made from the toolkit's frame store with the image processor's patch sizes (`toolkit.data.vision`)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        self.image_token, self.video_token = IMAGE_PAD, VIDEO_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        self.vision_start_token, self.vision_end_token = VISION_START, VISION_END
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(VISION_START)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(VISION_END)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


IMAGE_ONLY_PROCESSORS = ("Qwen2_5_VLImageOnlyProcessor", "Qwen3VLImageOnlyProcessor")


def register_image_only_processor() -> None:
    """Let `AutoProcessor.from_pretrained` load a saved `Qwen2_5_VLImageOnlyProcessor` (idempotent).

    AutoProcessor finds the processor_class named in processor_config.json among registered classes (unregistered,
    it silently returns the bare tokenizer); the key only has to be unique (registering under Qwen2_5_VLConfig would
    hijack real Qwen2.5-VL checkpoints)."""
    AutoProcessor.register(Qwen2_5_VLImageOnlyProcessor, Qwen2_5_VLImageOnlyProcessor, exist_ok=True)
    AutoProcessor.register(Qwen3VLImageOnlyProcessor, Qwen3VLImageOnlyProcessor, exist_ok=True)


def build_vl_processor(chat_template: str, *, min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS,
                       patch_size: int = 14, qwen3: bool = False) -> Any:
    """The tiny models' processor: `toolkit.builtin.text_model` tokenizer + Qwen vision tokens + `chat_template` (each
    tiny model its family's stock one), PIL image processor (14-pixel patches for Qwen2.5-VL, 16 for Qwen3-VL; both
    merge 2x2 patches into one image token). Registers its class, so what it saves also loads back in this process."""
    register_image_only_processor()
    tokenizer = build_tokenizer(chat_template, vision=True)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size,
                                               temporal_patch_size=2, merge_size=2)
    cls = Qwen3VLImageOnlyProcessor if qwen3 else Qwen2_5_VLImageOnlyProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def _tiny_language_model_config(tok: Any, hidden: int) -> dict[str, Any]:
    """The `text_config` of both tiny VL models: a 2-layer decoder of width `hidden` over `tok`'s vocabulary (padded
    to a multiple of 64), with M-RoPE."""
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

    Loads back with `AutoModelForImageTextToText` and `toolkit.model.load.load_processor` (or `AutoProcessor` after
    `register_image_only_processor()`).
    """
    processor = build_vl_processor(stock_template("qwen2.5-vl"))
    hidden = 64
    config = Qwen2_5_VLConfig(
        text_config=_tiny_language_model_config(processor.tokenizer, hidden),
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
    processor = build_vl_processor(stock_template("qwen3-vl"), min_pixels=32 * 32, max_pixels=64 * 64 * 4,
                                   patch_size=16, qwen3=True)
    hidden = 64
    text = _tiny_language_model_config(processor.tokenizer, hidden)
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
    with without_zero3_init():
        torch.manual_seed(seed)
        model = model_class(config)
        model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                                   do_sample=False)
        model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "README.md").write_text(
        f"# Tiny random-weight {name}\n\n"
        f"Built by `toolkit.builtin.vl_model` (seed={seed}); outputs are meaningless, for tests only.\n"
        "Load the processor with `toolkit.model.load.load_processor`, or with AutoProcessor after "
        "`toolkit.builtin.vl_model.register_image_only_processor()`.\n"
    )
    return out
