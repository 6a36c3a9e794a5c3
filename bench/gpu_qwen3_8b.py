"""GPU benchmark: the Qwen3-8B architecture (random weights), LoRA r16 on all linear layers, bf16, packed rows of
4096 tokens, one GPU; the default and each speed lever of issue 34 on and off, side by side in one invocation.

    python bench/gpu_qwen3_8b.py [--steps 20] [--warmup 5] [--out bench/results] [--profile]
    python bench/gpu_qwen3_8b.py --tiny     # the same pipeline on the tiny Qwen3, anywhere (what the tests run)
    bash bench/run_gpu_session.sh           # a lent GPU: every row, profiled, recorded in bench/results/
    BENCH=grpo bash bench/run_gpu_session.sh  # a lent GPU: the grpo row (issue 49), one command of its own

Rows (`ROWS`; `--variants` picks, in order): `default` (the toolkit's defaults), `no_overlap` (the default with the
micro-batch copies in turn, not on the side stream: its loss checks the stream's event wait), `compile`
(`train.compile`),
`lora_fused_on` / `lora_fused_off` (`lora.fused`, skipped with a note where the schema has no such key),
`micro2` (micro batch 2 x 4096 instead of 1 x 4096 with 2 accumulation steps: the same rows per optimizer step),
`grad_ckpt` (the checkpointed row), `fa4` (`model.attn_implementation: flash4`, skipped where flash-attn-4 is not
installed), `torch_varlen` (torch's varlen kernel, `sdpa`, where `auto` took FA4 or flash-attn), and the older
one-change rows `chunked_head`, `standard_head`, `unfused`. Every row trains the
same data with the same global batch (2 rows of 4096 tokens per optimizer step), so the final losses must agree
within bf16 noise (`LOSS_RTOL`); the summary says whether they do.

--tiny runs the GPU run's settings (bf16 base, bf16 mixed precision, LoRA, packed rows through the attention
kernel `auto` picks, the default loss head, MFU against --peak-tflops) on the tiny Qwen3, so a first run on a GPU
only measures.

What is measured is the product itself: `train_curriculum.py` under `accelerate launch` (one process), reading
its own `metrics.jsonl`, averaged over the steps after `--warmup`: non-pad tokens/s; MFU by our count
(toolkit/model/flops.py: 4N per token for LoRA, the LM head for the label tokens, causal attention per packed
sample) and by NeMo AutoModel's (`nemo_automodel_flops_per_token`: 6N for every token, attention over the whole
row), both over the GPU's dense bf16 peak; peak memory; step time; the final loss; with `--profile`, two more
steps per row under torch.profiler (bench/profile_step.py, untimed) give the GPU's idle share. The random model is
written to disk once (about 16 GB) so that each row loads it like any checkpoint. Writes
`<out>/<YYYY-MM-DD>-<hostname>-gpu8b[-tiny].json` and `.md` (the table) and prints a JSON summary, then the
markdown table on stderr. Target (issue 34): at least 45% MFU on an H100. `--profile --no-overlap` copies each
micro-batch in turn before its forward (lever 1 off) in every profiled row: run with and without to compare the
idle share. `--variants grad_ckpt long16k long32k` measures the long rows of issue 33 (packed rows of 4k, 16k and
32k tokens on one GPU, checkpointed), each beside preflight's estimate of its peak.

`--variants grpo` (issue 49) runs a GRPO stage instead (`objective: grpo` on prompt-only rows, `dummy:letters`'
shape, with the `contains` reward against each row's reference: a verifiable reward that costs next to nothing):
each step draws `GRPO_GENERATIONS` completions of `GRPO_PROMPTS` prompts, up to `--completion-length` tokens
(default 256; tiny 16), with the KV cache, then trains on their group advantages. Besides the step's tokens/s and
peak memory it reports, from the step log, the rollout's completion tokens/s (`completions/mean_length` x
completions / `time/generation`), the seconds of generation, of scoring and of the rest of the step (training).
Random weights rarely end a completion early, so the rollout runs to full length, and the rewards (near zero) say
nothing: the row measures speed only, and is not in the losses check.
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
LOSS_RTOL = 5e-3  # bf16 noise: a final loss within 0.5% of the default row's (bf16 carries about 2.4 digits)
ROWS_PER_STEP = 2  # packed rows per optimizer step in every row: micro 1 x 2 accumulation, or micro 2 x 1
GRPO_PROMPTS = 4  # the grpo row's prompts per optimizer step ...
GRPO_GENERATIONS = 8  # ... each sampled this many times (TRL's default): 32 completions a step, micro 8 x accum 4


def _schema_has(section: str, key: str, value: str | None = None) -> bool:
    """Whether the recipe schema has `section.key` (and, for a Literal, accepts `value`)."""
    from typing import get_args

    from toolkit.config.schema import Recipe

    model = Recipe.model_fields[section].annotation
    field = getattr(model, "model_fields", {}).get(key)
    if field is None:
        return False
    return value is None or value in get_args(field.annotation)


def _lora_fused_missing() -> str | None:
    return None if _schema_has("lora", "fused") else "lora.fused is not in this toolkit's recipe schema"


def _fa4_missing() -> str | None:
    import importlib.util

    if not _schema_has("model", "attn_implementation", "flash4"):
        return "the toolkit has no FlashAttention 4 kernel (model.attn_implementation has no flash4)"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "FlashAttention 4 (flash_attn.cute) is not installed"
    return None


# name: (recipe keys over the defaults, by section; a check that returns why the row cannot run here, or None).
ROWS: dict[str, tuple[dict[str, dict[str, Any]], Any]] = {
    "default": ({}, None),
    # The default with the micro-batch copies in turn (toolkit/train/loop.py OVERLAP_COPIES off, through
    # bench/profile_step.py): its loss must agree with the others', which copy on a side stream that the forward
    # waits for (an event): a forward that did not wait would read batches still being copied.
    "no_overlap": ({}, None),
    "compile": ({"train": {"compile": True}}, None),
    "lora_fused_on": ({"lora": {"fused": "on"}}, _lora_fused_missing),
    "lora_fused_off": ({"lora": {"fused": "off"}}, _lora_fused_missing),
    "micro2": ({"train": {"micro_batch_size": 2, "grad_accum": 1}}, None),
    "grad_ckpt": ({"model": {"gradient_checkpointing": True}}, None),
    "fa4": ({"model": {"attn_implementation": "flash4"}}, _fa4_missing),
    "torch_varlen": ({"model": {"attn_implementation": "sdpa"}}, None),  # torch's kernel where auto took FA4 / flash
    "chunked_head": ({"model": {"loss_head": "chunked"}}, None),  # the toolkit's own head where `auto` took Liger
    "standard_head": ({"model": {"loss_head": "standard"}}, None),  # full-vocabulary logits, then the loss
    "unfused": ({"model": {"fused_layers": "none"}}, None),  # the model's own RMSNorm, RoPE, SwiGLU
    # Long rows (issue 33), beside grad_ckpt's 4096: one GPU, checkpointed, packed rows of 16k and 32k tokens. Other
    # rows per step than the others (not in the losses check); each reports preflight's estimate of its peak.
    "long16k": ({"data": {"max_seq_len": 16384}, "model": {"gradient_checkpointing": True}}, None),
    "long32k": ({"data": {"max_seq_len": 32768}, "model": {"gradient_checkpointing": True}}, None),
    # Issue 49: a GRPO stage (rollout, scoring, training) on prompt rows; the `stage` keys go to the bench stage.
    # Not packed: a grpo stage trains its prompt + completion sequences as the rollout made them (docs/rl.md).
    "grpo": ({"stage": {"objective": "grpo", "rl": {"num_generations": GRPO_GENERATIONS},
                        "rewards": [{"scorer": {"kind": "contains", "lower": True}}]},
              "data": {"packing": False},
              "train": {"micro_batch_size": GRPO_GENERATIONS, "grad_accum": GRPO_PROMPTS}}, None),
}
LONG_ROWS = ["grad_ckpt", "long16k", "long32k"]
OVERLAP_OFF_ROWS = {"no_overlap"}
RL_ROWS = {"grpo"}
LEVER_ROWS = ["default", "no_overlap", "compile", "lora_fused_on", "lora_fused_off", "micro2", "grad_ckpt", "fa4",
              "torch_varlen"]


def nemo_automodel_flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token by NeMo AutoModel's count for Qwen2/Qwen3 (`qwen3_flops` in
    nemo_automodel/components/utils/flops_utils.py), for rows of `seq_len` tokens, written out from its terms:

        6 * L * h*(a*d) * (2 + 2k/a)     q, k, v, o projections: forward, and both gradients of every weight
      + 6 * L * s * (a*d)                causal attention over the whole row (QK^T and AV, halved)
      + 6 * L * 3*h*i                    SwiGLU MLP
      + 6 * h * V                        LM head, every token

    so 6N per token even for LoRA (frozen weights get no weight gradient: our count charges 4N), attention over
    the packed row's length rather than each sample's, and the head for every token. Formula only: their code
    is not imported or copied."""
    from toolkit.model.params import decoder_config

    c = decoder_config(config)
    layers, hidden, heads = int(c.num_hidden_layers), int(c.hidden_size), int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    q_width = heads * head_dim
    attention = 6 * layers * (hidden * q_width * (2 + 2 * kv / heads) + seq_len * q_width)
    mlp = 6 * layers * 3 * hidden * int(c.intermediate_size)
    return attention + mlp + 6 * hidden * int(c.vocab_size)


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


