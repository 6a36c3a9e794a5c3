"""Videos to frames, once: the frame store of vision-language video rows (Qwen2.5-VL, Qwen3-VL).

A video is a file path or a list of frame images (ms-swift's and qwen-vl-utils' frame lists). Its frames are
sampled and resized once per (content, settings) by qwen-vl-utils' rules (`QWEN_VIDEO_DEFAULTS`, `sample_count`,
`frame_size`), and stored content-addressed under `<data.cache_dir>/frames/<key>/` beside the token store:
`frames.npy` (uint8 [T, H, W, 3], already at the size the model sees) and `meta.json` (the decoder's fps, the total
frame count, the sampled frame indices, the sampled fps, the source). Token counts, packing and max_seq_len are
therefore exact before step 1, and no decoder runs in the training loop: the collator memory-maps `frames.npy`.

The decoder is PyAV (`av` on PyPI, the `video` extra): its wheels bundle FFmpeg, so it needs no system libraries
(torchcodec needs a matching system FFmpeg and a torch of its own release line), and it is maintained. decord is
never used: Qwen calls it unmaintained, and it hangs in multi-worker loaders. Only the frames that are sampled are
converted to RGB and resized; decoding stops after the last one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from toolkit.errors import ToolkitError

FRAME_STORE_VERSION = 1
FRAME_FACTOR = 2  # qwen-vl-utils: frame counts are a multiple of 2 (the temporal patch)
VIDEO_MIN_TOKENS, VIDEO_MAX_TOKENS = 128, 768  # qwen-vl-utils: tokens per frame (pair) bounds
MODEL_SEQ_LEN = 128000  # qwen-vl-utils' default total budget: total_pixels = 0.9 x this many tokens' pixels
QWEN_VIDEO_DEFAULTS = {"fps": 2.0, "min_frames": 4, "max_frames": 768, "sample_fps": 2.0}
VIDEO_KEYS = ("fps", "nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels",
              "sample_fps")
"""The settings of a video, named as qwen-vl-utils names them (per video part, per data entry, per stage)."""

log = logging.getLogger("toolkit")

DECODES = {"files": 0}
"""Videos decoded by this process (a frame store miss each): the proof that a warm relaunch decodes nothing."""


@dataclass(frozen=True)
class VideoSettings:
    """How a video is sampled and resized (qwen-vl-utils' `fps`/`nframes`, `min_frames`, `max_frames`,
    `min_pixels`, `max_pixels`, `total_pixels`; `sample_fps` is the fps a frame list stands for). None: Qwen's
    default."""

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    sample_fps: float | None = None

    def over(self, given: dict[str, Any] | None, where: str) -> VideoSettings:
        """These settings with `given`'s keys (a video part's, an entry's or a stage's) taking precedence."""
        if not given:
            return self
        unknown = sorted(set(given) - set(VIDEO_KEYS))
        if unknown:
            raise ToolkitError(f"{where}: unknown video setting(s) {unknown}; the settings are {list(VIDEO_KEYS)}.")
        for key, value in given.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise ToolkitError(f"{where}: video setting {key} must be a positive number, got {value!r}.")
        merged = replace(self, **{k: v for k, v in given.items() if v is not None})
        if "fps" in given and "nframes" not in given:
            merged = replace(merged, nframes=None)
        if "nframes" in given and "fps" not in given:
            merged = replace(merged, fps=None)
        if merged.fps is not None and merged.nframes is not None:
            raise ToolkitError(f"{where}: a video takes fps or nframes, not both (qwen-vl-utils' rule).")
        return merged

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _round(n: float, f: int) -> int:
    return round(n / f) * f


def _ceil(n: float, f: int) -> int:
    return math.ceil(n / f) * f


def _floor(n: float, f: int) -> int:
    return math.floor(n / f) * f


def sample_count(s: VideoSettings, total: int, video_fps: float, where: str) -> int:
    """How many frames to sample (qwen-vl-utils `smart_nframes`): `nframes` rounded to a multiple of 2, or the
    video's duration x fps within [min_frames, max_frames] and the frames it has, floored to a multiple of 2."""
    if s.nframes is not None:
        n = _round(s.nframes, FRAME_FACTOR)
    else:
        fps = s.fps if s.fps is not None else QWEN_VIDEO_DEFAULTS["fps"]
        low = _ceil(s.min_frames if s.min_frames is not None else QWEN_VIDEO_DEFAULTS["min_frames"], FRAME_FACTOR)
        high = _floor(s.max_frames if s.max_frames is not None else min(QWEN_VIDEO_DEFAULTS["max_frames"], total),
                      FRAME_FACTOR)
        n = _floor(min(min(max(total / video_fps * fps, low), high), total), FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= total:
        raise ToolkitError(f"{where}: {total} frame(s) in the video, and {n} would be sampled; a video needs at "
                           f"least {FRAME_FACTOR} frames and at most as many as it has: lower nframes / min_frames, "
                           "or drop the row.")
    return n


def frame_size(s: VideoSettings, height: int, width: int, frames: int, factor: int, where: str) -> tuple[int, int]:
    """(height, width) every sampled frame is resized to (qwen-vl-utils `fetch_video`): min_pixels defaults to 128
    tokens' pixels, max_pixels to 768 tokens' or total_pixels / frames x 2, whichever is less (never under
    1.05 x min_pixels), a given max_pixels only lowering it; then `smart_resize` to multiples of `factor`
    (patch x merge)."""
    low = s.min_pixels if s.min_pixels is not None else VIDEO_MIN_TOKENS * factor * factor
    total = s.total_pixels if s.total_pixels is not None else MODEL_SEQ_LEN * factor * factor * 0.9
    high = max(min(VIDEO_MAX_TOKENS * factor * factor, total / frames * FRAME_FACTOR), int(low * 1.05))
    if s.max_pixels is not None:
        high = min(s.max_pixels, high)
    if low > high:
        raise ToolkitError(f"{where}: video min_pixels ({low}) is above its max_pixels ({high}); lower min_pixels.")
    if max(height, width) / min(height, width) > 200:
        raise ToolkitError(f"{where}: a video frame of {width}x{height} has an aspect ratio over 200, which Qwen's "
                           "vision tower refuses; crop the video.")
    h, w = max(factor, _round(height, factor)), max(factor, _round(width, factor))
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h, w = _floor(height / beta, factor), _floor(width / beta, factor)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h, w = _ceil(height * beta, factor), _ceil(width * beta, factor)
    return h, w


def sample_indices(total: int, n: int) -> list[int]:
    """qwen-vl-utils' frame indices: `torch.linspace(0, total - 1, n).round()` (torch, so ties round alike)."""
    return torch.linspace(0, total - 1, n).round().long().tolist()


@dataclass(frozen=True)
class Frames:
    """A video's entry in the frame store: its folder, frames ([T, H, W, 3] uint8) and what was sampled."""

    folder: Path
    meta: dict[str, Any]

    def array(self) -> np.ndarray:
        return np.load(self.folder / "frames.npy", mmap_mode="r")


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise ToolkitError("Video rows need PyAV to decode their files: pip install 'curriculum-toolkit[video]' "
                           "(or pip install av).") from None
    return av


def _resized(image: Image.Image, h: int, w: int) -> np.ndarray:
    """A frame resized with PIL's bicubic filter (antialiased, as qwen-vl-utils' torchvision resize is)."""
    image = image.convert("RGB")
    if image.size != (w, h):
        image = image.resize((w, h), Image.Resampling.BICUBIC)
    return np.asarray(image, dtype=np.uint8)


def decode_file(path: Path, s: VideoSettings, factor: int, where: str) -> tuple[np.ndarray, dict[str, Any]]:
    """The sampled, resized frames of a video file and their metadata; a missing, unreadable or empty file is an
    error naming `where` and the path."""
    if not path.is_file():
        raise ToolkitError(f"{where}: video file {path} does not exist or is not a regular file (video paths are "
                           "relative to the data file's directory); fix the path or drop the row.")
    av = _av()
    DECODES["files"] += 1
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ToolkitError(f"{where}: video file {path} has no video stream; drop the row.")
            stream = container.streams.video[0]
            video_fps = float(stream.average_rate or stream.guessed_rate or 0)
            total = stream.frames or sum(1 for p in container.demux(stream) if p.size)
            if total <= 0 or video_fps <= 0:
                raise ToolkitError(f"{where}: video file {path} has no frames; drop the row, or re-encode the "
                                   "video.")
            n = sample_count(s, total, video_fps, where)
            indices = sample_indices(total, n)
            container.seek(0)
            wanted: dict[int, int] = {}
            for k, i in enumerate(indices):
                wanted.setdefault(i, k)
            out: list[np.ndarray | None] = [None] * n
            size: tuple[int, int] | None = None
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    image = frame.to_image()
                    if size is None:
                        size = frame_size(s, image.height, image.width, n, factor, where)
                    pixels = _resized(image, *size)
                    for k, j in enumerate(indices):
                        if j == i:
                            out[k] = pixels
                if i >= indices[-1]:
                    break
    except (av.error.FFmpegError, OSError) as e:
        raise ToolkitError(f"{where}: video file {path} could not be decoded ({e}); re-encode it or drop the "
                           "row.") from None
    if any(f is None for f in out):
        got = sum(f is not None for f in out)
        raise ToolkitError(f"{where}: video file {path} declares {total} frames but decoded fewer ({got} of the {n} "
                           "sampled were reached); re-encode the video (ffmpeg -i in.mp4 out.mp4) or drop the row.")
    frames = np.stack(out)  # type: ignore[arg-type]
    return frames, {"fps": video_fps, "total_frames": total, "indices": indices,
                    "sampled_fps": n / total * video_fps}


def decode_frame_list(paths: list[Path], s: VideoSettings, factor: int, where: str
                      ) -> tuple[np.ndarray, dict[str, Any]]:
    """A frame list (a video given as its frames' image files): padded with its last frame to an even count (as
    qwen-vl-utils does), every frame resized to the size its first frame's gets; its fps is `sample_fps`, else
    `fps` (the rate the frames were taken at, as Qwen's README passes it with a frame list), else 2."""
    images = []
    for p in paths:
        if not p.is_file():
            raise ToolkitError(f"{where}: frame {p} of a frame-list video does not exist (paths are relative to the "
                               "data file's directory); fix the path or drop the row.")
        try:
            with Image.open(p) as img:
                images.append(img.convert("RGB"))
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as e:
            raise ToolkitError(f"{where}: frame {p} could not be read as an image ({e}).") from None
    if not images:
        raise ToolkitError(f"{where}: a frame-list video with no frames; drop the row.")
    n = _ceil(len(images), FRAME_FACTOR)
    images += [images[-1]] * (n - len(images))
    h, w = frame_size(s, images[0].height, images[0].width, n, factor, where)
    fps = next(f for f in (s.sample_fps, s.fps, QWEN_VIDEO_DEFAULTS["sample_fps"]) if f is not None)
    return np.stack([_resized(im, h, w) for im in images]), {"fps": fps, "total_frames": n,
                                                             "indices": list(range(n)), "sampled_fps": fps}


def video_digest(video: str | list[str], base_dir: Path, where: str, cache: Path | None) -> str:
    """The content digest of a video file or of each frame of a frame list (remembered against their stat)."""
    from toolkit.data.sources import content_digest

    paths = [base_dir / video] if isinstance(video, str) else [base_dir / p for p in video]
    for p in paths:
        if not p.is_file():
            what = "video file" if isinstance(video, str) else "frame"
            raise ToolkitError(f"{where}: {what} {p} does not exist or is not a regular file (paths are relative to "
                               "the data file's directory); fix the path or drop the row.")
    return hashlib.sha256(json.dumps([content_digest(p, cache) for p in paths]).encode()).hexdigest()


def frames(video: str | list[str], base_dir: Path, settings: VideoSettings, factor: int, store: Path,
           where: str) -> Frames:
    """The video's frames from the frame store under `store`, decoded and stored first when missing (content-
    addressed by the video's content, `settings` and `factor`; written to a temporary folder and renamed, so a
    killed preparation leaves nothing that reads as complete)."""
    digest = video_digest(video, base_dir, where, store.parent)
    key = {"version": FRAME_STORE_VERSION, "content": digest, "list": not isinstance(video, str),
           "settings": settings.describe(), "factor": factor}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    folder = store / name
    if (folder / "meta.json").is_file():
        return Frames(folder, json.loads((folder / "meta.json").read_text()))
    if isinstance(video, str):
        pixels, meta = decode_file(base_dir / video, settings, factor, where)
    else:
        pixels, meta = decode_frame_list([base_dir / p for p in video], settings, factor, where)
    t, h, w = pixels.shape[:3]
    meta.update({"key": key, "source": str(video), "size": [h, w], "frames": t})
    tmp = store / f".{name}.{os.getpid()}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "frames.npy", pixels)
    (tmp / "meta.json").write_text(json.dumps(meta))
    try:
        tmp.rename(folder)
    except OSError:  # another process stored the same video first: its copy is the same content
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return Frames(folder, json.loads((folder / "meta.json").read_text()))


IMAGE_PREFIX = "img-"
"""The folder-name prefix of an image's entry in the frame store, so the image cache's size is summed without
reading any entry."""

RESIZES = {"images": 0}
"""Images decoded and resized by this process (`ImageStore.image` misses): the proof that a second epoch, stage or
relaunch resizes nothing."""

RESCAN_BYTES = 64 << 20
"""An `ImageStore` re-sums the store's image entries after writing this many bytes, so processes filling one store
at once overshoot its budget by at most this much each."""


@dataclass
class ImageStore:
    """Resized images cached by content in the frame store: an image is a video of one frame there
    (`<store>/img-<key>/frames.npy`, uint8 [1, H, W, 3] at the size the processor resizes it to, and `meta.json`).

    The key is the image file's content digest and `settings` (the processor's resize settings), so an edited image
    or other settings make another entry. An entry is read back only when its shape and its pixels' crc32 are
    those `meta.json` records; any other entry (a killed write, a truncated or altered file) is rebuilt, never
    misread. crc32 finds damage (a disk's, a killed write's) at several GB/s; it guards against damage, not
    forgery, as the cache is the user's own folder. Images are added while the store's image entries total under
    `budget` bytes; past it they are resized every time (exact either way). Plain data: it pickles to DataLoader
    workers, each counting its own writes."""

    store: Path
    budget: int
    _total: int | None = None
    _since_scan: int = 0
    _full_said: bool = False

    def image(self, path: Path, settings: dict[str, Any], make: Any) -> np.ndarray:
        """The resized image (uint8 [H, W, 3]) of the file at `path`, keyed by its content and `settings`: from the
        store, else (missing or corrupt) `make()`, which decodes and resizes it, stored where the budget has room."""
        from toolkit.data.sources import content_digest

        digest = content_digest(path, self.store.parent)
        key = {"version": FRAME_STORE_VERSION, "kind": "image", "content": digest, "settings": settings}
        name = IMAGE_PREFIX + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        folder = self.store / name
        cached = _read_image(folder, key)
        if cached is not None:
            return cached
        RESIZES["images"] += 1
        pixels = np.ascontiguousarray(make(), dtype=np.uint8)
        if self._room(pixels.nbytes):
            self._write(folder, key, pixels, str(path))
        return pixels

    def _room(self, size: int) -> bool:
        if self._total is None or self._since_scan >= RESCAN_BYTES:
            self._total, self._since_scan = self.used(), 0
        if self._total + size <= self.budget:
            return True
        if not self._full_said:
            self._full_said = True
            log.info(
                "image cache %s is full (%.2f of its %.2f GB budget, data.image_cache_gb): further images are "
                "resized every time", self.store, self._total / 1e9, self.budget / 1e9)
        return False

    def used(self) -> int:
        """Bytes of the store's image entries."""
        total = 0
        if not self.store.is_dir():
            return 0
        for entry in os.scandir(self.store):
            if entry.name.startswith(IMAGE_PREFIX):
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(entry.path, "frames.npy")).st_size
        return total

    def _write(self, folder: Path, key: dict[str, Any], pixels: np.ndarray, source: str) -> None:
        """The entry written to a temporary folder and renamed into place (a corrupt one it replaces is moved
        aside first); a store that cannot be written is left as it is."""
        h, w = pixels.shape[:2]
        meta = {"key": key, "source": source, "size": [h, w], "frames": 1, "bytes": pixels.nbytes,
                "crc32": zlib.crc32(pixels)}
        tmp = self.store / f".{folder.name}.{os.getpid()}.tmp"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            np.save(tmp / "frames.npy", pixels[None])
            (tmp / "meta.json").write_text(json.dumps(meta))
            if folder.exists() and _read_image(folder, key) is None:  # corrupt: ours by its name in our store
                aside = self.store / f".{folder.name}.{os.getpid()}.bad"
                folder.rename(aside)
                shutil.rmtree(aside, ignore_errors=True)
            if folder.exists():  # another process stored the same image meanwhile
                raise FileExistsError(folder)
            tmp.rename(folder)
        except OSError:  # read-only, full, or another process stored the same image first (the same content)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        self._since_scan += pixels.nbytes
        if self._total is not None:
            self._total += pixels.nbytes


def _read_image(folder: Path, key: dict[str, Any]) -> np.ndarray | None:
    """The stored image of an entry whose meta, shape and pixels' crc32 agree; None for a missing or corrupt one."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        h, w = meta["size"]
        pixels = np.load(folder / "frames.npy", allow_pickle=False)
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None
    if (meta.get("key") != key or pixels.dtype != np.uint8 or pixels.shape != (1, h, w, 3)
            or zlib.crc32(pixels) != meta.get("crc32")):
        return None
    return pixels[0]


def writable_store(store: Path) -> str | None:
    """Why the frame store at `store` cannot be written (None: it can): the image cache then stays off."""
    try:
        store.mkdir(parents=True, exist_ok=True)
        probe = store / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return str(e)
    return None
