"""Vision-language (Qwen2.5-VL, Qwen3-VL) rows to token ids and loss masks, formatted by the processor's chat
template: the VL side of `toolkit.data.encoding`.

A VL row is a chat whose user content may be a list of parts, plus the images those parts refer to:
  {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                {"role": "assistant", "content": "It is red."}],
   "images": ["images/0.png"]}
Image paths are relative to the data file's directory; there is one `{"type": "image"}` placeholder per entry of
`images`, in order, and one `{"type": "video"}` placeholder per entry of `videos` (a file, a list of frame images,
or {"video": either, settings}). Rows without media are text-only and may be mixed freely with image and video
rows. Messages are checked and turns masked by the same functions as text rows (`toolkit.data.encoding`).

A video's frames come from the frame store (`toolkit.data.frames`: sampled and resized once, when the source is
prepared); its `<|video_pad|>` is expanded by the processor class's own `replace_video_token` (Qwen3-VL: with
frame timestamps). A row's media are stored in text order in one list (`images`), a video as `VIDEO_REF` + its
frame store folder, so the token store, planning and packing carry images and videos alike.

No pixel is decoded here. An image's grid, and so its number of tokens, follows from its size alone: the image
processor resizes to a multiple of patch x merge within its pixel bounds (`smart_resize`), so `image_grid` reads
the size from the file's header. The rendering's `<|image_pad|>` is expanded to that many tokens, as the processor
does, and the rows tokenised in one batch. Pixels are decoded and resized when a batch is built, in DataLoader
workers (`toolkit.data.collate.VLCollator`), which checks that each image still gives the grid its row was prepared
with.
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
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
from toolkit.data.frames import VideoSettings, frames
from toolkit.data.render import Unrendered
from toolkit.errors import ToolkitError
from toolkit.templates import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, VISION_TOKENS

VIDEO_REF = "video:"
"""A video's entry among a row's stored media (the `images` column, in text order): this prefix and its frame
store folder. Images and videos share the column so packing, planning and the store carry them unchanged."""


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
                 renderer: str = "auto", video: VideoSettings | None = None, frame_store: Path | None = None,
                 tokens_per_second: float | None = None) -> None:
        self.processor, self.train_on = processor, train_on
        self.renderer = renderer  # data.renderer (toolkit/data/render.py)
        if getattr(processor, "chat_template", None):
            chosen_renderer(processor.chat_template, renderer)  # said once
        self.video = video or VideoSettings()
        self.frame_store = frame_store  # None: a temporary folder of this process, made at the first video
        self.tokens_per_second = tokens_per_second  # Qwen2.5-VL's temporal scale (None: no time scaling)
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
                                           else {}), **({"renderer": "jinja"} if self.renderer == "jinja" else {}),
                **({"video": self.video.describe()} if self.video.describe() else {})}

    def with_video(self, given: dict[str, Any] | None, where: str) -> VLEncoder:
        """This encoder with video settings `given` (a data entry's or a stage's) over its own."""
        settings = self.video.over(given, where)
        if settings == self.video:
            return self
        out = copy.copy(self)
        out.video = settings
        return out

    def encode(self, rows: Sequence[dict[str, Any]], numbers: Sequence[int], address: RowAddress,
               base_dir: Path | None = None, *, max_tokens: int | None = None) -> EncodedBatch:
        """Encode `rows`, whose image paths are relative to `base_dir`; the first bad row raises. With
        `max_tokens`, a row whose rendering is far longer is stored cut (`SizeGuard`) and counts as uncuttable
        whole: its images may lie past the cut, so truncation drops it."""
        texts, plans = [], []
        for row, number in zip(rows, numbers, strict=True):
            text, spans, overlap, paths, grids = self._render(row, address(number), Path(base_dir or "."))
            if max_tokens is not None:
                self._check_frame_budget(paths, grids, max_tokens, address(number))
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
        kinds = [p["type"] for m in messages if isinstance(m["content"], list) for p in m["content"]
                 if p["type"] in ("image", "video")]
        images, videos = row.get("images", []), row.get("videos", [])
        if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
            raise ToolkitError(f"{where}: 'images' must be a list of image paths, got {type(images).__name__}.")
        if not isinstance(videos, list) or not all(_is_video(v) for v in videos):
            raise ToolkitError(f"{where}: 'videos' must be a list of videos, each a file path, a list of frame "
                               "image paths, or {\"video\": path or frames, and settings such as fps}.")
        for kind, given in (("image", images), ("video", videos)):
            n_parts = kinds.count(kind)
            if n_parts != len(given):
                raise ToolkitError(f"{where}: {n_parts} {{\"type\": \"{kind}\"}} placeholder(s) (or '<{kind}>' "
                                   f"tags) in 'messages' but {len(given)} {'path' if kind == 'image' else kind}(s) in "
                                   f"'{kind}s'; there must be one "
                                   f"placeholder per {kind}, in order.")
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
        image_text = [IMAGE_PAD * (int(np.prod(g)) // merge) for g in grids]
        video_refs, video_grids, video_text = [], [], []
        for k, video in enumerate(videos):
            ref, grid, expanded = self._video(video, base_dir, f"{where}: videos[{k}]")
            video_refs.append(ref)
            video_grids.append(grid)
            video_text.append(expanded)
        media: list[str] = []
        media_grids: list[list[int]] = []
        it_images = iter(zip(paths, grids, strict=True))
        it_videos = iter(zip(video_refs, video_grids, strict=True))
        for kind in kinds:  # the stored media in text order
            path, grid = next(it_images) if kind == "image" else next(it_videos)
            media.append(str(path))
            media_grids.append(grid)
        # The direct renderer mirrors the stock templates' image parts; a row with video goes through the template.
        direct = None if generation or videos else chosen_renderer(template, self.renderer)
        if direct is not None:  # a stock template: rendered in Python, its assistant spans known as written
            try:
                text, turns = direct(messages, tools)
                text, shift = _expand_media(text, image_text, video_text, where)
                spans = [(shift(a), shift(b)) for (a, b), t in zip(turns, trains, strict=True) if t]
                return text, spans, False, media, media_grids
            except Unrendered:  # a row the direct renderer does not mirror: the template renders it
                pass
        text, blocks = render_chat(processor.tokenizer, messages, tools, where, generation=generation,
                                   template=template)
        text, shift = _expand_media(text, image_text, video_text, where)
        if generation:
            if not all(trains) and len(blocks) != len(trains):
                raise ToolkitError(f"{where}: the chat template's {{% generation %}} blocks mark {len(blocks)} "
                                   f"span(s) for {len(trains)} assistant turn(s), so per-turn weights cannot be "
                                   "applied exactly; drop the weights or use the model's own template.")
            spans = [(shift(a), shift(b)) for (a, b), t in zip(blocks, trains, strict=False) if t or all(trains)]
        else:
            spans = [s for s, t in zip(chatml_assistant_spans(text, len(trains), where), trains, strict=True) if t]
        return text, spans, generation, media, media_grids

    def _video(self, video: Any, base_dir: Path, where: str) -> tuple[str, list[int], str]:
        """(the stored reference, grid [t, h, w] and expanded tokens text) of one video, its frames from the frame
        store (decoded there once)."""
        settings = self.video
        if isinstance(video, dict):
            settings = settings.over({k: v for k, v in video.items() if k != "video"}, where)
            video = video["video"]
        urls = [v for v in ([video] if isinstance(video, str) else video) if re.match(r"^(https?|data):", v)]
        if urls:
            raise ToolkitError(f"{where}: {urls[0][:60]!r} is a URL; videos are read from files, never downloaded or "
                               "decoded from data URLs: download the video and give its path.")
        video = (video.removeprefix("file://") if isinstance(video, str)  # qwen-vl-utils' local-file prefix
                 else [v.removeprefix("file://") for v in video])
        if self.frame_store is None:
            self.frame_store = Path(tempfile.mkdtemp(prefix="toolkit-frames-"))
        ip = self.processor.image_processor
        stored = frames(video, base_dir, settings, ip.patch_size * ip.merge_size, self.frame_store, where)
        meta = stored.meta
        self._check_temporal(meta["sampled_fps"], where, settings)
        h, w = meta["size"]
        grid = [meta["frames"] // ip.temporal_patch_size, h // ip.patch_size, w // ip.patch_size]
        return VIDEO_REF + str(stored.folder), grid, video_tokens(self.processor, grid, meta)

    def _check_frame_budget(self, refs: list[str], grids: list[list[int]], max_tokens: int, where: str) -> None:
        """Refuse a row whose videos alone are more tokens than the longest max_seq_len: no stage could train it,
        and data.overlength would only drop it unseen (`frame_budget_problem`; a stage's own max_seq_len is
        checked when the stage loads, toolkit/data/stages.py)."""
        videos = [g for r, g in zip(refs, grids, strict=True) if r.startswith(VIDEO_REF)]
        problem = frame_budget_problem(videos, self.processor.image_processor.merge_size ** 2, max_tokens,
                                       "the longest max_seq_len")
        if problem is not None:
            raise ToolkitError(f"{where}: {problem}")

    def _check_temporal(self, sampled_fps: float, where: str, settings: VideoSettings) -> None:
        """Refuse a sampled fps whose frames would share temporal positions on this model: Qwen2.5-VL places the
        t-th frame pair at int(t x tokens_per_second x temporal_patch / fps), which repeats once the step is
        below 1."""
        if self.tokens_per_second is None:
            return
        tp = self.processor.image_processor.temporal_patch_size
        step = self.tokens_per_second * tp / sampled_fps
        if step < 1:
            most = self.tokens_per_second * tp
            raise ToolkitError(f"{where}: frames sampled at {sampled_fps:g} fps would share temporal positions on "
                               f"this model (tokens_per_second {self.tokens_per_second:g} x {tp} frames per patch / "
                               f"fps = {step:.2f} < 1 position per frame pair); set video fps to at most {most:g} "
                               f"(settings now: {settings.describe() or 'defaults'}).")


def frame_budget_problem(videos: list[list[int]], merge: int, max_tokens: int, limit: str) -> str | None:
    """What is wrong with a row whose videos (their grids t x h x w) alone are more tokens than `max_tokens` (None:
    they fit): its frames, tokens per frame pair, and the largest max_frames that fits (`limit` names the max_seq_len
    it is over)."""
    total = sum(int(np.prod(g)) // merge for g in videos)
    if total <= max_tokens:
        return None
    per_pair = sum(g[1] * g[2] // merge for g in videos)
    frames = 2 * (max_tokens // per_pair)
    fix = (f"set video.max_frames to at most {frames} (the data entry's or the stage's video: settings), or "
           "lower video.max_pixels" if frames >= 2 else "lower video.max_pixels (or total_pixels)")
    return (f"its video frames alone are {total} tokens ({sum(g[0] for g in videos) * 2} frames, {per_pair} tokens "
            f"per frame pair), over {limit} ({max_tokens}); {fix}, or raise max_seq_len.")


def tokens_per_second(processor: Any) -> float | None:
    """Qwen2.5-VL's `vision_config.tokens_per_second` (the temporal scale of its rotary ids) from the config beside
    the processor's tokenizer; None for a model whose video positions are not scaled by it (Qwen2-VL, Qwen3-VL,
    which separates frames by text timestamps) or whose config is not at hand."""
    from transformers import AutoConfig

    name = getattr(processor.tokenizer, "name_or_path", "")
    try:
        config = AutoConfig.from_pretrained(name) if name else None
    except (OSError, ValueError):
        return None
    if config is None or getattr(config, "model_type", "") != "qwen2_5_vl":
        return None
    return float(getattr(config.vision_config, "tokens_per_second", 2))


def _is_video(video: Any) -> bool:
    """A file path, a list of frame paths, or {"video": either, settings...}."""
    if isinstance(video, dict):
        return "video" in video and _is_video(video["video"]) and not isinstance(video["video"], dict)
    return isinstance(video, str) or (isinstance(video, list) and bool(video)
                                      and all(isinstance(p, str) for p in video))


def video_tokens(processor: Any, grid: list[int], meta: dict[str, Any]) -> str:
    """The text a video's `<|video_pad|>` becomes, by the processor class's own `replace_video_token` (Qwen2.5-VL:
    the video tokens; Qwen3-VL: each frame pair's `<t seconds>` timestamp and tokens), from the stored sampling
    metadata, so the rendering is the processor's. A processor without a video processor (the built-in tiny
    models' image-only ones, transformers' video processors needing torchvision) is given the image processor's
    patch sizes, which are the video processor's."""
    from transformers.video_utils import VideoMetadata

    ip = processor.image_processor
    video_processor = getattr(processor, "video_processor", None) or ip
    shim = type("VideoProcessorView", (), {})()
    shim.video_processor = video_processor
    shim.vision_start_token, shim.vision_end_token, shim.video_token = VISION_START, VISION_END, VIDEO_PAD
    shim._calculate_timestamps = lambda indices, fps, merge=2: type(processor)._calculate_timestamps(
        shim, list(indices), fps, merge)
    metadata = VideoMetadata(total_num_frames=meta["total_frames"], fps=meta["fps"],
                             frames_indices=list(meta["indices"]))
    return type(processor).replace_video_token(shim, {"video_grid_thw": torch.tensor([grid]),
                                                      "video_metadata": [metadata]}, 0)


