"""GPU benchmark: the Qwen3-8B architecture (random weights), LoRA r16 on all linear layers, bf16, packed rows of
4096 tokens, flash-attention 2 when installed (else sdpa_packed), without and with gradient checkpointing, one GPU.

    python bench/gpu_qwen3_8b.py [--steps 20] [--warmup 5] [--out bench/results]
    python bench/gpu_qwen3_8b.py --tiny     # the same pipeline on the tiny Qwen3, anywhere (what the tests run)

--tiny runs the GPU run's settings (bf16 base, bf16 mixed precision, LoRA, packed rows through the attention
kernel `auto` picks, the default loss head, MFU against --peak-tflops) on the tiny Qwen3, so a first run on a GPU
only measures.

What is measured is the product itself: `train_curriculum.py` under `accelerate launch` (one process), reading
its own `metrics.jsonl`: non-pad tokens/s, MFU (toolkit/model/flops.py: 4N per token for LoRA plus causal attention,
over the GPU's dense bf16 peak), peak memory and step time, averaged over the steps after `--warmup`. The random
model is written to disk once (about 16 GB) so that the run loads it like any checkpoint. Writes
`<out>/<YYYY-MM-DD>-<hostname>-gpu8b[-tiny].json` and prints a JSON summary, then the markdown table rows for
docs/benchmarks.md on stderr. Target (issue 6): at least 45% MFU on an H100. `--variants no_grad_ckpt fused_lora`
measures `lora.fused: on` (toolkit/model/fused_lora.py) against PEFT's layers (issue 34, lever 3).
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
from throughput import machine_info, versions, worker_env, write_chat_data  # noqa: E402

MFU_TARGET = 0.45

# name: (gradient checkpointing, recipe `model` keys over the defaults). The first two are the issue's rows; the
# others change one thing against no_grad_ckpt, measured in the same invocation (before/after on one machine).
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "no_grad_ckpt": (False, {}),
    "grad_ckpt": (True, {}),
    "chunked_head": (False, {"loss_head": "chunked"}),  # the toolkit's own head where `auto` picked Liger (CUDA)
    "standard_head": (False, {"loss_head": "standard"}),  # transformers' full-vocabulary logits, then the loss
    "unfused": (False, {"fused_layers": "none"}),  # the model's own RMSNorm, RoPE, SwiGLU where auto fuses (CUDA)
    "fused_lora": (False, {}),  # lora.fused: on (LORA_KEYS), against no_grad_ckpt's PEFT layers
    "torch_varlen": (False, {"attn_implementation": "sdpa"}),  # torch's varlen kernel where auto took FA4 / flash-attn
}
LORA_KEYS: dict[str, dict[str, Any]] = {"fused_lora": {"fused": "on"}}
"""Recipe `lora` keys a variant sets over the benchmark's (r16 all-linear)."""


def write_model(out: Path, *, tiny: bool) -> Path:
    """The benchmark model directory: random Qwen3-8B weights (bf16, built on the GPU) or the tiny Qwen3, each with
    the toolkit's local tokenizer with the ChatML template the recorded results were measured with (token ids only
    need to be inside the vocabulary)."""
    from toolkit.builtin.text_model import build_tokenizer, write_tiny_qwen3
    from toolkit.templates import CHATML_TEMPLATE

    if tiny:
        return write_tiny_qwen3(out, tokenizer=build_tokenizer(CHATML_TEMPLATE))
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.model.memory import load_model_config

    config = load_model_config("qwen3-8b")
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    build_tokenizer(CHATML_TEMPLATE).save_pretrained(out)
    return out


def recipe(model_dir: Path, data: Path, out: Path, *, max_seq_len: int, steps: int, checkpointing: bool,
           peak_tflops: float | None = None, model: dict[str, Any] | None = None,
           lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stage of `steps` optimizer steps over packed rows; no checkpoints (they would write the 16 GB base).
    `model` and `lora` hold recipe keys of those sections over the defaults (a variant's one change)."""
    return {
        "output_dir": str(out),
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16",
                  "attn_implementation": "auto", "gradient_checkpointing": checkpointing, **(model or {})},
        "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear", **(lora or {})},
        "data": {"max_seq_len": max_seq_len, "packing": True, "cache_dir": str(out.parent / "cache")},
        "stages": [{"name": "bench", "data": [str(data)], "max_steps": steps, "lr": 1e-4}],
        "train": {"micro_batch_size": 1, "grad_accum": 1, "seed": 0},
        "checkpoint": {"save_on_stage_end": False, "best_metric": None},
        "logging": {"logging_steps": 1, "progress_bar": False, "trackers": [], "peak_tflops": peak_tflops},
    }


def logged(log: str, label: str) -> str | None:
    """The first word after `<label>: ` in a run's log (the kernels train_curriculum.py says it chose)."""
    return next((line.split(f" {label}: ")[1].split(" ")[0] for line in log.splitlines() if f" {label}: " in line),
                None)


