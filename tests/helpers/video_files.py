"""Small video files with known frame contents, written by the tests (PyAV): frame i is a flat grey of level
`level(i)`, so which frames were sampled can be read back from the stored pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def level(i: int) -> int:
    """The grey level of frame i (distinct for the first 26 frames, then cycling)."""
    return 10 * (i % 26)


def write_video(path: Path, frames: int, *, fps: int = 10, size: tuple[int, int] = (64, 48)) -> Path:
    """An MPEG-4 file of `frames` frames at `fps`, `size` (width, height) pixels, frame i grey `level(i)`."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"qscale": "1"}  # near-lossless: flat greys come back within a few levels
        for i in range(frames):
            image = np.full((height, width, 3), level(i), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_frames(paths: list[Path], *, size: tuple[int, int] = (64, 48)) -> list[Path]:
    """A frame list: image files, the k-th a flat grey of `level(k)`."""
    from PIL import Image

    for k, p in enumerate(paths):
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (level(k),) * 3).save(p)
    return paths


def frame_levels(frames: np.ndarray) -> list[int]:
    """The mean grey level of each stored frame ([T, H, W, 3]), rounded."""
    return [round(float(f.mean())) for f in frames]
