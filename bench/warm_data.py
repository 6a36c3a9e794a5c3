#!/usr/bin/env python
"""The warm relaunch's data time (issue 52): `load_curriculum_data`, as a launch calls it (toolkit/train/setup.py),
on a source whose token store is prepared and checked already, each time in a fresh process (imports included,
as a relaunch pays them), the median of `--repeats`. With several `--trees` (checkouts of the toolkit, e.g. main and
a branch) the trees alternate in one run, so their times share the machine's load.

    python bench/data_scale.py --rows 100000 --prepare-only --no-peer --workdir W   # the store, prepared once
    python bench/warm_data.py --workdir W --rows 100000 --trees /work/main .        # before / after
    python bench/warm_data.py --workdir W --rows 100000 --profile                   # cProfile of one open

The data time is the call's wall time: the same window as data_scale.py's data time in a launch (from the run's
`data:` line to the last stage's data line), without the launch around it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import cProfile, json, logging, pstats, sys, time
from pathlib import Path
import yaml
from transformers import AutoTokenizer
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.stages import load_curriculum_data

work, rows, profile = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
logging.basicConfig(level=logging.WARNING)
model = work / "tiny-qwen3-real"
tree = {"output_dir": str(work / "warm-run"), "model": {"name_or_path": str(model)},
        "data": {"max_seq_len": 4096, "packing": True, "cache_dir": str(work / "cache-prepare")},
        "stages": [{"name": "chat", "data": [str(work / f"chat-{rows}.jsonl")], "max_steps": 2}],
        "train": {"micro_batch_size": 1, "grad_accum": 1}}
(work / "warm.yaml").write_text(yaml.safe_dump(tree))
recipe = load_recipe(work / "warm.yaml")
stages = resolve_stages(recipe)
tokenizer = AutoTokenizer.from_pretrained(str(model))
profiler = cProfile.Profile() if profile else None
start = time.monotonic()
if profiler:
    profiler.enable()
sets, _ = load_curriculum_data(stages, recipe.data, tokenizer, None, work / "dummy", Path(recipe.data.cache_dir))
if profiler:
    profiler.disable()
seconds = time.monotonic() - start
if profiler:
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
print(json.dumps({"data_s": seconds, "packed_rows": len(sets[0].samples)}))
"""


def once(tree: Path, work: Path, rows: int, profile: bool = False) -> dict[str, float]:
    """One warm load in a fresh process importing the toolkit of `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", CHILD, str(work), str(rows), "1" if profile else "0"], env=env,
                         cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"error: the warm load under {tree} failed:\n{out.stderr[-3000:]}")
    if profile:
        print(out.stderr, file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="a data_scale.py --prepare-only workdir")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--trees", type=Path, nargs="+", default=[REPO], help="toolkit checkouts to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile one load of the first tree")
    args = parser.parse_args()
    if args.profile:
        print(json.dumps(once(args.trees[0], args.workdir, args.rows, profile=True)))
        return
    for tree in args.trees:  # a first load per tree: its store checked and its packing plan written, untimed
        once(tree, args.workdir, args.rows)
    times: dict[str, list[float]] = {str(t): [] for t in args.trees}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for tree in args.trees:
            times[str(tree)].append(round(once(tree, args.workdir, args.rows)["data_s"], 3))
    load.append(os.getloadavg()[0])
    print(json.dumps({"bench": "warm_data", "date": date.today().isoformat(), "rows": args.rows,
                      "load_avg_1m": load, "times_s": times,
                      "median_s": {t: statistics.median(v) for t, v in times.items()}}, indent=2))


if __name__ == "__main__":
    main()
