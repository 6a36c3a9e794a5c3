"""GPU benchmark (issue 50): the Qwen2.5-VL-7B architecture (random weights), LoRA r16 on the language model's
linear layers (the vision tower frozen, no adapters there), bf16, gradient checkpointing, one GPU, on video rows:
tokens/s, video tokens per row, step time and peak memory, one row per frame cap.

    python bench/gpu_qwen2_5_vl.py [--steps 5] [--warmup 2] [--out bench/results] [--variants frames8 frames32]
    python bench/gpu_qwen2_5_vl.py --tiny   # the same pipeline on the tiny Qwen2.5-VL, anywhere (what the test runs)
    BENCH=vl bash bench/run_gpu_session.sh  # a lent GPU: every row, recorded in bench/results/

The data: `--rows` rows in TRL's vision shape (a `{"type": "video"}` part and `videos`), each its own MPEG-4 file
(tests/helpers/video_files.py: PyAV, flat grey frames with a mark that makes every file distinct, so the frame store
dedups nothing) of `--seconds` seconds at 4 fps, `--size` pixels (default 448x336: 192 video tokens per pair of
frames, Qwen2.5-VL merging two frames in time and 2x2 patches of 14 px in space). Frames are sampled at 2 fps by
qwen-vl-utils' rules (`data.video`), capped per row (`ROWS`): `frames8` (`video.max_frames: 8`, a curriculum's short
stage) and `frames32` (32, its long stage); both decode each file once into the frame store before step 1. Each row
is its own launch of `train_curriculum.py` under `accelerate launch` (one process, bf16 mixed precision), micro
batch 1 x 2 accumulation steps (no packing), `--max-seq-len` 4096.

Per row, from its own `metrics.jsonl` averaged over the steps after `--warmup`: tokens/s (non-pad tokens, video
tokens included), step time, peak memory (`torch.cuda.max_memory_allocated` on a GPU), tokens per row, the final
loss; and the video tokens per row that the toolkit's encoder (`toolkit.data.vision.VLEncoder`) gives the same rows
under the row's settings, counted in the token ids. The random model is written once (about 16 GB, on the GPU)
with the toolkit's small tokenizer and Qwen's vision tokens (their ids set in the config), so each row loads it like
any checkpoint. Writes `<out>/<YYYY-MM-DD>-<hostname>-gpuvl[-tiny].json` and `.md` (the table), prints the JSON
summary on stdout and the table on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from throughput import machine_info, versions, worker_env  # noqa: E402

ROWS_PER_STEP = 2  # rows per optimizer step: micro batch 1 x 2 accumulation steps
VIDEO_FPS = 4  # the files' frame rate
SAMPLE_FPS = 2  # frames sampled per second of video (Qwen's default)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: the row's video.max_frames (its stage's frame cap)
ROWS: dict[str, int] = {"frames8": 8, "frames32": 32}


def write_model(out: Path, *, tiny: bool, max_pixels: int) -> Path:
    """The benchmark model directory: random Qwen2.5-VL-7B weights (bf16, built on the GPU) with the toolkit's VL
    processor (small tokenizer plus Qwen's vision tokens, Qwen2.5-VL's stock template, 14 px patches; token ids
    only need to be inside the vocabulary), or the built-in tiny Qwen2.5-VL."""
    from toolkit.builtin.vl_model import build_vl_processor, write_tiny_qwen2_5_vl
    from toolkit.templates import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, stock_template

    if tiny:
        return write_tiny_qwen2_5_vl(out)
    import torch
    from transformers import AutoModelForImageTextToText

    from toolkit.model.memory import load_model_config

    processor = build_vl_processor(stock_template("qwen2.5-vl"), min_pixels=4 * 28 * 28, max_pixels=max_pixels)
    tok = processor.tokenizer
    config = load_model_config("qwen2.5-vl-7b")
    for key, token in (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
                       ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END)):
        setattr(config, key, tok.convert_tokens_to_ids(token))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    processor.save_pretrained(out)
    return out


def write_rows(folder: Path, rows: int, *, seconds: int, size: tuple[int, int]) -> Path:
    """`rows` video rows (TRL's vision shape: a `{"type": "video"}` part and `videos`), each with its own file;
    returns the JSONL."""
    from tests.helpers.video_files import write_video

    lines = []
    for i in range(rows):
        write_video(folder / "clips" / f"{i}.mp4", seconds * VIDEO_FPS, fps=VIDEO_FPS, size=size, mark=i)
        lines.append(json.dumps({"messages": [{"role": "user", "content": [
                                                  {"type": "video"}, {"type": "text", "text": "What happens?"}]},
                                              {"role": "assistant", "content": f"It gets brighter, clip {i}."}],
                                 "videos": [f"clips/{i}.mp4"]}))
    path = folder / "video.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def video_settings(args: argparse.Namespace, max_frames: int) -> dict[str, Any]:
    return {"fps": SAMPLE_FPS, "max_frames": max_frames, "min_pixels": 4 * 28 * 28, "max_pixels": args.max_pixels}


def video_tokens_per_row(model_dir: Path, data: Path, settings: dict[str, Any], store: Path) -> float:
    """The mean number of video tokens the toolkit's encoder gives each row under `settings`."""
    from toolkit.data.frames import VideoSettings
    from toolkit.data.vision import VLEncoder
    from toolkit.model.load import load_processor

    processor = load_processor(str(model_dir), trust_remote_code=False, chat_template=None)
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    encoder = VLEncoder(processor, train_on="assistant", video=VideoSettings(**settings), frame_store=store)
    batch = encoder.encode(rows, list(range(len(rows))), lambda n: f"row {n}", data.parent)
    return float((batch.ids == processor.video_token_id).sum()) / len(rows)


def recipe(model_dir: Path, data: Path, out: Path, *, args: argparse.Namespace, steps: int,
           max_frames: int) -> dict[str, Any]:
    """One stage of `steps` optimizer steps over the video rows, `ROWS_PER_STEP` rows a step, the row's frame cap;
    no checkpoints (they would write the 16 GB base)."""
    return {
        "output_dir": str(out),
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16", "attn_implementation": "auto",
                  "gradient_checkpointing": True},
        "lora": {"r": 16, "alpha": 32, "target_modules": LORA_TARGETS, "exclude_modules": ".*visual.*"},
        "data": {"max_seq_len": args.max_seq_len, "cache_dir": str(out.parent / "cache"), "train_on": "assistant",
                 "video": video_settings(args, max_frames)},
        "stages": [{"name": "bench", "data": [str(data)], "max_steps": steps, "lr": 1e-4}],
        "train": {"micro_batch_size": 1, "grad_accum": ROWS_PER_STEP, "seed": 0},
        "checkpoint": {"save_on_stage_end": False, "best_metric": None},
        "logging": {"logging_steps": 1, "progress_bar": False, "trackers": []},
    }


