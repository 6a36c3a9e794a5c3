"""Vision-language (Qwen2.5-VL, Qwen3-VL) rows to token ids and loss masks, formatted by the processor's chat
template: the VL side of `toolkit.data.encoding`.

A VL row is a chat whose user content may be a list of parts, plus the images those parts refer to:
  {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                {"role": "assistant", "content": "It is red."}],
   "images": ["images/0.png"]}
Image paths are relative to the data file's directory; there is one `{"type": "image"}` placeholder per entry of
`images`, in order. Rows without `images` are text-only and may be mixed freely with image rows. Messages are
checked and turns masked by the same functions as text rows (`toolkit.data.encoding`).

No pixel is decoded here. An image's grid, and so its number of tokens, follows from its size alone: the image
processor resizes to a multiple of patch x merge within its pixel bounds (`smart_resize`), so `image_grid` reads
the size from the file's header. The rendering's `<|image_pad|>` is expanded to that many tokens, as the processor
does, and the rows tokenised in one batch. Pixels are decoded and resized when a batch is built, in DataLoader
workers (`toolkit.data.collate.VLCollator`), which checks that each image still gives the grid its row was prepared
with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from toolkit.data.encoding import (
    DataStats,
    EncodedBatch,
    RowAddress,
    SizeGuard,
    assistant_trains,
    chatml_assistant_spans,
    check_messages,
    check_renderable,
    chosen_renderer,
    empty_answers,
    fit_to_length,
    has_generation_tags,
    is_chatml_family,
    render_chat,
    row_shape,
    span_mask,
)
from toolkit.data.render import Unrendered
from toolkit.errors import ToolkitError
from toolkit.templates import IMAGE_PAD, VISION_TOKENS


def _load_image(path: Path, where: str) -> Image.Image:
    """The image file as RGB; a missing or unreadable file is an error naming `where` and the path."""
    _check_image(path, where)
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as e:
        raise ToolkitError(f"{where}: image file {path} could not be read as an image ({e}).") from None


def _check_image(path: Path, where: str) -> None:
    """A regular file: a FIFO is never opened (opening one blocks until someone writes), nor a device."""
    if path.exists() and not path.is_file():
        raise ToolkitError(f"{where}: image file {path} is not a regular file (a FIFO, device, socket or folder); "
                           "images are read from regular files: save the image to a file and name that.")
    if not path.is_file():
        raise ToolkitError(f"{where}: image file {path} does not exist (image paths are relative to the data "
                           "file's directory).")


def _pixel_bounds(image_processor: Any, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    size = dict(image_processor.size)
    return (min_pixels if min_pixels is not None else size["shortest_edge"],
            max_pixels if max_pixels is not None else size["longest_edge"])


def image_grid(image_processor: Any, path: Path, where: str, *, min_pixels: int | None = None,
               max_pixels: int | None = None) -> list[int]:
    """[t, h, w] patches of an image as the processor will cut it, from the file's header (its size) only."""
    _check_image(path, where)
    try:
        with Image.open(path) as img:
            width, height = img.size
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as e:
        raise ToolkitError(f"{where}: image file {path} could not be read as an image ({e}).") from None
    patch, merge = image_processor.patch_size, image_processor.merge_size
    low, high = _pixel_bounds(image_processor, min_pixels, max_pixels)
    try:
        h, w = smart_resize(height, width, factor=patch * merge, min_pixels=low, max_pixels=high)
    except ValueError as e:  # an aspect ratio the processor refuses
        raise ToolkitError(f"{where}: image file {path} ({width}x{height}) cannot be processed ({e}).") from None
    return [1, h // patch, w // patch]


class VLEncoder:
    """Vision-language rows to token ids and loss masks with a processor (see the module docstring)."""

    def __init__(self, processor: Any, *, train_on: str, min_pixels: int | None = None,
                 max_pixels: int | None = None, chat_template: str | None = None, empty_answers: str = "error",
                 renderer: str = "auto") -> None:
        self.processor, self.train_on = processor, train_on
        self.renderer = renderer  # data.renderer (toolkit/data/render.py)
        if getattr(processor, "chat_template", None):
            chosen_renderer(processor.chat_template, renderer)  # said once
        self.empty_answers = empty_answers
        self.chat_template = chat_template  # the recipe's override the processor carries, for refusals' advice
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.tokenizer = processor.tokenizer
        self.fingerprint: str | None = None  # the tokenizer's, once a store key needed it
        self.vision_ids = {i for i in self.tokenizer.convert_tokens_to_ids(VISION_TOKENS)
                           if i is not None and i != self.tokenizer.unk_token_id}

    def options(self) -> dict[str, Any]:
        ip = self.processor.image_processor
        return {"kind": "vision", "train_on": self.train_on, "template": self.processor.chat_template,
                "pixels": _pixel_bounds(ip, self.min_pixels, self.max_pixels), "patch": ip.patch_size,
                "merge": ip.merge_size, **({"empty_answers": self.empty_answers} if self.empty_answers != "error"
                                           else {}), **({"renderer": "jinja"} if self.renderer == "jinja" else {})}

    def encode(self, rows: Sequence[dict[str, Any]], numbers: Sequence[int], address: RowAddress,
               base_dir: Path | None = None, *, max_tokens: int | None = None) -> EncodedBatch:
        """Encode `rows`, whose image paths are relative to `base_dir`; the first bad row raises. With
        `max_tokens`, a row whose rendering is far longer is stored cut (`SizeGuard`) and counts as uncuttable
        whole: its images may lie past the cut, so truncation drops it."""
        texts, plans = [], []
        for row, number in zip(rows, numbers, strict=True):
            text, spans, overlap, paths, grids = self._render(row, address(number), Path(base_dir or "."))
            texts.append(text)
            plans.append((spans, overlap, paths, grids))
        ids_parts, mask_parts, uncuttable = [], [], []
        vision = np.array(sorted(self.vision_ids), dtype=np.int32)
        encoded, long = SizeGuard(self, max_tokens).encode_with_offsets(texts)
        capped = {}
        for r, ((ids, starts, ends), (spans, overlap, _, _)) in enumerate(zip(encoded, plans, strict=True)):
            mask = (np.ones(len(ids), np.uint8) if self.train_on == "all"
                    else span_mask(starts, ends, spans, overlap=overlap))
            is_vision = np.isin(ids, vision)
            mask[is_vision] = 0  # vision tokens never carry loss
            if len(mask):
                mask[0] = 0
            where_vision = np.flatnonzero(is_vision)
            if r in long:  # cut by the size guard: images may lie past the cut, so the row is never truncated
                assert max_tokens is not None
                ids, mask = ids[:max_tokens + 1], mask[:max_tokens + 1]
                capped[r] = len(texts[r])
            ids_parts.append(ids)
            mask_parts.append(mask)
            uncuttable.append(len(ids) if r in long else int(where_vision[-1]) + 1 if len(where_vision) else 0)
        return EncodedBatch(
            np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32),
            np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8),
            np.array([len(i) for i in ids_parts], dtype=np.int64), np.array(numbers, dtype=np.int64),
            [row.get("difficulty") for row in rows], np.array(uncuttable, dtype=np.int64),
            [p[2] for p in plans], [p[3] for p in plans], capped)

    def _render(self, row: dict[str, Any], where: str, base_dir: Path
                ) -> tuple[str, list[tuple[int, int]], bool, list[str], list[list[int]]]:
        """(rendering with image tokens expanded, character spans that train, whether they are {% generation %}
        spans, resolved image paths, their grids)."""
        processor, train_on = self.processor, self.train_on
        template = processor.chat_template
        generation = has_generation_tags(processor)
        row_shape(row, where, vision=True)
        given = empty_answers(row.get("messages"), where, self.empty_answers)
        messages = check_messages(given, where, train_on, image_parts=True)
        trains = assistant_trains(given, where, train_on)
        n_parts = sum(p["type"] == "image" for m in messages if isinstance(m["content"], list) for p in m["content"])
        images = row.get("images", [])
        if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
            raise ToolkitError(f"{where}: 'images' must be a list of image paths, got {type(images).__name__}.")
        if n_parts != len(images):
            raise ToolkitError(f"{where}: {n_parts} {{\"type\": \"image\"}} placeholder(s) in 'messages' but "
                               f"{len(images)} path(s) in 'images'; there must be one placeholder per image, in "
                               "order.")
        if not template or (train_on != "all" and not generation and not is_chatml_family(template)):
            raise ToolkitError(f"{where}: the processor's chat template has neither ChatML turns nor {{% generation "
                               "%}} markers, so assistant tokens cannot be located. Set data.chat_template to "
                               "one that has (chatml, qwen2.5-vl or qwen3-vl for a Qwen-VL model), or train_on: "
                               "all.")
        tools = row.get("tools")
        check_renderable(template, messages, tools, where, override=self.chat_template)
        paths = [base_dir / p for p in images]
        grids = [image_grid(processor.image_processor, p, where, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels) for p in paths]
        merge = processor.image_processor.merge_size ** 2
        counts = [int(np.prod(g)) // merge for g in grids]
        direct = None if generation else chosen_renderer(template, self.renderer)
        if direct is not None:  # a stock template: rendered in Python, its assistant spans known as written
            try:
                text, turns = direct(messages, tools)
                text, shift = _expand_images(text, counts, where)
                spans = [(shift(a), shift(b)) for (a, b), t in zip(turns, trains, strict=True) if t]
                return text, spans, False, [str(p) for p in paths], grids
            except Unrendered:  # a row the direct renderer does not mirror: the template renders it
                pass
        text, blocks = render_chat(processor.tokenizer, messages, tools, where, generation=generation,
                                   template=template)
        text, shift = _expand_images(text, counts, where)
        if generation:
            if not all(trains) and len(blocks) != len(trains):
                raise ToolkitError(f"{where}: the chat template's {{% generation %}} blocks mark {len(blocks)} "
                                   f"span(s) for {len(trains)} assistant turn(s), so per-turn weights cannot be "
                                   "applied exactly; drop the weights or use the model's own template.")
            spans = [(shift(a), shift(b)) for (a, b), t in zip(blocks, trains, strict=False) if t or all(trains)]
        else:
            spans = [s for s, t in zip(chatml_assistant_spans(text, len(trains), where), trains, strict=True) if t]
        return text, spans, generation, [str(p) for p in paths], grids


def _expand_images(text: str, counts: list[int], where: str) -> tuple[str, Any]:
    """`text` with its k-th `<|image_pad|>` repeated counts[k] times (the processor's expansion), and the map from
    a character position of `text` to the expanded one."""
    pieces, inserted, pos = [], [], 0
    for n in counts:
        at = text.find(IMAGE_PAD, pos)
        if at == -1:
            raise ToolkitError(f"{where}: the chat template rendered fewer images than the row has.")
        pieces += [text[pos:at], IMAGE_PAD * n]
        inserted.append((at, len(IMAGE_PAD) * (n - 1)))
        pos = at + len(IMAGE_PAD)
    pieces.append(text[pos:])

    def shift(position: int) -> int:
        return position + sum(extra for at, extra in inserted if at < position)

    return "".join(pieces), shift


def encode_vl_row(row: dict[str, Any], processor: Any, *, train_on: str, max_seq_len: int, overlength: str,
                  base_dir: str | Path, where: str, min_pixels: int | None = None, max_pixels: int | None = None,
                  stats: DataStats | None = None) -> dict[str, Any] | None:
    """Token ids, labels and (for image rows) `images` (resolved paths) and `image_grid_thw` of one VL chat row:
    `VLEncoder` on a batch of one, then the over-length policy.

    Labels: assistant turns + <|im_end|> (from the template's generation markers, or read off a ChatML-family
    rendering), or every token with train_on="all"; vision tokens and the first token never carry loss. Images are
    never cut: over `max_seq_len`, "error" raises, "drop" returns None, and "truncate" cuts ids/labels only when
    every vision token lies before the cut, otherwise the row is dropped (None) since a partial image matches no
    `image_grid_thw`. `stats`, when given, counts dropped and truncated rows.
    """
    encoder = VLEncoder(processor, train_on=train_on, min_pixels=min_pixels, max_pixels=max_pixels)
    batch = encoder.encode([row], [0], lambda _: where, Path(base_dir))
    full = batch.sample(0)
    sample = fit_to_length(full["input_ids"], full["labels"], max_seq_len=max_seq_len, overlength=overlength,
                           where=where, stats=stats, uncuttable=int(batch.uncuttable[0]))  # type: ignore[index]
    if sample is not None and "images" in full:
        sample["images"], sample["image_grid_thw"] = full["images"], full["image_grid_thw"]
    return sample


def process_images(processor: Any, paths: list[str], *, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of image files, decoded and resized within the pixel bounds."""
    images = [_load_image(Path(p), p) for p in paths]
    kwargs = {}
    if min_pixels is not None or max_pixels is not None:
        low, high = _pixel_bounds(processor.image_processor, min_pixels, max_pixels)
        kwargs["size"] = {"shortest_edge": low, "longest_edge": high}
    out = processor.image_processor(images=images, return_tensors="pt", **kwargs)
    return out["pixel_values"], out["image_grid_thw"]