def _expand_media(text: str, images: list[str], videos: list[str], where: str) -> tuple[str, Any]:
    """`text` with its k-th `<|image_pad|>` replaced by images[k] and its k-th `<|video_pad|>` by videos[k] (the
    processor's expansion, left to right), and the map from a character position of `text` to the expanded one."""
    pieces, inserted, pos = [], [], 0
    todo = {IMAGE_PAD: iter(images), VIDEO_PAD: iter(videos)}
    left = {IMAGE_PAD: len(images), VIDEO_PAD: len(videos)}
    while any(left.values()):
        found = [(text.find(t, pos), t) for t in todo if left[t]]
        found = [(at, t) for at, t in found if at != -1]
        if not found:
            raise ToolkitError(f"{where}: the chat template rendered fewer images or videos than the row has.")
        at, token = min(found)
        replacement = next(todo[token])
        left[token] -= 1
        pieces += [text[pos:at], replacement]
        inserted.append((at, len(replacement) - len(token)))
        pos = at + len(token)
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


def process_videos(processor: Any, refs: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixel_values_videos, video_grid_thw, second_per_grid_ts) of stored videos (`VIDEO_REF` folders): their
    frames, already sampled and resized, rescaled and normalised with the image processor's settings and cut into
    patches in the layout of transformers' Qwen2-VL video processor (`patchify`: frame pairs along time, then
    merge blocks). That processor needs torchvision, and would resize again; here nothing is decoded or resized.
    second_per_grid_ts is temporal_patch_size / sampled fps, a float (cast to int64 it would truncate to 0 above
    2 fps: transformers #41152)."""
    pixels, grids, seconds = [], [], []
    for ref in refs:
        folder = Path(ref.removeprefix(VIDEO_REF))
        if not (folder / "frames.npy").is_file():
            raise ToolkitError(f"The frames of a video row are missing from the frame store ({folder}): the store "
                               "was cleared since the data was prepared. Delete the data's token store "
                               "(data.cache_dir, stores/) so both are prepared again.")
        meta = json.loads((folder / "meta.json").read_text())
        patches, grid = video_patches(processor, np.load(folder / "frames.npy", mmap_mode="r"))
        pixels.append(patches)
        grids.append(grid)
        seconds.append(processor.image_processor.temporal_patch_size / meta["sampled_fps"])
    return (torch.cat(pixels), torch.tensor(grids, dtype=torch.long),
            torch.tensor(seconds, dtype=torch.float32))


def video_patches(processor: Any, frames: np.ndarray) -> tuple[torch.Tensor, list[int]]:
    """(patches, [t, h, w] grid) of frames [T, H, W, 3] uint8 at their final size (see `process_videos`)."""
    ip = processor.image_processor
    p, m, tp = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    video = torch.from_numpy(np.array(frames)).permute(0, 3, 1, 2)
    video = video.float() * float(ip.rescale_factor) if ip.do_rescale else video.float()
    if ip.do_normalize:
        mean = torch.tensor(ip.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(ip.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        video = (video - mean) / std
    if pad := -video.shape[0] % tp:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    t, c, h, w = video.shape
    gt, gh, gw = t // tp, h // p, w // p
    patches = video.view(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]
