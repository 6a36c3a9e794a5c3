"""Rows to batches: `batch_collator` picks the collator of a run. Text rows are padded (`padding_collator`,
transformers' seq2seq collator) or flattened when packed (`toolkit.data.packing.PackedCollator`); vision-language rows
go through `VLCollator`, which pads tokenised VL rows and loads their images, ZeRO-3/FSDP-safe, or when packed
through `VLPackedCollator` (one flattened row, multimodal rotary ids per sample). A preference stage's pair rows go
through `pair_collator` over the run's collator: each pair's two sides as two sequences. Collators run in the
DataLoader's worker processes (toolkit/data/batching.py), so images are decoded there, once per content and
resize settings when the image cache is on (`toolkit.data.frames.ImageStore`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.frames import ImageStore
from toolkit.data.packing import PackedCollator, unpack_row
from toolkit.data.vision import VIDEO_REF, process_images, process_videos, video_patches
from toolkit.errors import ToolkitError
from toolkit.templates import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

SHARED_IMAGES = "shared_images"
"""A batch's key, where its images are passed once for several occurrences (`VLCollator.media` with `share`): for
each occurrence in `image_grid_thw`, `[index of its image in pixel_values, t, h, w]`, plain ints (the loop's device
copy leaves them on the host, so reading them waits for nothing). Not a model input: the forward takes it off
(toolkit/model/shared_media.py)."""
SHARED_VIDEOS = "shared_videos"
"""As `SHARED_IMAGES`, for videos: each distinct video's frames are passed once in `pixel_values_videos`, and for each
occurrence in `video_grid_thw` (and `second_per_grid_ts`), `[index of its video, t, h, w]`."""


class VLCollator:
    """Right-pads ids/labels/attention_mask, loads and processes the rows' images (`pixel_values`, `image_grid_thw`)
    and adds `mm_token_type_ids` (for M-RoPE). Each image must give the grid its row was tokenised with, else the
    image tokens would not match the image features (the file changed since): that is an error naming the file.

    A batch without images still feeds the vision tower one tiny dummy image, appended after the first row's real
    tokens with attention_mask 0 and labels IGNORE_INDEX: it changes no real token and no loss, but every rank then
    runs the vision tower. Otherwise, under ZeRO-3 / FSDP, a rank with a text-only batch skips the tower's parameter
    all-gathers that another rank performs, and the job hangs (hiyouga/LlamaFactory#5616). A run with video rows
    (`videos`) runs the tower twice per forward, once on images and once on videos, so there every batch carries
    at least one image and one video (a dummy of each where it has none): the ranks' gathers then always match.
    """

    def __init__(self, processor: Any, *, dummy_image: bool = True, min_pixels: int | None = None,
                 max_pixels: int | None = None, videos: bool = False, image_store: ImageStore | None = None) -> None:
        self.processor = processor
        self.pad_to_multiple_of: int | None = None  # a preference stage's sides: PAIR_PAD_MULTIPLE (sides_collator)
        self.image_store = image_store  # resized images cached by content (toolkit.data.frames.ImageStore)
        self.dummy_image = dummy_image
        self.videos = videos
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        tok = processor.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.image_id = tok.convert_tokens_to_ids(IMAGE_PAD)
        self.video_id = tok.convert_tokens_to_ids(VIDEO_PAD)
        self._dummy: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
        self._dummy_video: tuple[list[int], torch.Tensor, torch.Tensor] | None = None

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

    def dummy_video(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(token ids, pixel_values_videos, video_grid_thw) of the smallest black video: two frames (one temporal
        patch) of one merged patch."""
        if self._dummy_video is None:
            ip = self.processor.image_processor
            side = ip.patch_size * ip.merge_size
            pixels, grid = video_patches(self.processor, np.zeros((ip.temporal_patch_size, side, side, 3), np.uint8))
            n = int(np.prod(grid)) // ip.merge_size ** 2
            ids = self.processor.tokenizer.convert_tokens_to_ids([VISION_START, *[VIDEO_PAD] * n, VISION_END])
            self._dummy_video = (ids, pixels, torch.tensor([grid]))
        return self._dummy_video

    def dummies(self, batch: dict[str, torch.Tensor]) -> list[tuple[list[int], str]]:
        """The dummy media `batch` needs (see the class docstring), added to it: their token ids and kind."""
        out: list[tuple[list[int], str]] = []
        if not self.dummy_image:
            return out
        if "pixel_values" not in batch and (self.videos or "pixel_values_videos" not in batch):
            ids, pixels, grid = self.dummy()
            batch["pixel_values"], batch["image_grid_thw"] = pixels, grid
            out.append((ids, "image"))
        if self.videos and "pixel_values_videos" not in batch:
            ids, pixels, grid = self.dummy_video()
            batch["pixel_values_videos"], batch["video_grid_thw"] = pixels, grid
            if "second_per_grid_ts" in self.processor.model_input_names:
                batch["second_per_grid_ts"] = torch.tensor([1.0])
            out.append((ids, "video"))
        return out

    def images(self, paths: list[str], grids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, image_grid_thw) of the images, decoded and resized; each must give the grid its row was
        prepared with."""
        pixels, got = process_images(self.processor, paths, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                                     store=self.image_store)
        if got.tolist() != grids:
            changed = next(p for p, g, e in zip(paths, got.tolist(), grids, strict=True) if g != e)
            raise ToolkitError(f"Image {changed} no longer has the size it was tokenised with: it changed since its "
                               "data file was prepared. Restore it, or delete the data's token store (data.cache_dir, "
                               "stores/) so it is prepared again.")
        return pixels, got

    def stored_videos(self, refs: list[str], grids: list[list[int]]) -> dict[str, torch.Tensor]:
        """`pixel_values_videos`, `video_grid_thw` and, for a model whose processor takes it (Qwen2.5-VL),
        `second_per_grid_ts` of stored videos (`VIDEO_REF` refs) from the frame store; each must give the grid its
        row was tokenised with."""
        pixels, got, seconds = process_videos(self.processor, refs)
        if got.tolist() != grids:
            raise ToolkitError("A stored video's frames no longer give the grid its row was tokenised with; "
                               "delete the data's token store (data.cache_dir, stores/) so it is prepared again.")
        out = {"pixel_values_videos": pixels, "video_grid_thw": got}
        if "second_per_grid_ts" in self.processor.model_input_names:
            out["second_per_grid_ts"] = seconds
        return out

    def media(self, refs: list[str], grids: list[list[int]], *, share: bool = False) -> dict[str, Any]:
        """The batch's vision inputs of stored media in text order (image paths and `VIDEO_REF` videos): images as
        `images`, videos from the frame store (`toolkit.data.vision.process_videos`) with their grids and, for a
        model whose processor takes it (Qwen2.5-VL), `second_per_grid_ts`. With `share` (a preference stage's
        pairs, whose two sides show the same media), an image that occurs more than once is decoded and passed
        once: `pixel_values` holds each distinct image (file and grid) once, `image_grid_thw` every occurrence in
        text order (the rotary ids need them all) and `SHARED_IMAGES` which distinct image each occurrence shows
        (toolkit/model/shared_media.py runs the vision tower once on them and gives each occurrence its image's
        embeddings). Videos alike: `pixel_values_videos` holds each distinct video's frames (stored video and grid)
        once, `video_grid_thw` and `second_per_grid_ts` every occurrence, and `SHARED_VIDEOS` which video each
        occurrence shows."""
        out: dict[str, Any] = {}
        images = [(r, g) for r, g in zip(refs, grids, strict=True) if not r.startswith(VIDEO_REF)]
        videos = [(r, g) for r, g in zip(refs, grids, strict=True) if r.startswith(VIDEO_REF)]
        if images and share:
            distinct: dict[tuple[str, tuple[int, ...]], int] = {}
            owners = [distinct.setdefault((r, tuple(g)), len(distinct)) for r, g in images]
            if len(distinct) < len(images):
                pixels, _ = self.images([r for r, _ in distinct], [list(g) for _, g in distinct])
                out["pixel_values"] = pixels
                out["image_grid_thw"] = torch.tensor([g for _, g in images], dtype=torch.long)
                out[SHARED_IMAGES] = [[u, *g] for u, (_, g) in zip(owners, images, strict=True)]
                images = []
        if images:
            out["pixel_values"], out["image_grid_thw"] = self.images([r for r, _ in images], [g for _, g in images])
        if videos and share:
            distinct_videos: dict[tuple[str, tuple[int, ...]], int] = {}
            owners = [distinct_videos.setdefault((r, tuple(g)), len(distinct_videos)) for r, g in videos]
            if len(distinct_videos) < len(videos):
                out.update(self.stored_videos([r for r, _ in distinct_videos], [list(g) for _, g in distinct_videos]))
                out["video_grid_thw"] = torch.tensor([g for _, g in videos], dtype=torch.long)
                if "second_per_grid_ts" in out:  # per occurrence: the rotary ids read one per video in the text
                    out["second_per_grid_ts"] = out["second_per_grid_ts"][torch.tensor(owners)]
                out[SHARED_VIDEOS] = [[u, *g] for u, (_, g) in zip(owners, videos, strict=True)]
                videos = []
        if videos:
            out.update(self.stored_videos([r for r, _ in videos], [g for _, g in videos]))
        return out

    def __call__(self, rows: list[dict[str, Any]], *, share: bool = False) -> dict[str, torch.Tensor]:
        ids = [list(r["input_ids"]) for r in rows]
        labels = [list(r["labels"]) for r in rows]
        attn = [[1] * len(x) for x in ids]
        paths = [p for r in rows for p in r.get("images", [])]
        batch: dict[str, torch.Tensor] = {}
        if paths:
            batch.update(self.media(paths, [g for r in rows for g in r.get("image_grid_thw", [])], share=share))
        for dummy_ids, _ in self.dummies(batch):
            ids[0] += dummy_ids
            labels[0] += [IGNORE_INDEX] * len(dummy_ids)
            attn[0] += [0] * len(dummy_ids)
        width = max(len(x) for x in ids)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch["input_ids"] = torch.tensor([x + [self.pad_id] * (width - len(x)) for x in ids])
        batch["labels"] = torch.tensor([x + [IGNORE_INDEX] * (width - len(x)) for x in labels])
        batch["attention_mask"] = torch.tensor([x + [0] * (width - len(x)) for x in attn])
        batch["mm_token_type_ids"] = ((batch["input_ids"] == self.image_id).int()
                                      + 2 * (batch["input_ids"] == self.video_id).int())
        return batch


class MRopeIndex:
    """A vision-language model's multimodal rotary position ids of one sample ([3, 1, n]), computed by the
    model class's own `get_rope_index` from its config: the collator needs no model instance (it runs in DataLoader
    workers) and the ids are exactly the model's."""

    def __init__(self, config: Any) -> None:
        from transformers import AutoModel

        self.model_class = AutoModel._model_mapping[type(config)]
        self.config = config

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> Any:
        return self.model_class.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, ids: torch.Tensor, mm_token_type_ids: torch.Tensor, grids: torch.Tensor | None,
                 video_grids: torch.Tensor | None = None, seconds: torch.Tensor | None = None) -> torch.Tensor:
        extra = {"second_per_grid_ts": seconds} if seconds is not None else {}
        positions, _ = self.model_class.get_rope_index(self, ids, mm_token_type_ids=mm_token_type_ids,
                                                       image_grid_thw=grids, video_grid_thw=video_grids, **extra)
        return positions


