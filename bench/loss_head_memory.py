"""Peak memory of one training step, standard loss head against the chunked one, as sequence length grows.

    python bench/loss_head_memory.py [--quick] [--seq-lens 1024 4096 16384] [--max-gb 8] [--out bench/results]

Why: with Qwen's 151,936-token vocabulary the standard head's logits, their fp32 softmax and gradient dominate a
long-sequence step (issue 13). The model is a tiny random Qwen3 with the *real* vocabulary (hidden 64, 2 layers,
LoRA r8 all-linear, fp32 on CPU), so the head is nearly all there is: micro batch 1, every token carries loss.

Each (head, length) is measured in its own fresh process (a process's peak RSS is a high-water mark that never
goes down): the model is built, one warm-up step runs on 16 tokens (allocator and autograd caches), then the
process's RSS is read (`baseline`), one full step (forward, backward, AdamW) runs at the measured length, and
`peak` is the peak RSS during that step (the kernel's VmHWM, reset just before it; `ru_maxrss` where it cannot
be reset). `step` = peak - baseline is the step's own working set, which is
what `toolkit.model.memory`'s activation estimate predicts for the same head; both are reported.

A measurement whose estimate exceeds --max-gb is not run (this is a shared machine) and is reported as not
measured, with its estimate. Prints a JSON summary (stdout) and a markdown table (stderr) for
docs/benchmarks.md, and writes `<out>/<YYYY-MM-DD>-<hostname>-loss-head[-quick].json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's toolkit, not an installed one
HEADS = ("standard", "chunked")
VOCAB = 151_936
GB = 1e9


def model_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32768,
                       tie_word_embeddings=False, use_cache=False, dtype="float32")


def estimate_step_bytes(head: str, seq_len: int) -> int:
    """toolkit.model.memory's activation estimate for this model and head (fp32 activations, no checkpointing)."""
    from toolkit.model.memory import activation_memory

    return activation_memory(model_config(), tokens=seq_len, grad_ckpt=False, activation_bytes=4, loss_head=head)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's record of this process's peak RSS (VmHWM), so the next `peak_rss_bytes` is the peak since
    now; False where that is not allowed. Without it the peak could be an earlier one: Linux carries ru_maxrss
    across exec, so a worker started from a large process (pytest late in the suite, 1.8 GB) reported its parent's
    peak (a CI run measured 1.79 GB for a 0.94 GB step), and building the model can peak above a short step."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(since_reset: bool) -> int:
    """Peak RSS: VmHWM after `reset_peak_rss`, else the process's lifetime peak (what the trainer records)."""
    if since_reset:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    import torch

    from toolkit.metrics.log import peak_memory_bytes

    return peak_memory_bytes(torch.device("cpu"))


def worker(head: str, seq_len: int, micro_batch: int = 1) -> dict[str, Any]:
    """One step of `micro_batch` rows of `seq_len` tokens in this process; returns its memory figures."""
    import torch
    from transformers import Qwen3ForCausalLM

    from toolkit.model.load import apply_lora
    from toolkit.model.loss_head import install_loss_head

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = apply_lora(Qwen3ForCausalLM(model_config()), r=8, alpha=16, dropout=0.0, target_modules="all-linear",
                       modules_to_save=[])
    installed = install_loss_head(model, head)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(tokens: int, rows: int = 1) -> float:
        ids = torch.randint(0, VOCAB, (rows, tokens))
        loss = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(float(rows * (tokens - 1)))).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    step(16)  # warm-up: Adam state, allocator and autograd caches exist before the baseline
    if installed is not None:
        installed.calls = 0
    baseline = rss_bytes()
    since_reset = reset_peak_rss()
    loss = step(seq_len, micro_batch)
    peak = peak_rss_bytes(since_reset)
    return {"status": "ok", "peak_gb": peak / GB, "baseline_gb": baseline / GB, "step_gb": (peak - baseline) / GB,
            "loss": loss, "chunked_calls": installed.calls if installed is not None else 0}


def measure(head: str, seq_len: int, max_gb: float) -> dict[str, Any]:
    estimate = estimate_step_bytes(head, seq_len) / GB
    result: dict[str, Any] = {"head": head, "seq_len": seq_len, "estimate_step_gb": estimate}
    if estimate > max_gb:
        return result | {"status": "not measured", "reason": f"estimated {estimate:.1f} GB > --max-gb {max_gb:g}"}
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run([sys.executable, __file__, "--worker", head, str(seq_len)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return result | {"status": "failed", "reason": proc.stderr[-2000:]}
    return result | json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| max_seq_len | head | peak RSS (GB) | step working set (GB) | estimate (GB) |", "|---|---|---|---|---|"]
    for r in rows:
        peak, step = (f"{r['peak_gb']:.2f}", f"{r['step_gb']:.2f}") if r["status"] == "ok" else (r["status"], "-")
        lines.append(f"| {r['seq_len']} | {r['head']} | {peak} | {step} | {r['estimate_step_gb']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="512 tokens only (CI: pipeline and estimate).")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--max-gb", type=float, default=8.0, help="Skip measurements estimated above this many GB.")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--worker", nargs="+", metavar="HEAD SEQ_LEN [MICRO_BATCH]", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], *map(int, args.worker[1:]))))
        return 0
    lengths = [512] if args.quick else args.seq_lens
    rows = [measure(head, n, args.max_gb) for n in lengths for head in HEADS]
    by = {(r["head"], r["seq_len"]): r for r in rows}
    ratios = {str(n): by["chunked", n]["peak_gb"] / by["standard", n]["peak_gb"] for n in lengths
              if by["chunked", n]["status"] == by["standard", n]["status"] == "ok"}
    summary = {"benchmark": "loss_head_memory", "date": datetime.date.today().isoformat(),
               "host": socket.gethostname(), "platform": platform.platform(), "vocab_size": VOCAB,
               "model": "Qwen3 hidden 64, 2 layers, LoRA r8 all-linear, fp32, micro batch 1, every token labelled",
               "rows": rows, "peak_ratio_chunked_to_standard": ratios,
               "target_4096_quarter": None if "4096" not in ratios else ratios["4096"] <= 0.25}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{summary['date']}-{summary['host']}-loss-head{'-quick' if args.quick else ''}.json"
    summary["results_file"] = str(path)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(markdown(rows), file=sys.stderr)
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
