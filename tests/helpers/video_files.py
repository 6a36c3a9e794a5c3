"""Small video files with known frame contents, written by the tests (PyAV): frame i is a flat grey of level
`level(i)`, so which frames were sampled can be read back from the stored pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def level(i: int) -> int:
    """The grey level of frame i (distinct for the first 26 frames, then cycling)."""
    return 10 * (i % 26)


def write_video(path: Path, frames: int, *, fps: int = 10, size: tuple[int, int] = (64, 48), mark: int | None = None
                ) -> Path:
    """An MPEG-4 file of `frames` frames at `fps`, `size` (width, height) pixels, frame i grey `level(i)`; `mark`
    paints column `mark % width` and row `mark // width % height` white, so files of the same length differ in
    content (width x height marks)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"qscale": "1"}  # near-lossless: flat greys come back within a few levels
        for i in range(frames):
            image = np.full((height, width, 3), level(i), np.uint8)
            if mark is not None:
                image[:, mark % width] = 255
                image[(mark // width) % height, :] = 255
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


VIDEO_QUESTIONS = ("What happens?", "Does it get brighter?", "Describe the clip.", "How does it change?")


def write_video_dataset(folder: Path, rows: int, *, videos: int = 3) -> Path:
    """`folder/videos.jsonl`: LLaMA-Factory-shaped rows (`<video>` / `<image>` tags, `videos`, `images`) cycling
    through a video row, an image + video row, a text row and an ms-swift frame-list row, over `videos` small files
    of 32-48 frames (4-6 s: 8 or more frames at 2 fps); returns the data file."""
    import json

    from PIL import Image

    files = [write_video(folder / "clips" / f"{k}.mp4", 32 + 8 * (k % 3), fps=8) for k in range(videos)]
    frames = write_frames([folder / "frames" / f"{k}.png" for k in range(5)])
    Image.new("RGB", (48, 64), "red").save(folder / "red.png")
    out = []
    for i in range(rows):
        clip = files[i % len(files)].relative_to(folder).as_posix()
        question, answer = VIDEO_QUESTIONS[i % len(VIDEO_QUESTIONS)], f"It gets brighter, {i % 7} times."
        kind = i % 4
        if kind == 0:
            out.append({"messages": [{"role": "user", "content": f"<video>{question}"},
                                     {"role": "assistant", "content": answer}], "videos": [clip]})
        elif kind == 1:
            out.append({"messages": [{"role": "user", "content": f"<image>Red? <video>{question}"},
                                     {"role": "assistant", "content": answer}], "images": ["red.png"],
                        "videos": [clip]})
        elif kind == 2:
            out.append({"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                     {"role": "assistant", "content": f"{i + 1}."}]})
        else:
            out.append({"messages": [{"role": "user", "content": f"<video>{question}"},
                                     {"role": "assistant", "content": answer}],
                        "videos": [[p.relative_to(folder).as_posix() for p in frames[: 3 + i % 3]]]})
    path = folder / "videos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def video_recipe(data: Path, out: Path, *, steps: int = 2) -> dict:
    """A two-stage short-to-long video curriculum on the tiny Qwen2.5-VL: stage 'short' at most 4 frames a video,
    stage 'long' at most 8 (small frames: 56x56 px, 4 tokens a frame pair)."""
    return {"output_dir": str(out), "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                     "exclude_modules": ".*visual.*"},
            "data": {"max_seq_len": 384, "num_proc": 1, "video": {"min_pixels": 3136, "max_pixels": 12544}},
            "stages": [{"name": "short", "data": [str(data)], "max_steps": steps, "video": {"max_frames": 4},
                        "trainable": ["lora", "visual.merger"]},
                       {"name": "long", "data": [str(data)], "max_steps": steps, "video": {"max_frames": 8},
                        "trainable": ["lora", "visual.merger"]}],
            "train": {"micro_batch_size": 2, "grad_accum": 2, "seed": 7},
            "logging": {"progress_bar": False, "trackers": []}}