def recipe(model_dir: Path, data: Path, out: Path, *, max_seq_len: int, steps: int,
           peak_tflops: float | None = None, keys: dict[str, dict[str, Any]] | None = None,
           completion_length: int = 256) -> dict[str, Any]:
    """One stage of `steps` optimizer steps over packed rows, `ROWS_PER_STEP` rows a step; no checkpoints (they
    would write the 16 GB base). `keys` holds recipe keys over the defaults, by section (a row's one change); its
    `stage` keys go to the stage (a grpo row: `completion_length` is its `rl.max_completion_length`)."""
    keys = keys or {}
    stage = {"name": "bench", "data": [str(data)], "max_steps": steps, "lr": 1e-4, **keys.get("stage", {})}
    if "rl" in stage:
        stage["rl"] = {**stage["rl"], "max_completion_length": completion_length}
    return {
        "output_dir": str(out),
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16",
                  "attn_implementation": "auto", "gradient_checkpointing": False, **keys.get("model", {})},
        "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear", **keys.get("lora", {})},
        "data": {"max_seq_len": max_seq_len, "packing": True, "cache_dir": str(out.parent / "cache"),
                 **keys.get("data", {})},
        "stages": [stage],
        "train": {"micro_batch_size": 1, "grad_accum": ROWS_PER_STEP, "seed": 0, **keys.get("train", {})},
        "checkpoint": {"save_on_stage_end": False, "best_metric": None},
        "logging": {"logging_steps": 1, "progress_bar": False, "trackers": [], "peak_tflops": peak_tflops},
    }


