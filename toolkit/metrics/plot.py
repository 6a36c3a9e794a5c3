"""Training curves of a run: `<output_dir>/metrics.jsonl` drawn to `<output_dir>/training.png`.

One figure, four panels against the optimizer step (loss with eval loss where logged, learning rate, gradient
norm, throughput), and a fifth when a preference stage logged TRL's rewards (`rewards/chosen`, `rewards/rejected`,
`rewards/margins`, with the eval pairs' `pref_accuracy`), with a dashed line where each curriculum stage begins, so
a jump in loss or lr can be read against the stage that caused it. Rendered on matplotlib's Agg canvas without
pyplot: no display and no global backend switch in the calling process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolkit.atomic import write_atomic
from toolkit.errors import ToolkitError
from toolkit.metrics.log import read_metrics
from toolkit.runtime.run_dir import RunLayout

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"), ("tokens_per_sec", "tokens / s"))
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "pref_accuracy")
"""A preference stage's panel: TRL's reward metrics of its steps, and its eval pairs' accuracy."""


def stage_boundaries(records: Sequence[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, stage name) of every record whose stage_index differs from the previous record's.

    The first record starts the first stage and is no boundary; records without a stage_index (e.g. eval-only
    lines) are skipped.
    """
    boundaries: list[tuple[int, str]] = []
    previous: int | None = None
    for rec in records:
        index = rec.get("stage_index")
        if index is None:
            continue
        if previous is not None and index != previous:
            boundaries.append((int(rec["step"]), str(rec.get("stage", f"stage {index}"))))
        previous = index
    return boundaries


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of the records that carry a numeric ``key``."""
    pairs = [(int(r["step"]), float(r[key])) for r in records
             if isinstance(r.get(key), int | float) and "step" in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot_run(output_dir: str | Path) -> Path:
    """Write ``training.png`` next to the run's metrics.jsonl and return its path."""
    layout = RunLayout(output_dir)
    path = layout.metrics
    if not path.is_file():
        raise ToolkitError(f"No metrics to plot: {path} does not exist. Give the output_dir of a training run "
                           "(it is written from the first logged step on).")
    records = read_metrics(path)
    if not records:
        raise ToolkitError(f"No metrics to plot: {path} is empty (the run logged no step yet).")

    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

    boundaries = stage_boundaries(records)
    first = next((r for r in records if r.get("stage") is not None), None)
    panels = [*PANELS, *([("rewards", "rewards")] if _series(records, "rewards/chosen")[0] else [])]
    fig = Figure(figsize=(9, 2.4 * len(panels)))
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, label="train" if key == "loss" else None)
        if key == "rewards":
            for name in REWARDS:
                at, got = _series(records, name)
                ax.plot(at, got, "o-" if name == "pref_accuracy" else "-", label=name)
            ax.legend(loc="upper left", fontsize="small")
        if key == "loss":
            eval_steps, eval_values = _series(records, "eval_loss")
            if eval_steps:
                ax.plot(eval_steps, eval_values, "o-", label="eval")
            if steps or eval_steps:
                ax.legend(loc="upper right", fontsize="small")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        for step, _ in boundaries:
            ax.axvline(step, color="grey", linestyle="--", linewidth=1)
        if ax is axes[0]:
            if first is not None:
                ax.annotate(str(first["stage"]), xy=(0.01, 0.98), xycoords="axes fraction", va="top",
                            fontsize="small", color="grey")
            for step, name in boundaries:
                ax.annotate(name, xy=(step, 0.98), xycoords=("data", "axes fraction"), xytext=(3, 0),
                            textcoords="offset points", va="top", fontsize="small", color="grey")
    axes[-1].set_xlabel("step")
    fig.suptitle(layout.root.name)
    fig.tight_layout()
    target = layout.plot
    write_atomic(target, lambda f: fig.savefig(f, format="png", dpi=100))  # a viewer never reads half a picture
    return target
