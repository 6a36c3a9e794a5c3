"""Re-record tests/assets/curriculum_losses.json for this machine's CPU kernel family, by the very launches that
tests/e2e/test_strategies.py checks against it (tests/conftest.py curriculum_runs: the 3-stage smoke curriculum, fp32,
2 processes over gloo, a checkpoint per step and the generation evals, through tests/helpers/spy_generation.py).

    python tests/helpers/record_curriculum_losses.py --note "why" [--keep-other-families]

Run it only for an intended numeric change, and say why in the note. The record of another CPU family is dropped
unless --keep-other-families is given (values recorded with the old code would be wrong for the new)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


from tests.conftest import (  # noqa: E402
    CURRICULUM,
    GENERATION,
    SPY,
    cpu_kernel_family,
    curriculum_args,
    spy_dir,
    train,
)
from toolkit.metrics.log import read_metrics  # noqa: E402

GOLDEN = REPO / "tests" / "assets" / "curriculum_losses.json"
STRATEGIES = ("ddp", "zero3", "fsdp")
KEYS = ("step", "loss", "grad_norm", "lr")


def record(strategy: str, root: Path) -> dict[str, list]:
    out = root / strategy
    train(strategy, 2, out, *curriculum_args(strategy), *GENERATION, recipe=CURRICULUM, script=SPY,
          env={"SPY_GENERATION_DIR": str(spy_dir(out))})
    records = read_metrics(out / "metrics.jsonl", "train")
    return {k: [r[k] for r in records] for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--note", required=True, help="the file's _note: what was recorded, when and why")
    parser.add_argument("--append-note", action="store_true", help="add --note to the file's note, not replace it")
    parser.add_argument("--keep-other-families", action="store_true")
    args = parser.parse_args()
    family = cpu_kernel_family()
    old = json.loads(GOLDEN.read_text())
    by_family = dict(old["by_cpu_capability"]) if args.keep_other_families else {}
    with tempfile.TemporaryDirectory() as tmp:
        by_family[family] = {s: record(s, Path(tmp)) for s in STRATEGIES}
        print(f"recorded {family}: " + ", ".join(f"{s} {v['loss'][-1]}" for s, v in by_family[family].items()))
    note = f"{old['_note']} {args.note}" if args.append_note else args.note
    GOLDEN.write_text(json.dumps({"_note": note, "by_cpu_capability": by_family}, indent=1) + "\n")


if __name__ == "__main__":
    main()
