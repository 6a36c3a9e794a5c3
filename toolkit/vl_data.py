"""Vision-language (Qwen2.5-VL, Qwen3-VL) rows to token ids and loss labels, formatted by the processor's chat
template: the VL side of `toolkit.data`.

A VL row is a chat whose user content may be a list of parts, plus the images those parts refer to:
  {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                {"role": "assistant", "content": "It is red."}],
   "images": ["images/0.png"]}
Image paths are relative to the JSONL file's directory; there is one `{"type": "image"}` placeholder per entry
of `images`, in order. Rows without `images` are text-only and may be mixed freely with image rows. Messages are
checked and the over-length policy applied by the same functions as text rows (`toolkit.data.check_messages`,
`toolkit.data.fit_to_length`); batches are built by `toolkit.collate.VLCollator`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from toolkit.data import (
    DataStats,
    RowEncoder,
    assistant_trains,
    chatml_token_mask,
    check_messages,
    check_renderable,
    drop_untrained_runs,
    fit_to_length,
    has_generation_tags,
    is_chatml_family,
    row_shape,
)
from toolkit.errors import ToolkitError
from toolkit.labels import IGNORE_INDEX
from toolkit.templates import VISION_TOKENS


def _load_image(path: Path, where: str) -> Image.Image:
    """The image file as RGB; a missing or unreadable file is an error naming `where` and the path."""
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
    template = processor.chat_template
    generation = has_generation_tags(processor)
    row_shape(row, where, vision=True)
    messages = check_messages(row.get("messages"), where, train_on, image_parts=True)
    trains = assistant_trains(row["messages"], where, train_on)
    n_parts = sum(p["type"] == "image" for m in messages if isinstance(m["content"], list) for p in m["content"])
    images = row.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise ToolkitError(f"{where}: 'images' must be a list of image paths, got {type(images).__name__}.")
    if n_parts != len(images):
        raise ToolkitError(f"{where}: {n_parts} {{\"type\": \"image\"}} placeholder(s) in 'messages' but "
                           f"{len(images)} path(s) in 'images'; there must be one placeholder per image, in order.")
    if not template or (train_on != "all" and not generation and not is_chatml_family(template)):
        raise ToolkitError(f"{where}: the processor's chat template has neither ChatML turns nor {{% generation %}} "
                           "markers, so assistant tokens cannot be located. Set data.chat_template: chatml (or "
                           "train_on: all).")
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
        mask = drop_untrained_runs([int(m) for m in out["assistant_masks"][0]], trains, where)
    else:  # a stock ChatML-family template (Qwen2.5-VL, Qwen3-VL): the turns are read off the token ids
        mask = chatml_token_mask(ids, processor.tokenizer, trains, where)
    vision = _vision_ids(processor)
    labels = [IGNORE_INDEX if t in vision or not (train_on == "all" or m) else t
              for t, m in zip(ids, mask, strict=True)]
    if labels:
        labels[0] = IGNORE_INDEX  # nothing predicts the first token
    last_vision = max((i for i, t in enumerate(ids) if t in vision), default=-1)
    sample = fit_to_length(ids, labels, max_seq_len=max_seq_len, overlength=overlength, where=where, stats=stats,
                           uncuttable=last_vision + 1)
    if sample is not None and images:
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
