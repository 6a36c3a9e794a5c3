"""Video rows prepared cold and warm against LLaMA-Factory's way of decoding them, in one process (issue 50).

    python bench/video_decode.py [--rows 1000] [--frames 48] [--size 128x96]

Writes `--rows` video rows (LLaMA-Factory's shape: `<video>` and `videos`), each its own small MPEG-4 file of
`--frames` frames at 8 fps (`--size`, each file's content its own, so the content-addressed store dedups nothing),
then times three things on the same files, on the tiny Qwen2.5-VL's processor:

- **cold**: the toolkit's encoder (`toolkit.data.vision.VLEncoder`) on every row with an empty frame store: each
  video decoded once (PyAV, the frames qwen-vl-utils picks, converted and resized), stored, and the row tokenised;
- **warm**: the same rows again: every video found in the frame store (no decoder call), the rows tokenised. (A
  warm *relaunch* does less still: the token store exists, so not even the encoder runs.)
- **LLaMA-Factory's way**: each video decoded as `mm_plugin._regularize_videos` does (PyAV, walking every frame,
  the sampled ones converted and resized), twice per row: once to count tokens when the dataset is prepared, once
  in the collator when the batch is built (and again every epoch).

Prints rows/s of each and their ratios, and writes `bench/results/<date>-<host>-video-decode.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def llamafactory_decode(path: Path, fps: float = 2.0, max_frames: int = 128, side: int = 112) -> list:
    """One video as LLaMA-Factory's `_regularize_videos` reads it: every frame decoded, the sampled ones (its
    `_get_video_sample_indices`: duration x fps, capped) kept as images and resized."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        total = stream.frames
        duration = float(stream.duration * stream.time_base)
        n = min(max(1, int(duration * fps)), max_frames, total)
        wanted = set(np.linspace(0, total - 1, n).astype(np.int32).tolist())
        frames = []
        for i, frame in enumerate(container.decode(stream)):  # every frame is decoded
            if i in wanted:
                frames.append(frame.to_image().resize((side, side)))
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--size", default="128x96", help="WIDTHxHEIGHT of the videos written")
    args = parser.parse_args()
    size = tuple(int(n) for n in args.size.split("x"))

    from tests.helpers.video_files import write_video
    from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin
    from toolkit.data import frames as frame_store
    from toolkit.data.frames import VideoSettings
    from toolkit.data.vision import VLEncoder
    from toolkit.model.load import load_processor

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        processor = load_processor(materialize_builtin(TINY_VL_MODEL, root / "models"), trust_remote_code=False,
                                   chat_template=None)
        rows = []
        for i in range(args.rows):
            write_video(root / "clips" / f"{i}.mp4", args.frames, fps=8, size=size, mark=i)  # type: ignore[arg-type]
            rows.append({"messages": [{"role": "user", "content": [{"type": "video"},
                                                                    {"type": "text", "text": "What happens?"}]},
                                      {"role": "assistant", "content": f"It gets brighter ({i})."}],
                         "videos": [f"clips/{i}.mp4"]})
        settings = VideoSettings(min_pixels=112 * 112, max_pixels=112 * 112)
        encoder = VLEncoder(processor, train_on="assistant", video=settings, frame_store=root / "frames")
        timings = {}
        for name in ("cold", "warm"):
            before = frame_store.DECODES["files"]
            start = time.perf_counter()
            for k in range(0, len(rows), 100):
                encoder.encode(rows[k:k + 100], list(range(k, min(k + 100, len(rows)))), lambda n: f"row {n}", root)
            timings[name] = {"seconds": time.perf_counter() - start,
                             "decoder_calls": frame_store.DECODES["files"] - before}
        start = time.perf_counter()
        for i in range(len(rows)):
            for _ in range(2):  # dataset preparation, then the collator
                llamafactory_decode(root / "clips" / f"{i}.mp4")
        timings["llamafactory"] = {"seconds": time.perf_counter() - start, "decoder_calls": 2 * len(rows)}
    for t in timings.values():
        t["rows_per_s"] = round(args.rows / t["seconds"], 1)
        t["seconds"] = round(t["seconds"], 2)
    lf = timings["llamafactory"]["rows_per_s"]
    summary = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "host": socket.gethostname(),
               "cpu": platform.processor() or platform.machine(), "rows": args.rows, "frames": args.frames,
               "size": args.size,
               **timings, "cold_vs_llamafactory": round(timings["cold"]["rows_per_s"] / lf, 2),
               "warm_vs_llamafactory": round(timings["warm"]["rows_per_s"] / lf, 2)}
    print(json.dumps(summary, indent=2))
    out = REPO / "bench" / "results" / f"{summary['date'][:10]}-{summary['host']}-video-decode-{args.size}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
