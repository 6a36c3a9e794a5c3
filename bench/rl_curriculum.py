"""Does the RL stage learn, and does the pass-rate curriculum with dynamic sampling learn in fewer steps? (issue 49)

Runs recipes/sft_then_grpo.yaml (the built-in tiny Qwen3: an sft stage on `dummy:facts`, then a grpo stage on
`dummy:letters` with the `contains` reward) for several seeds under two configs, one launch each:

* `plain`: the grpo stage draws its prompts in the sampler's order, every group trained;
* `curriculum`: `difficulty: {by: pass_rate, model: current, samples: K}` with `drop: {easiest: F}` (prompts the
  policy already solves at the stage's entry are left out) and `rl.dynamic_sampling: true` (groups all right or all
  wrong are set aside and prompts drawn again, DAPO).

Both are measured the same way, on a fixed held-out letters set (a generation eval with the `contains` scorer,
sampled at the rollout's temperature, every `--eval-every` steps and at the stage's end): the training `reward`
alone would not compare them, since the curriculum trains on the prompts it kept and the groups it did not set aside.
The training reward per step is reported too. From the curves it reports the mean and spread (min, max, sample std)
over seeds per step, the rise from the stage's first evaluation to its last against the seed-to-seed spread, and the
first step at which each config's seed-mean eval reward reaches a target: by default the plain config's final mean.

    nice -n 10 python bench/rl_curriculum.py                    # 3 seeds x 2 configs; writes bench/results/...
    python bench/rl_curriculum.py --seeds 1 --steps 4 --eval-every 2 --out /tmp/x   # a smoke run

Runs a few launches at once (`--parallel`, one torch thread each), so a seed's configs share the machine's load.

Prints one JSON object (also written to `<out>/<date>-vm-rl-curriculum.json`). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "sft_then_grpo.yaml"
TARGETS = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]"
"""LoRA on the head too, as tests/train/test_grpo.py::test_the_pieces_learn_the_letters_task trains it: the random
tiny model's next-token distribution is near uniform (entropy ~ln 1024), and with the recipe's `all-linear` (no head)
at these few steps the policy barely moved (a first run at lr 1e-2: entropy 6.918 throughout, no rise in 20 steps)."""


# --- summary arithmetic (tests/bench/test_rl_curriculum.py) -----------------------------------------------------------

def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max of one step's values over seeds."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def mean_curve(curves: list[dict[int, float]]) -> dict[int, dict[str, float]]:
    """Per step, the spread over seeds of the steps every seed logged (a step one seed lacks is left out)."""
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return {s: spread([c[s] for c in curves]) for s in steps}


def steps_to_target(curve: dict[int, float], target: float) -> int | None:
    """The first step whose value reaches `target` (>=), or None when no step does."""
    return next((s for s in sorted(curve) if curve[s] >= target), None)


def window_means(curve: dict[int, float], share: float = 0.25) -> dict[int, float]:
    """A noisy per-step curve as two points: the mean of its first and of its last `share` of steps (at least one
    each), keyed 0 and 1, for `rise`."""
    steps = sorted(curve)
    n = max(1, int(len(steps) * share))
    return {0: statistics.fmean(curve[s] for s in steps[:n]), 1: statistics.fmean(curve[s] for s in steps[-n:])}


def rise(curves: list[dict[int, float]]) -> dict[str, float]:
    """Each seed's last value minus its first, and how that compares with the seed-to-seed spread at the start and
    the end (the sample std over seeds of the first and of the last values)."""
    ups = [c[max(c)] - c[min(c)] for c in curves]
    first = [c[min(c)] for c in curves]
    last = [c[max(c)] for c in curves]
    noise = max(statistics.stdev(first), statistics.stdev(last)) if len(curves) > 1 else 0.0
    return {"mean_rise": statistics.fmean(ups), "min_rise": min(ups), "start_std": spread(first)["std"],
            "end_std": spread(last)["std"], "rise_over_noise": statistics.fmean(ups) / noise if noise else float("inf")}


# --- running ------------------------------------------------------------------------------------------------------

def write_eval_set(folder: Path, rows: int) -> Path:
    """A held-out letters set (another seed than `dummy:letters`), as generation-eval rows: the user turn to answer
    and the letter as the reference."""
    from toolkit.builtin.dummy_data import write_dummy_letters

    source = write_dummy_letters(folder / "src", rows, seed=1)
    out = folder / "letters_eval.jsonl"
    with source.open() as f, out.open("w") as g:
        for line in f:
            row = json.loads(line)
            g.write(json.dumps({"messages": row["prompt"], "reference": row["reference"]}) + "\n")
    return out


def overrides(args: argparse.Namespace, config: str, seed: int, out: Path, eval_file: Path) -> list[str]:
    rl = f"num_generations: {args.generations}, max_completion_length: {args.length}"
    common = [
        f"output_dir={out}", f"train.seed={seed}", f"train.micro_batch_size={args.generations}",
        f"train.grad_accum={args.prompts}", f"stages.1.max_steps={args.steps}", f"stages.1.lr={args.lr}",
        f"eval.every_steps={args.eval_every}", "checkpoint.save_steps=100000", f"lora.target_modules={TARGETS}",
        f"stages.1.generation=[{{name: letters, data: [{eval_file}], scorers: [{{kind: contains, lower: true}}], "
        f"max_new_tokens: {args.length}, temperature: 1.0, batch_size: 64}}]",
    ]
    if config == "plain":
        return [*common, f"stages.1.rl={{{rl}}}"]
    return [*common, f"stages.1.rl={{{rl}, dynamic_sampling: true}}",
            f"stages.1.difficulty={{by: pass_rate, model: current, samples: {args.samples}}}",
            f"stages.1.drop={{easiest: {args.drop}}}"]


def run_one(args: argparse.Namespace, config: str, seed: int, work: Path, eval_file: Path) -> dict:
    out = work / f"{config}-s{seed}"
    cmd = [sys.executable, str(ROOT / "train_curriculum.py"), "--config", str(RECIPE), "--create_dummy_data",
           "--num_dummy_samples", str(args.rows), *overrides(args, config, seed, out, eval_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"error: {config} seed {seed} exited {done.returncode}: {done.stderr[-2000:]}")
    run = read_run(out, config, seed, args.prompts)
    print(f"{config} seed {seed}: {wall:.0f} s, eval {run['eval_reward']}", file=sys.stderr)
    return {**run, "wall_s": round(wall, 1)}


def read_run(out: Path, config: str, seed: int, prompts: int) -> dict:
    """One launch's grpo curves from its metrics.jsonl, by the stage's own step (1-based): the training `reward`,
    the held-out eval's `letters.contains`, and the groups each step drew (`rl/drawn` under dynamic sampling, else
    the step's prompts)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    grpo = [r for r in records if r.get("stage") == "grpo"]
    first = min(r["step"] for r in grpo if "step_time" in r)  # the stage's first training step
    rel = lambda r: r["step"] - first + 1  # noqa: E731
    train = {rel(r): r["reward"] for r in grpo if "reward" in r}
    evals = {rel(r): r["letters.contains"] for r in grpo if "letters.contains" in r}
    drawn = {rel(r): int(r.get("rl/drawn", prompts)) for r in grpo if "reward" in r}
    draws = {k: sum(r.get(k, 0) for r in grpo) for k in ("rl/drawn", "rl/dropped", "rl/filled")}
    return {"config": config, "seed": seed, "train_reward": train, "eval_reward": evals, "groups_drawn": drawn,
            "draws": draws if config == "curriculum" else None, "first_grpo_global_step": first}