def run_variant(name: str, model_dir: Path, data: Path, work: Path, *, args: argparse.Namespace,
                profile: bool = False) -> dict[str, Any]:
    """Train one variant through train_curriculum.py and summarise its metrics after the warmup steps. With
    `profile`, two more steps run under torch.profiler (bench/profile_step.py) and are not timed."""
    checkpointing, model = VARIANTS[name]
    out = work / name
    path = work / f"{name}.yaml"
    extra = 2 if profile else 0
    path.write_text(yaml.safe_dump(recipe(model_dir, data, out, max_seq_len=args.max_seq_len,
                                          peak_tflops=args.peak_tflops, steps=args.warmup + args.steps + extra,
                                          checkpointing=checkpointing, model=model, lora=LORA_KEYS.get(name))))
    script = REPO / ("bench/profile_step.py" if profile else "train_curriculum.py")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "single.yaml"), "--num_processes", "1",
           "--mixed_precision", "bf16", str(script), "--config", str(path)]
    env = worker_env(threads=1 if args.tiny else 8)
    profile_file = args.out / f"{name}-profile.json"
    if profile:
        env |= {"PROFILE_STEP": str(args.warmup + args.steps + 1), "PROFILE_OUT": str(profile_file),
                "PROFILE_VOCAB": str(args.vocab), "PROFILE_OVERLAP": "0" if args.no_overlap else "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    if proc.returncode != 0:
        return {"status": "failed", "returncode": proc.returncode, "log_tail": proc.stderr[-3000:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if "loss" in r and args.warmup < r["step"] <= args.warmup + args.steps]
    attention, loss_head, fused = (logged(proc.stderr, label) for label in ("attention", "loss head",
                                                                             "fused layers"))
    mfu = [r["mfu"] for r in timed if r["mfu"] is not None]
    return {
        "status": "ok", "gradient_checkpointing": checkpointing, "model_keys": model, "lora_keys": LORA_KEYS.get(name),
        "fused_lora": next((line.split("fused LoRA: ")[1] for line in proc.stderr.splitlines()
                            if "fused LoRA: " in line), None),
        "attention": attention, "loss_head": loss_head, "fused_layers": fused,
        "timed_steps": len(timed),
        "tokens_per_sec": sum(r["tokens_per_sec"] for r in timed) / len(timed),
        "mean_step_time_s": sum(r["step_time"] for r in timed) / len(timed),
        "mfu": sum(mfu) / len(mfu) if mfu else None,
        "peak_memory_gb": max(r["peak_memory_gb"] for r in timed),
        "padding_fraction": sum(r["padding_fraction"] for r in timed) / len(timed),
        "final_loss": timed[-1]["loss"],
        "copy_overlap": not (profile and args.no_overlap),
        "profile": json.loads(profile_file.read_text()) if profile and profile_file.is_file() else None,
    }


def markdown_rows(summary: dict[str, Any]) -> str:
    """Rows for the table in docs/benchmarks.md."""
    gpu, date = summary["machine"]["gpu"] or "CPU", summary["date"]
    rows = []
    for result in summary["variants"].values():
        if result["status"] != "ok":
            continue
        mfu = "n/a" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
        fused_lora = (result.get("lora_keys") or {}).get("fused") == "on"
        fused = result["fused_layers"] + (", fused LoRA" if fused_lora else "")
        rows.append(f"| {date} | {gpu} | {result['attention']} | {fused} | {result['loss_head']} | "
                    f"{'on' if result['gradient_checkpointing'] else 'off'} | {result['tokens_per_sec']:.0f} | "
                    f"{mfu} | {result['peak_memory_gb']:.1f} GiB |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3 and short rows: checks the pipeline anywhere")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (compilation, allocator)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="packed row length (default 4096; tiny 256)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON result")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["no_grad_ckpt", "grad_ckpt"],
                        help="what to run, in order (default: without and with gradient checkpointing)")
    parser.add_argument("--profile", action="store_true",
                        help="profile two more steps of the first variant (bench/profile_step.py), untimed")
    parser.add_argument("--no-overlap", action="store_true",
                        help="with --profile: the profiled variant copies its micro-batches in turn, blocking, before "
                        "each forward (PROFILE_OVERLAP=0), its timed steps too: run with and without to compare the "
                        "idle share")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak for MFU (default: looked up from the GPU's name)")
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
    """Both variants, the summary, and the results file; None when there is no GPU to run on."""
    args.max_seq_len = args.max_seq_len or (256 if args.tiny else 4096)
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA GPU: this benchmark needs one (use --tiny to check the pipeline on CPU).",
                  file=sys.stderr)
            return None

    work = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    try:
        model_dir = write_model(work / "model", tiny=args.tiny)
        from transformers import AutoTokenizer

        data = work / "data.jsonl"
        # Enough rows for every step to get full packed rows (about 6 rows per 4096-token row at this mix).
        rows = 12 * (args.warmup + args.steps) + 64
        write_chat_data(data, AutoTokenizer.from_pretrained(model_dir), rows, args.max_seq_len, seed=0)
        from transformers import AutoConfig

        args.vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        args.out.mkdir(parents=True, exist_ok=True)
        variants = {}
        for i, name in enumerate(args.variants):
            variants[name] = run_variant(name, model_dir, data, work, args=args, profile=args.profile and i == 0)
            print(f"variant {name}: {json.dumps(variants[name])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    best = max((v["mfu"] for v in variants.values() if v.get("mfu") is not None), default=None)
    summary = {
        "benchmark": "gpu_qwen3_8b" + ("-tiny" if args.tiny else ""), "date": datetime.date.today().isoformat(),
        "machine": machine_info(), "versions": versions(),
        "settings": {"model": "tiny-qwen3" if args.tiny else "Qwen3-8B architecture, random weights",
                     "lora": "r16 all-linear", "max_seq_len": args.max_seq_len, "packing": True,
                     "micro_batch_size": 1, "warmup": args.warmup, "steps": args.steps,
                     "variants": {name: VARIANTS[name] for name in args.variants}},
        "variants": variants,
        "target": {"mfu": MFU_TARGET, "best_mfu": best,
                   "met": None if best is None or args.tiny else best >= MFU_TARGET},
    }
    name = f"{summary['date']}-{socket.gethostname()}-gpu8b{'-tiny' if args.tiny else ''}.json"
    summary["results_file"] = str(args.out / name)
    (args.out / name).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(main())
