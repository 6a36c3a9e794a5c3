"""The forgetting matrix: with eval.all_stages, every evaluation scores every stage's eval sets, and rank 0 appends
one record per (step, eval set, metric) to `evals/matrix.jsonl`:

    {"step": 12, "stage": "overwrite", "eval_stage": "learn", "eval": "recall", "metric": "exact", "value": 0.25}

`stage` is the stage being trained at that step; `eval_stage` the stage the eval set belongs to (null for sets
every stage shares: eval.data, eval.generation); `eval` the generation eval's name, or `loss` for a stage's eval
files; `metric` a scorer's name or `eval_loss`. `plot_forgetting` draws it as a heatmap, one panel per metric,
one row per eval set, one column per evaluation, with the stage boundaries: a stage-1 row that pales while stage 2
trains is stage 2 overwriting what stage 1 taught.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from toolkit.atomic import write_atomic, writing
from toolkit.metrics.log import read_metrics, to_json_line, truncate_after
from toolkit.runtime.run_dir import RunLayout


def matrix_record(step: int, stage: str, eval_stage: str | None, eval_name: str, metric: str,
                  value: float) -> dict[str, Any]:
    return {"step": step, "stage": stage, "eval_stage": eval_stage, "eval": eval_name, "metric": metric,
            "value": value}


class MatrixLog:
    """Appends matrix records; a no-op on ranks other than 0, or without eval.all_stages."""

    def __init__(self, path: Path, *, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, records: list[dict[str, Any]]) -> None:
        if not self.enabled or not records:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with writing(self.path), self.path.open("a", encoding="utf-8") as f:
            f.write("".join(to_json_line(r) for r in records))


def prune_after(layout: RunLayout, step: int) -> None:
    """A resume at `step` redoes the evals after it: their completions files go (they are the run's own, named
    `step-N.jsonl` under evals/<stage>/) and the matrix is cut back to `step`."""
    truncate_after(layout.eval_matrix, step)
    if not layout.evals.is_dir():
        return
    for folder in layout.evals.iterdir():
        for path in folder.glob("step-*.jsonl") if folder.is_dir() else []:
            number = path.stem.removeprefix("step-")
            if number.isdigit() and int(number) > step:
                path.unlink()


def row_label(record: dict[str, Any]) -> str:
    """A matrix row's name: the eval set, with the stage it belongs to."""
    stage, name = record.get("eval_stage"), str(record["eval"])
    return name if stage is None else f"{stage}: {name}"


def plot_forgetting(output_dir: str | Path) -> Path | None:
    """Write the heatmap of `evals/matrix.jsonl` to `forgetting.png` beside the loss plot; None without a matrix."""
    layout = RunLayout(output_dir)
    if not layout.eval_matrix.is_file():
        return None
    records = [r for r in read_metrics(layout.eval_matrix) if isinstance(r.get("value"), int | float)]
    if not records:
        return None

    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

    metrics = list(dict.fromkeys(str(r["metric"]) for r in records))
    steps = sorted({int(r["step"]) for r in records})
    column = {s: i for i, s in enumerate(steps)}
    stage_at = {int(r["step"]): str(r["stage"]) for r in records}
    rows_of = {m: list(dict.fromkeys(row_label(r) for r in records if r["metric"] == m)) for m in metrics}
    fig = Figure(figsize=(max(6.0, 0.45 * len(steps) + 3), sum(1.0 + 0.45 * len(rows_of[m]) for m in metrics) + 0.6))
    axes = fig.subplots(len(metrics), 1, squeeze=False)[:, 0]
    for ax, metric in zip(axes, metrics, strict=True):
        rows = rows_of[metric]
        grid = [[math.nan] * len(steps) for _ in rows]
        for r in records:
            if r["metric"] == metric:
                grid[rows.index(row_label(r))][column[int(r["step"])]] = float(r["value"])
        # lower is better for a loss: its colours are reversed, so that bright means good in every panel; scores
        # within [0, 1] (every built-in scorer's) share that scale
        loss = "loss" in metric
        values = [v for line in grid for v in line if not math.isnan(v)]
        unit = not loss and all(0.0 <= v <= 1.0 for v in values)
        image = ax.imshow(grid, aspect="auto", cmap="viridis_r" if loss else "viridis", interpolation="nearest",
                          vmin=0.0 if unit else None, vmax=1.0 if unit else None)
        fig.colorbar(image, ax=ax, fraction=0.04, pad=0.01)
        if len(steps) <= 24 and len(rows) <= 12:
            for y, line in enumerate(grid):
                for x, value in enumerate(line):
                    if not math.isnan(value):
                        red, green, blue, _ = image.cmap(image.norm(value))
                        dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
                        ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize="x-small",
                                color="white" if dark else "black")
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize="small")
        ax.set_title(metric, fontsize="medium", loc="right")
        for i in range(1, len(steps)):
            if stage_at[steps[i]] != stage_at[steps[i - 1]]:
                ax.axvline(i - 0.5, color="white", linewidth=2)
                ax.annotate(stage_at[steps[i]], xy=(i - 0.5, -0.5), xytext=(3, 3), textcoords="offset points",
                            fontsize="small", color="grey", annotation_clip=False)
    axes[0].annotate(stage_at[steps[0]], xy=(-0.5, -0.5), xytext=(3, 3), textcoords="offset points",
                     fontsize="small", color="grey", annotation_clip=False)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{layout.root.name}: every stage's eval sets at every evaluation")
    fig.tight_layout()
    write_atomic(layout.matrix_plot, lambda f: fig.savefig(f, format="png", dpi=100))
    return layout.matrix_plot