def logged(log: str, label: str) -> str | None:
    """The first word after `<label>: ` in a run's log (the kernels train_curriculum.py says it chose)."""
    return next((line.split(f" {label}: ")[1].split(" ")[0] for line in log.splitlines() if f" {label}: " in line),
                None)


def row_length(keys: dict[str, dict[str, Any]], args: argparse.Namespace) -> int:
    """The packed row length a bench row trains (its own `data.max_seq_len`, else the bench's)."""
    return int(keys.get("data", {}).get("max_seq_len", args.max_seq_len))


def estimated_peak_gb(recipe_file: Path, config: Any) -> float:
    """What `toolkit preflight` estimates for this row's recipe on one GPU (strategy single, bf16 launch), in GiB:
    the row's measured peak is compared with it."""
    from toolkit.commands.preflight import activation_precision, fused_layers_counted, stage_estimates, weight_bytes
    from toolkit.config.load import load_recipe
    from toolkit.config.stages import resolve_stages

    recipe = load_recipe(recipe_file)
    rows = stage_estimates(recipe, config, resolve_stages(recipe), num_gpus=1,
                           param_bytes=weight_bytes(recipe, "bf16"),
                           fused_layers=fused_layers_counted(recipe, config) == "liger",
                           **activation_precision(recipe, "bf16"))
    return max(r["single"]["total"] for r in rows) / 2**30


