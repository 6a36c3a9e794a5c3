"""Scoring throughput against training throughput on the same rows (issue 40): what the scoring pass costs.

    python bench/scoring.py [--rows 64] [--seq-len 256] [--micro-batch 8] [--out bench/results]

The model is a small random Qwen3 with the *real* vocabulary (151,936 tokens, hidden 128, 4 layers, fp32 on
CPU), so the loss head weighs as it does for Qwen3. The rows are random tokens, the second half of each labelled
(a response). Both sides run the same packed micro-batches (`sdpa_packed`, the chunked loss head):

- **scoring**: `toolkit.evals.scoring.row_sums` over every row (no grad, per-row float64 sums), rows/s and tokens/s;
- **training**: one optimizer step per micro-batch (forward, backward, AdamW over every parameter), tokens/s.

Each side runs once to warm up, then is timed. Prints a JSON summary (stdout) and the table row for
docs/benchmarks.md (stderr), and writes `<out>/<YYYY-MM-DD>-<hostname>-scoring.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's toolkit, not an installed one


def build(seq_len: int) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from toolkit.model.attention import SDPA_PACKED, register_kernels
    from toolkit.model.loss_head import install_loss_head

    register_kernels()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=151_936, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=max(seq_len, 512), use_cache=False, dtype="float32",
                         attn_implementation=SDPA_PACKED)
    model = Qwen3ForCausalLM(config).float()
    install_loss_head(model, "chunked")
    return model


def rows(n: int, seq_len: int) -> list[dict[str, list[int]]]:
    import random

    from toolkit.data.encoding import IGNORE_INDEX

    rng = random.Random(0)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 151_000) for _ in range(seq_len)]
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (seq_len // 2) + ids[seq_len // 2:]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)

    import torch

    from toolkit.data.packing import PackedCollator
    from toolkit.evals.scoring import row_sums
    from toolkit.runtime import process as distributed

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model = build(args.seq_len)
    data = rows(args.rows, args.seq_len)
    collate = PackedCollator()
    accelerator = distributed.build_accelerator(1, 10)
    tokens = args.rows * args.seq_len

    row_sums(accelerator, model, data[:args.micro_batch], collate, args.micro_batch)  # warm-up
    start = time.perf_counter()
    sums = row_sums(accelerator, model, data, collate, args.micro_batch)
    scoring_s = time.perf_counter() - start
    assert (sums.tokens == args.seq_len - args.seq_len // 2).all()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batches = [collate(data[i:i + args.micro_batch]) for i in range(0, len(data), args.micro_batch)]
    model.train()

    def step(batch: dict[str, Any]) -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(batches[0])  # warm-up
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    training_s = time.perf_counter() - start

    result = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "host": socket.gethostname(),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__, "rows": args.rows, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "scoring_rows_per_s": args.rows / scoring_s, "scoring_tokens_per_s": tokens / scoring_s,
        "training_tokens_per_s": tokens / training_s, "scoring_over_training": training_s / scoring_s,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{result['date']}-{result['host']}-scoring.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(f"| {result['date']} | {result['machine']} | {args.rows} x {args.seq_len} | "
          f"{result['scoring_rows_per_s']:.1f} | {result['scoring_tokens_per_s']:.0f} | "
          f"{result['training_tokens_per_s']:.0f} | {result['scoring_over_training']:.1f}x |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
