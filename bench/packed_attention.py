"""Attention time and peak memory of one packed row on CPU: transformers' stock sdpa (a T x T mask) against the
toolkit's sdpa_packed (sdpa per sample span, toolkit/model/attention.py), in the same run.

    python bench/packed_attention.py                    # 2048 8192 32768 tokens; writes bench/results/...json
    python bench/packed_attention.py --tokens 2048 --repeats 1   # quick

One Qwen3 attention layer (hidden 512, 8 query heads, 2 key/value heads, head_dim 64: the flagship's 4:1 GQA),
forward and backward on a packed row of T tokens made of chat-like samples (lengths 64-1024, about 450 on
average), the mask built as the model builds it (`create_causal_mask` from restarting position_ids) and the
boundaries handed over as the packing collator does. Each (kernel, T) runs in a fresh process: time is the median
of --repeats steps after a warm-up step; peak memory is the process's peak RSS during the measured steps minus its
RSS before them. The table for docs/benchmarks.md goes to stderr, a JSON summary to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KERNELS = ("sdpa", "sdpa_packed")  # before, after


def sample_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Chat-like sample lengths filling `tokens` exactly (the last one takes the rest)."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < tokens:
        lengths.append(min(int(rng.lognormvariate(5.9, 0.6)) + 64, 1024, tokens - sum(lengths)))
    return lengths


def worker(kernel: str, tokens: int, repeats: int) -> dict[str, Any]:
    import psutil
    import torch
    from transformers import Qwen3Config
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    import toolkit.model.attention  # noqa: F401  (registers sdpa_packed)
    from toolkit.data.packing import flash_boundaries

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         intermediate_size=1024, num_hidden_layers=1, max_position_embeddings=tokens,
                         use_cache=False)
    config._attn_implementation = kernel
    layer, rotary = Qwen3Attention(config, 0), Qwen3RotaryEmbedding(config)

    def step(n: int) -> None:
        lengths = sample_lengths(n)
        pos = torch.cat([torch.arange(length) for length in lengths])[None]
        hidden = torch.randn(1, n, config.hidden_size, requires_grad=True)
        mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=pos)
        out, _ = layer(hidden, rotary(hidden, pos), mask, position_ids=pos, **flash_boundaries(pos))
        out.sum().backward()

    step(min(tokens, 1024))  # warm-up: kernels and allocator
    before = psutil.Process().memory_info().rss
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(tokens)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kernel": kernel, "tokens": tokens, "samples": len(sample_lengths(tokens)),
            "time_s": statistics.median(times), "peak_gb": max(peak - before, 0) / 1024**3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--worker", nargs=2, metavar=("KERNEL", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.repeats)))
        return 0
    rows = []
    for tokens in args.tokens:
        for kernel in KERNELS:
            proc = subprocess.run([sys.executable, __file__, "--worker", kernel, str(tokens), "--repeats",
                                   str(args.repeats)], cwd=REPO, capture_output=True, text=True, timeout=3600,
                                  env={**__import__("os").environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)})
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    by = {(r["tokens"], r["kernel"]): r for r in rows}
    table = ["| tokens | samples | stock sdpa: time | sdpa_packed: time | time ratio | stock sdpa: peak | "
             "sdpa_packed: peak | peak ratio |", "|---|---|---|---|---|---|---|---|"]
    for tokens in args.tokens:
        old, new = by[(tokens, "sdpa")], by[(tokens, "sdpa_packed")]
        table.append(f"| {tokens:,} | {new['samples']} | {old['time_s']:.2f} s | {new['time_s']:.3f} s | "
                     f"{new['time_s'] / old['time_s']:.3f} | {old['peak_gb']:.2f} GB | {new['peak_gb']:.3f} GB | "
                     f"{new['peak_gb'] / max(old['peak_gb'], 1e-9):.3f} |")
    summary = {"benchmark": "packed_attention", "date": datetime.date.today().isoformat(), "rows": rows,
               "repeats": args.repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{summary['date']}-{socket.gethostname()}-packed-attention.json"
    path.write_text(json.dumps(summary, indent=2))
    summary["results_file"] = str(path)
    print(json.dumps(summary, indent=2))
    print("\n".join(table), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