def drawn_until(drawn: dict[int, int], step: int | None) -> int | None:
    """Groups drawn by the steps up to `step` (None: the target was not reached)."""
    return None if step is None else sum(n for s, n in drawn.items() if s <= step)


def summarise(runs: list[dict], target: float | None) -> dict:
    by = {c: [r for r in runs if r["config"] == c] for c in ("plain", "curriculum")}
    out: dict = {}
    for config, rs in by.items():
        evals = [r["eval_reward"] for r in rs]
        out[config] = {"eval_curve": mean_curve(evals), "train_curve": mean_curve([r["train_reward"] for r in rs]),
                       "eval_rise": rise(evals),
                       "train_rise_first_to_last_quarter": rise([window_means(r["train_reward"]) for r in rs])}
    plain_final = out["plain"]["eval_curve"]
    goal = target if target is not None else plain_final[max(plain_final)]["mean"]
    out["target"] = {"reward": goal, "what": "given" if target is not None else "plain config's final seed-mean eval"}
    for config, rs in by.items():
        mean = {s: v["mean"] for s, v in out[config]["eval_curve"].items()}
        out[config]["steps_to_target_mean_curve"] = steps_to_target(mean, goal)
        per_seed = [steps_to_target(r["eval_reward"], goal) for r in rs]
        out[config]["steps_to_target_per_seed"] = per_seed
        out[config]["groups_drawn_to_target_per_seed"] = [drawn_until(r["groups_drawn"], s)
                                                          for r, s in zip(rs, per_seed, strict=True)]
        out[config]["groups_drawn_in_stage_per_seed"] = [sum(r["groups_drawn"].values()) for r in rs]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="grpo steps")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (grad_accum; one group a micro-batch)")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--length", type=int, default=4, help="max completion tokens (rollout and eval)")
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--rows", type=int, default=64, help="letters prompts (and facts rows)")
    p.add_argument("--eval-rows", type=int, default=128)
    p.add_argument("--samples", type=int, default=4, help="pass-rate samples per prompt at the stage's entry")
    p.add_argument("--drop", type=float, default=0.25, help="share of the easiest prompts dropped")
    p.add_argument("--target", type=float, default=None, help="default: the plain config's final seed-mean eval")
    p.add_argument("--threads", type=int, default=1, help="torch threads per launch")
    p.add_argument("--parallel", type=int, default=3, help="launches at once")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--summarise", metavar="RESULTS_JSON", help="recompute the summary of a results file, no runs")
    args = p.parse_args()
    if args.summarise:
        path = Path(args.summarise)
        result = json.loads(path.read_text())
        for run in result["runs"]:  # JSON keys are strings: steps back to ints
            for key in ("train_reward", "eval_reward", "groups_drawn"):
                run[key] = {int(k): v for k, v in run[key].items()}
        result["summary"] = summarise(result["runs"], args.target)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["summary"], indent=1))
        return
    work = Path(tempfile.mkdtemp(prefix="rl-curriculum-"))
    load = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        eval_file = write_eval_set(work, args.eval_rows)
        jobs = [(config, seed) for seed in range(args.seeds) for config in ("plain", "curriculum")]
        with ThreadPoolExecutor(args.parallel) as pool:  # configs side by side, under the same load
            runs = list(pool.map(lambda job: run_one(args, job[0], job[1], work, eval_file), jobs))
    finally:
        if not args.keep_workdir:
            shutil.rmtree(work, ignore_errors=True)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    result = {"date": date, "host": os.uname().nodename, "cpus": os.cpu_count(), "load_avg_1m_at_start": load,
              "wall_s": round(time.perf_counter() - start, 1), "settings": vars(args), "runs": runs,
              "summary": summarise(runs, args.target)}
    path = Path(args.out) / f"{date}-vm-rl-curriculum.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    result["results_file"] = str(path)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