class VLPackedCollator(VLCollator):
    """Packed vision-language rows flattened into one row `[1, T]` with no padding (`data.packing` for Qwen2.5-VL
    and Qwen3-VL), the VL side of `toolkit.data.packing.PackedCollator`.

    Every sample keeps its own positions: `position_ids` is `[4, 1, T]`, the text positions restarting at 0 per
    sample (transformers builds the block-diagonal mask from them, as for text) stacked on the multimodal rotary
    ids of each sample computed alone (`MRopeIndex`), so RoPE sees each sample exactly as unpacked. There is no
    `attention_mask`. Images stay whole (samples are packed whole) and in token order. A batch without images gets
    the dummy image as a sample of its own (labels IGNORE_INDEX), which attends to nothing else."""

    def __init__(self, processor: Any, model_config: Any, **kwargs: Any) -> None:
        super().__init__(processor, **kwargs)
        self.rope = MRopeIndex(model_config)

    def __call__(self, rows: list[dict[str, Any]], *, share: bool = False) -> dict[str, torch.Tensor]:
        samples = [s for r in rows for s in _vl_samples(r)]
        paths = [p for s in samples for p in s["images"]]
        grids = [g for s in samples for g in s["image_grid_thw"]]
        batch: dict[str, torch.Tensor] = {}
        if paths:
            batch.update(self.media(paths, grids, share=share))
        for dummy_ids, kind in self.dummies(batch):
            grid = (self.dummy() if kind == "image" else self.dummy_video())[2]
            samples.append({"input_ids": dummy_ids, "labels": [IGNORE_INDEX] * len(dummy_ids),
                            "images": ["dummy" if kind == "image" else VIDEO_REF + "dummy"],
                            "image_grid_thw": grid.tolist()})
        ids, text, rope, k, v = [], [], [], 0, 0
        for s in samples:
            sample_ids = torch.tensor([s["input_ids"]])
            mm = ((sample_ids == self.image_id).int() + 2 * (sample_ids == self.video_id).int())
            n_videos = sum(p.startswith(VIDEO_REF) for p in s["images"])
            n_images = len(s["images"]) - n_videos
            sample_grids = batch["image_grid_thw"][k:k + n_images] if n_images else None
            video_grids = batch["video_grid_thw"][v:v + n_videos] if n_videos else None
            seconds = (batch["second_per_grid_ts"][v:v + n_videos]
                       if n_videos and "second_per_grid_ts" in batch else None)
            k, v = k + n_images, v + n_videos
            rope.append(self.rope(sample_ids, mm, sample_grids, video_grids, seconds))
            text.append(torch.arange(sample_ids.shape[1]).view(1, 1, -1))
            ids.append(sample_ids)
        batch["input_ids"] = torch.cat(ids, dim=1)
        batch["labels"] = torch.tensor([[t for s in samples for t in s["labels"]]])
        batch["position_ids"] = torch.cat([torch.cat(text, dim=2), torch.cat(rope, dim=2)], dim=0)
        batch["mm_token_type_ids"] = ((batch["input_ids"] == self.image_id).int()
                                      + 2 * (batch["input_ids"] == self.video_id).int())
        return batch


