"""Rows to batches: `batch_collator` picks the collator of a run. Text rows are padded (`padding_collator`,
transformers' seq2seq collator) or flattened when packed (`toolkit.packing.PackedCollator`); vision-language rows
go through `VLCollator`, which pads tokenised VL rows and loads their images, ZeRO-3/FSDP-safe.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from toolkit.errors import ToolkitError
from toolkit.labels import IGNORE_INDEX
from toolkit.packing import PackedCollator
from toolkit.templates import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START
from toolkit.vl_data import process_images


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


def padding_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorForSeq2Seq:
    """Pads a list of samples to the longest one (right padding, labels padded with IGNORE_INDEX)."""
    return DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE_INDEX,
                                  return_tensors="pt")


def batch_collator(processor: Any, *, vision: bool, packing: bool, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> Any:
    """A run's collator: the VL collator (`processor` is the VL processor), the packing collator (flattened rows),
    or plain padding (`processor` is the tokenizer)."""
    if vision:
        return VLCollator(processor, min_pixels=min_pixels, max_pixels=max_pixels)
    return PackedCollator() if packing else padding_collator(processor)