def run_variant(name: str, model_dir: Path, data: Path, work: Path, *, args: argparse.Namespace) -> dict[str, Any]:
    """Train one row through train_curriculum.py and summarise its metrics after the warmup steps."""
    max_frames = ROWS[name]
    out = work / name
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe(model_dir, data, out, args=args, steps=args.warmup + args.steps,
                                          max_frames=max_frames)))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "single.yaml"), "--num_processes", "1",
           "--mixed_precision", "bf16", str(REPO / "train_curriculum.py"), "--config", str(path)]
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(threads=1 if args.tiny else 8), capture_output=True,
                          text=True, timeout=3000)
    if proc.returncode != 0:
        return {"status": "failed", "returncode": proc.returncode, "log_tail": proc.stderr[-3000:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r]
    timed = [r for r in steps if args.warmup < r["step"] <= args.warmup + args.steps]
    before = next((r["tokens"] for r in steps if r["step"] == args.warmup), 0)
    return {
        "status": "ok", "max_frames": max_frames, "timed_steps": len(timed),
        "attention": next((line.split(" attention: ")[1].split(" ")[0] for line in proc.stderr.splitlines()
                           if " attention: " in line), None),
        "tokens_per_sec": sum(r["tokens_per_sec"] for r in timed) / len(timed),
        "mean_step_time_s": sum(r["step_time"] for r in timed) / len(timed),
        "tokens_per_row": (timed[-1]["tokens"] - before) / (ROWS_PER_STEP * len(timed)),
        "video_tokens_per_row": video_tokens_per_row(model_dir, data, video_settings(args, max_frames),
                                                     work / f"{name}-frames"),
        "peak_memory_gb": max(r["peak_memory_gb"] for r in timed),
        "final_loss": timed[-1]["loss"],
    }


def markdown_rows(summary: dict[str, Any]) -> str:
    """The table for docs/benchmarks.md: one line per row, failed rows with their exit code."""
    gpu, date = summary["machine"]["gpu"] or "CPU", summary["date"]
    lines = ["| date | device | row | frame cap | attention | video tokens/row | tokens/row | tokens/s | step time | "
             "peak memory | final loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        if r["status"] != "ok":
            lines.append(f"| {date} | {gpu} | {name} | failed (exit {r.get('returncode')}) ||||||||")
            continue
        lines.append(f"| {date} | {gpu} | {name} | {r['max_frames']} | {r['attention']} | "
                     f"{r['video_tokens_per_row']:.0f} | {r['tokens_per_row']:.0f} | {r['tokens_per_sec']:.0f} | "
                     f"{r['mean_step_time_s']:.2f} s | {r['peak_memory_gb']:.1f} GiB | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2.5-VL, small videos: checks the pipeline")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing")
    parser.add_argument("--rows", type=int, default=None, help="video rows (default: enough for every step)")
    parser.add_argument("--seconds", type=int, default=16, help="each video's length (16 s at 2 fps: 32 frames)")
    parser.add_argument("--size", default=None, help="WIDTHxHEIGHT of the videos (default 448x336; tiny 56x42)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help="video.max_pixels per frame (default 448 x 336; tiny 56 x 56)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="default 4096; tiny 1024")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON result")
    parser.add_argument("--variants", nargs="+", choices=list(ROWS), default=list(ROWS), help="rows, in order")
    args = parser.parse_args(argv)
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # libraries print to stdout; it must carry only the JSON
        summary = benchmark(args)
    if summary is None:
        return 2
    print(json.dumps(summary, indent=2), file=stdout, flush=True)
    print(markdown_rows(summary), file=sys.stderr)
    return 0 if all(v["status"] == "ok" for v in summary["variants"].values()) else 1


def benchmark(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every row, the summary, and the results file; None when there is no GPU to run on."""
    args.size = args.size or ("56x42" if args.tiny else "448x336")
    args.max_pixels = args.max_pixels or (56 * 56 if args.tiny else 448 * 336)
    args.max_seq_len = args.max_seq_len or (1024 if args.tiny else 4096)
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA GPU: this benchmark needs one (use --tiny to check the pipeline on CPU).",
                  file=sys.stderr)
            return None
    size = tuple(int(n) for n in args.size.split("x"))
    work = Path(tempfile.mkdtemp(prefix="gpu-vl-bench-"))
    try:
        model_dir = write_model(work / "model", tiny=args.tiny, max_pixels=args.max_pixels)
        rows = args.rows or ROWS_PER_STEP * (args.warmup + args.steps) + 4
        data = write_rows(work / "data", rows, seconds=args.seconds, size=size)  # type: ignore[arg-type]
        args.out.mkdir(parents=True, exist_ok=True)
        variants = {}
        for name in args.variants:
            variants[name] = run_variant(name, model_dir, data, work, args=args)
            print(f"variant {name}: {json.dumps(variants[name])}", file=sys.stderr, flush=True)
            (args.out / "rows-so-far-vl.json").write_text(json.dumps(variants, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        "benchmark": "gpu_qwen2_5_vl" + ("-tiny" if args.tiny else ""), "date": datetime.date.today().isoformat(),
        "machine": machine_info(), "versions": versions(),
        "settings": {"model": "tiny-qwen2.5-vl" if args.tiny else "Qwen2.5-VL-7B architecture, random weights",
                     "lora": "r16 on the language model's linear layers", "gradient_checkpointing": True,
                     "rows": rows, "video_seconds": args.seconds, "video_fps": VIDEO_FPS, "size": args.size,
                     "sample_fps": SAMPLE_FPS, "max_pixels": args.max_pixels, "max_seq_len": args.max_seq_len,
                     "rows_per_step": ROWS_PER_STEP, "warmup": args.warmup, "steps": args.steps,
                     "variants": {name: {"video.max_frames": ROWS[name]} for name in args.variants}},
        "variants": variants,
    }
    name = f"{summary['date']}-{socket.gethostname()}-gpuvl{'-tiny' if args.tiny else ''}.json"
    summary["results_file"] = str(args.out / name)
    (args.out / name).write_text(json.dumps(summary, indent=2))
    (args.out / name).with_suffix(".md").write_text(markdown_rows(summary) + "\n")
    (args.out / "rows-so-far-vl.json").unlink(missing_ok=True)
    return summary


if __name__ == "__main__":
    sys.exit(main())