def _vl_samples(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A packed VL row split back into its samples (with their own images and grids); a plain row as one."""
    samples = unpack_row(row)
    counts = row.get("image_counts", [len(row.get("images", []))] if len(samples) == 1 else [0] * len(samples))
    out, k = [], 0
    for sample, n in zip(samples, counts, strict=True):
        out.append({**sample, "images": row.get("images", [])[k:k + n],
                    "image_grid_thw": row.get("image_grid_thw", [])[k:k + n]})
        k += n
    return out


class PairCollator:
    """A preference stage's collator: each pair row (an item of `toolkit.data.plan.StageRows` over `PairRows`, its
    chosen and rejected sides packed) unpacked into its two samples in order (chosen 0, rejected 0, chosen 1, ...)
    and collated by `inner`, the run's collator: padding gives 2m padded rows in that order, packing one flattened
    row whose boundaries (`cu_seq_lens_q`) separate all 2m sequences. `pair_index` is the rows' stage-global pair
    indices, a list of ints (the loop's device copy leaves it alone). Plain data: it pickles to DataLoader
    workers.

    A vision pair's sides show the same images and videos (its prompt's): the VL collator passes them once (`share`,
    see `VLCollator.media`), so the vision tower runs once per pair in the step, not once per side."""

    def __init__(self, inner: Any) -> None:
        self.inner = sides_collator(inner)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        samples = []
        for row in rows:
            sides = _vl_samples(row) if "images" in row else unpack_row(row)
            if len(sides) != 2 or "pair_index" not in row:
                raise ValueError("a pair row must pack exactly two sides (chosen, rejected) and carry pair_index")
            samples += sides
        vision = isinstance(self.inner, VLCollator)
        batch = dict(self.inner(samples, share=True) if vision else self.inner(samples))
        batch["pair_index"] = [int(row["pair_index"]) for row in rows]
        if rows and "desirable" in rows[0]:  # a kto stage's rows (toolkit/data/plan.py KtoRows): their labels
            batch["desirable"] = [bool(row["desirable"]) for row in rows]
        return batch


PAIR_PAD_MULTIPLE = 64
"""Padded pair sides are padded to a multiple of this many tokens, in the reference pass and in the step alike."""


def sides_collator(inner: Any) -> Any:
    """The collator of a preference stage's sides, in its steps and in its reference and eval passes: the run's
    collator, padding (if it pads) to a multiple of PAIR_PAD_MULTIPLE tokens.

    Why: a side's log-prob must not depend on the batch it is scored in, or the step at a dpo stage's entry (the
    policy is its own reference there) gives rewards of +-4e-8 instead of 0 and `rewards/accuracies` counts that
    noise. Rows of one padded length give bitwise the same log-probs alone or together; another padded length does
    not, since attention's kernels reduce over the padded key length in vector blocks and a remainder loop (torch's
    CPU flash kernel, measured; GPU kernels work in tiles of 64 or 128, not measured here), so the same real keys
    fall in other blocks. Padding to a multiple of 64 keeps each real key in the same block whatever the batch's
    longest side: padded keys add exact zeros. At most 63 padding tokens per row; packed rows have none and need
    nothing. The VL collator pads alike (a vision pair's sides)."""
    if isinstance(inner, DataCollatorForSeq2Seq) and inner.pad_to_multiple_of is None:
        return dataclasses.replace(inner, pad_to_multiple_of=PAIR_PAD_MULTIPLE)
    if type(inner) is VLCollator and inner.pad_to_multiple_of is None:
        padded = copy.copy(inner)
        padded.pad_to_multiple_of = PAIR_PAD_MULTIPLE
        return padded
    return inner


def pair_collator(inner: Any) -> PairCollator:
    """The collator of a preference stage's micro-batches over the run's collator `inner` (`PairCollator`)."""
    return PairCollator(inner)


def padding_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorForSeq2Seq:
    """Pads a list of samples to the longest one (right padding, labels padded with IGNORE_INDEX)."""
    return DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE_INDEX,
                                  return_tensors="pt")


def batch_collator(processor: Any, *, vision: bool, packing: bool, min_pixels: int | None = None,
                   max_pixels: int | None = None, model_config: Any = None, videos: bool = False,
                   image_store: ImageStore | None = None) -> Any:
    """A run's collator: the VL collator (`processor` is the VL processor; packed: with the model's config for its
    rotary ids; `videos`: the run has video rows; `image_store`: the image cache), the packing collator (flattened
    rows), or plain padding (`processor` is the tokenizer)."""
    vl = {"min_pixels": min_pixels, "max_pixels": max_pixels, "videos": videos, "image_store": image_store}
    if vision and packing:
        return VLPackedCollator(processor, model_config, **vl)
    if vision:
        return VLCollator(processor, **vl)
    return PackedCollator() if packing else padding_collator(processor)
