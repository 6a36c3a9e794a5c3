"""The smoke recipes through `accelerate launch` on one GPU, under every strategy one GPU can run: a first check
that the launch lines users copy work on a GPU, before any timing.

    python bench/gpu_smoke.py [--recipes smoke smoke_vl] [--configs single fsdp zero2 zero3] [--out DIR]

Each (recipe, config) runs the line from the recipe's header, verbatim but for `--num_processes 1` and a
rendezvous port of its own (`--main_process_port`: the runs go at once, in their own copies of the repository,
since the recipes write to outputs/<name>), in the config file's precision (bf16). A run passes when it exits 0,
logs finite losses, and its `final/` exports merged (`toolkit export --merge`) into a model that loads and gives
finite logits on the GPU. Writes <out>/gpu-smoke.json and prints a markdown table on stderr. Runs on CPU too
(bf16 autocast there), which is how it was checked before its first GPU run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from gpu_qwen3_8b import logged  # noqa: E402

EXTRA_ARGS = {"smoke": ["--create_dummy_data", "--num_dummy_samples", "64"], "smoke_vl": []}  # the headers' lines
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv*", "outputs", ".toolkit-cache", "results", "__pycache__",
                                     ".whl", ".ci-logs", "*.egg-info")


def launch_line(recipe: str, config: str, port: int) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}.yaml",
            "--num_processes", "1", "--main_process_port", str(port), "train_curriculum.py",
            "--config", f"recipes/{recipe}.yaml", *EXTRA_ARGS[recipe]]


LOADING = threading.Lock()
"""One from_pretrained at a time: it sets torch's default dtype for the whole process while it builds, so two
threads loading at once can leave a parameter in the other's dtype (seen on the GPU: a float32 q_norm beside
bfloat16 keys, "Expected query, key, and value to have the same dtype"; reproduced on CPU with four threads)."""


def check_final(final: Path, merged: Path) -> dict[str, Any]:
    """Export `final` merged, load the merged model on the GPU (or CPU) and run one forward."""
    proc = subprocess.run([sys.executable, "-m", "toolkit.commands.cli", "export", str(final), "--merge", "--out",
                           str(merged)], cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"export": "failed", "export_tail": proc.stderr[-2000:]}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(merged)
    cls = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with LOADING:
        model = cls.from_pretrained(merged, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4]], device=device)).logits
    return {"export": "ok", "loaded_as": cls.__name__, "logits_finite": bool(torch.isfinite(logits).all())}


def run_one(recipe: str, config: str, port: int, work: Path) -> dict[str, Any]:
    copy = work / f"{recipe}-{config}"
    shutil.copytree(REPO, copy, ignore=COPY_IGNORE)
    cmd = launch_line(recipe, config, port)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=1200)
    result: dict[str, Any] = {"recipe": recipe, "config": config, "returncode": proc.returncode,
                              "seconds": round(time.perf_counter() - start, 1),
                              "command": " ".join(["accelerate launch", *cmd[3:]])}
    (work / f"{recipe}-{config}.log").write_text(proc.stderr)
    if proc.returncode != 0:
        return result | {"ok": False, "log_tail": proc.stderr[-3000:]}
    out = copy / "outputs" / recipe
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records if "loss" in r]
    result |= {"steps": len(losses), "losses_finite": all(x is not None and math.isfinite(x) for x in losses),
               "last_loss": losses[-1] if losses else None,
               "last_line": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "",
               "fused_layers": logged(proc.stderr, "fused layers")}
    try:
        result |= check_final(out / "final", copy / "merged")
    except Exception as e:  # recorded, so that the other runs' results are still written
        result |= {"export": "failed", "check_error": f"{type(e).__name__}: {e}"}
    result["ok"] = bool(losses) and result["losses_finite"] and result.get("logits_finite", False)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=list(EXTRA_ARGS), choices=list(EXTRA_ARGS))
    parser.add_argument("--configs", nargs="+", default=["single", "fsdp", "zero2", "zero3"])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--parallel", type=int, default=8, help="runs at once")
    args = parser.parse_args(argv)
    import torch
    import transformers  # resolved here: transformers' lazy imports are not safe across the checking threads

    for name in ("AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText"):
        getattr(transformers, name)

    work = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    jobs = [(r, c) for r in args.recipes for c in args.configs]
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "results": [], "logs": str(work)}
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run_one, r, c, 29600 + i, work) for i, (r, c) in enumerate(jobs)]
        for future in as_completed(futures):  # written as each ends: a run cut off still leaves the others
            summary["results"].append(future.result())
            (args.out / "gpu-smoke.json").write_text(json.dumps(summary, indent=2))
    results = summary["results"]
    print(json.dumps(summary, indent=2))
    print("| recipe | config | exit | fused layers | steps | last loss | final/ merged, loaded, finite | seconds |",
          file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in results:
        print(f"| {r['recipe']} | {r['config']} | {r['returncode']} | {r.get('fused_layers', '-')} | "
              f"{r.get('steps', '-')} | {r.get('last_loss', '-')} | {r.get('logits_finite', '-')} | {r['seconds']} |",
              file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