def rollout_figures(timed: list[dict[str, Any]], completions: int) -> dict[str, Any]:
    """A grpo row's rollout figures from its timed step records: completion tokens per second of generation
    (`completions/mean_length` x the step's completions / `time/generation`), and the mean seconds of generation,
    of scoring, and of the rest of the step (the policy's forward and backward, the optimizer, the step's own
    overhead)."""
    def mean(key: str) -> float:
        return sum(r[key] for r in timed) / len(timed)

    generated = sum(r["completions/mean_length"] * completions for r in timed)
    return {"completions_per_step": completions, "mean_completion_length": mean("completions/mean_length"),
            "rollout_tokens_per_sec": generated / sum(r["time/generation"] for r in timed),
            "generation_s": mean("time/generation"), "scoring_s": mean("time/scoring"),
            "training_s": mean("step_time") - mean("time/generation") - mean("time/scoring"),
            "reward": mean("reward"), "clipped_ratio": mean("completions/clipped_ratio")}


def run_variant(name: str, model_dir: Path, data: Path, work: Path, *, args: argparse.Namespace,
                profile: bool = False) -> dict[str, Any]:
    """Train one row through train_curriculum.py and summarise its metrics after the warmup steps. With
    `profile`, two more steps run under torch.profiler (bench/profile_step.py) and are not timed. A row that
    cannot run here is skipped with the reason."""
    keys, missing = ROWS[name]
    profile = profile and name not in RL_ROWS  # bench/profile_step.py profiles a training step, not a rollout
    reason = missing() if missing is not None else None
    if reason is not None:
        return {"status": "skipped", "note": reason, "keys": keys}
    checkpointing = bool(keys.get("model", {}).get("gradient_checkpointing", False))
    out = work / name
    path = work / f"{name}.yaml"
    extra = 2 if profile else 0
    if name in RL_ROWS:
        data = args.prompts
    path.write_text(yaml.safe_dump(recipe(model_dir, data, out, max_seq_len=args.max_seq_len,
                                          peak_tflops=args.peak_tflops, steps=args.warmup + args.steps + extra,
                                          keys=keys, completion_length=args.completion_length)))
    overlap = name not in OVERLAP_OFF_ROWS and not (profile and args.no_overlap)
    script = REPO / ("bench/profile_step.py" if profile or not overlap else "train_curriculum.py")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "single.yaml"), "--num_processes", "1",
           "--mixed_precision", "bf16", str(script), "--config", str(path)]
    env = worker_env(threads=1 if args.tiny else 8)
    profile_file = args.out / f"{name}-profile.json"
    env |= {"PROFILE_OVERLAP": "1" if overlap else "0"}
    if profile:
        env |= {"PROFILE_STEP": str(args.warmup + args.steps + 1), "PROFILE_OUT": str(profile_file),
                "PROFILE_VOCAB": str(args.vocab)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    if proc.returncode != 0:
        return {"status": "failed", "returncode": proc.returncode, "log_tail": proc.stderr[-3000:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if "loss" in r and args.warmup < r["step"] <= args.warmup + args.steps]
    attention, loss_head, fused = (logged(proc.stderr, label) for label in ("attention", "loss head",
                                                                             "fused layers"))
    mfu = [r["mfu"] for r in timed if r["mfu"] is not None]
    tokens_per_sec = sum(r["tokens_per_sec"] for r in timed) / len(timed)
    profiled = json.loads(profile_file.read_text()) if profile and profile_file.is_file() else None
    busy = profiled.get("device_busy_share") if profiled else None
    return {
        "status": "ok", "gradient_checkpointing": checkpointing, "keys": keys,
        "fused_lora": next((line.split("fused LoRA: ")[1] for line in proc.stderr.splitlines()
                            if "fused LoRA: " in line), None),
        "attention": attention, "loss_head": loss_head, "fused_layers": fused,
        "compiled": "train.compile: " in proc.stderr, "timed_steps": len(timed),
        "tokens_per_sec": tokens_per_sec,
        "mean_step_time_s": sum(r["step_time"] for r in timed) / len(timed),
        "mfu": sum(mfu) / len(mfu) if mfu else None,
        "mfu_nemo": (tokens_per_sec * nemo_automodel_flops_per_token(args.config, row_length(keys, args)) / args.peak
                     if args.peak and name not in RL_ROWS else None),  # a grpo step's time is mostly rollout
        "row_length": row_length(keys, args),
        "estimated_peak_gb": estimated_peak_gb(path, args.config),
        "peak_memory_gb": max(r["peak_memory_gb"] for r in timed),
        "padding_fraction": sum(r["padding_fraction"] for r in timed) / len(timed),
        "idle_share": None if busy is None else 1.0 - busy,
        "final_loss": timed[-1]["loss"],
        "copy_overlap": overlap,
        "profile": profiled,
        **({"rollout": rollout_figures(timed, GRPO_PROMPTS * GRPO_GENERATIONS)} if name in RL_ROWS else {}),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown_rows(summary: dict[str, Any]) -> str:
    """The table for docs/benchmarks.md: one line per row, skipped and failed rows with why."""
    gpu, date = summary["machine"]["gpu"] or "CPU", summary["date"]
    lines = ["| date | device | row | row length | attention | fused layers | loss head | grad. ckpt. | tokens/s | "
             "MFU (ours) | MFU (NeMo AutoModel) | peak memory | preflight's estimate | idle | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, result in summary["variants"].items():
        if result["status"] != "ok":
            why = result.get("note") or f"failed (exit {result.get('returncode')})"
            lines.append(f"| {date} | {gpu} | {name} | {result['status']}: {why} |||||||||||")
            continue
        lines.append(f"| {date} | {gpu} | {name} | {result['row_length']} | {result['attention']} | "
                     f"{result['fused_layers']} | "
                     f"{result['loss_head']} | {'on' if result['gradient_checkpointing'] else 'off'} | "
                     f"{result['tokens_per_sec']:.0f} | {_pct(result['mfu'])} | {_pct(result['mfu_nemo'])} | "
                     f"{result['peak_memory_gb']:.1f} GiB | {result['estimated_peak_gb']:.1f} GiB | "
                     f"{_pct(result['idle_share'])} | "
                     f"{result['final_loss']:.4f} |")
    rl = {name: r["rollout"] for name, r in summary["variants"].items() if r["status"] == "ok" and "rollout" in r}
    if rl:  # the grpo row's rollout (issue 49), under the table
        lines += ["", "| date | device | row | completions/step | mean completion length | rollout tokens/s | "
                  "generation | scoring | training | step time |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in rl.items():
            step = summary["variants"][name]["mean_step_time_s"]
            lines.append(f"| {date} | {gpu} | {name} | {r['completions_per_step']} | "
                         f"{r['mean_completion_length']:.1f} | {r['rollout_tokens_per_sec']:.0f} | "
                         f"{r['generation_s']:.2f} s | {r['scoring_s']:.3f} s | {r['training_s']:.2f} s | "
                         f"{step:.2f} s |")
    return "\n".join(lines)


def losses_agree(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whether every row's final loss is within `LOSS_RTOL` of the first row's (the same data, the same global
    batch: only bf16 rounding may differ). Rows of other lengths (`long16k`, `long32k`) train other batches."""
    losses = {name: v["final_loss"] for name, v in variants.items()
              if v["status"] == "ok" and "data" not in v.get("keys", {}) and "stage" not in v.get("keys", {})}
    if not losses:
        return {"agree": None, "rtol": LOSS_RTOL, "max_rel_diff": None, "reference": None}
    reference = next(iter(losses))
    worst = max(abs(x - losses[reference]) / abs(losses[reference]) for x in losses.values())
    return {"agree": worst <= LOSS_RTOL, "rtol": LOSS_RTOL, "max_rel_diff": worst, "reference": reference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3 and short rows: checks the pipeline anywhere")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (compilation, allocator)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="packed row length (default 4096; tiny 256)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON result")
    parser.add_argument("--variants", nargs="+", choices=list(ROWS), default=LEVER_ROWS,
                        help="rows to run, in order; the first is the reference for the loss check (default: "
                        "the default and each lever of issue 34)")
    parser.add_argument("--profile", action="store_true",
                        help="profile two more steps of every row (bench/profile_step.py), untimed: the idle share")
    parser.add_argument("--no-overlap", action="store_true",
                        help="with --profile: each profiled row copies its micro-batches in turn, blocking, before "
                        "each forward (PROFILE_OVERLAP=0), its timed steps too: run with and without to compare the "
                        "idle share")
    parser.add_argument("--completion-length", type=int, default=None,
                        help="the grpo row's rl.max_completion_length (default 256; tiny 16)")
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
    ran = all(v["status"] in ("ok", "skipped") for v in summary["variants"].values())
    return 0 if ran and summary["losses"]["agree"] is not False else 1


def benchmark(args: argparse.Namespace) -> dict[str, Any] | None:
    """Both variants, the summary, and the results file; None when there is no GPU to run on."""
    args.max_seq_len = args.max_seq_len or (256 if args.tiny else 4096)
    args.completion_length = args.completion_length or (16 if args.tiny else 256)
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
        # Enough rows for every step to get full packed rows (about 6 samples per 4096-token row at this mix), at
        # the longest row any requested bench row packs.
        longest = max(row_length(ROWS[name][0], args) for name in args.variants)
        rows = 6 * ROWS_PER_STEP * (args.warmup + args.steps + 2) * -(-longest // args.max_seq_len) + 64
        write_chat_data(data, AutoTokenizer.from_pretrained(model_dir), rows, args.max_seq_len, seed=0)
        # The grpo row's prompts (dummy:letters' rows: a prompt and the letter its completion should hold), enough
        # for every step to draw new ones.
        from toolkit.builtin.dummy_data import write_dummy_letters

        args.prompts = write_dummy_letters(work / "prompts", GRPO_PROMPTS * (args.warmup + args.steps + 2) + 64)
        from transformers import AutoConfig

        config = args.config = AutoConfig.from_pretrained(model_dir)
        args.vocab = config.vocab_size
        args.nemo_flops_per_token = nemo_automodel_flops_per_token(config, args.max_seq_len)
        args.peak = _peak(args.peak_tflops)
        args.out.mkdir(parents=True, exist_ok=True)
        variants = {}
        for name in args.variants:
            variants[name] = run_variant(name, model_dir, data, work, args=args, profile=args.profile)
            print(f"variant {name}: {json.dumps(variants[name])}", file=sys.stderr, flush=True)
            # Each row as it ends: a device session cut off by its time limit keeps the rows it finished.
            (args.out / "rows-so-far.json").write_text(json.dumps(variants, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    best = max((v["mfu"] for v in variants.values() if v.get("mfu") is not None), default=None)
    summary = {
        "benchmark": "gpu_qwen3_8b" + ("-tiny" if args.tiny else ""), "date": datetime.date.today().isoformat(),
        "machine": machine_info(), "versions": versions(),
        "settings": {"model": "tiny-qwen3" if args.tiny else "Qwen3-8B architecture, random weights",
                     "lora": "r16 all-linear", "max_seq_len": args.max_seq_len, "packing": True,
                     "rows_per_step": ROWS_PER_STEP, "warmup": args.warmup, "steps": args.steps,
                     "profiled": args.profile, "peak_tflops": None if args.peak is None else args.peak / 1e12,
                     "nemo_automodel_flops_per_token": args.nemo_flops_per_token,
                     "variants": {name: ROWS[name][0] for name in args.variants}},
        "variants": variants,
        "losses": losses_agree(variants),
        "target": {"mfu": MFU_TARGET, "best_mfu": best,
                   "met": None if best is None or args.tiny else best >= MFU_TARGET},
    }
    name = f"{summary['date']}-{socket.gethostname()}-gpu8b{'-tiny' if args.tiny else ''}.json"
    summary["results_file"] = str(args.out / name)
    (args.out / name).write_text(json.dumps(summary, indent=2))
    (args.out / name).with_suffix(".md").write_text(markdown_rows(summary) + "\n")
    (args.out / "rows-so-far.json").unlink(missing_ok=True)
    return summary


def _peak(override_tflops: float | None) -> float | None:
    """The device's dense bf16 peak FLOP/s, as the training run finds it (toolkit/model/flops.py)."""
    import torch

    from toolkit.model.flops import peak_flops

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return peak_flops(name, override_tflops)


if __name__ == "__main__":
    sys.exit(main())
