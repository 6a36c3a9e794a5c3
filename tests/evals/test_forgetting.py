"""The forgetting matrix: its records, cut back on resume, and drawn by `toolkit plot` beside the loss plot."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from toolkit.commands import cli
from toolkit.evals.forgetting import MatrixLog, matrix_record, plot_forgetting, prune_after, row_label
from toolkit.metrics.log import read_metrics
from toolkit.runtime.run_dir import RunLayout

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def two_stage_matrix(layout: RunLayout) -> None:
    """Stage 'learn' (steps 2-4) then 'overwrite' (6-8): learn's eval set forgotten, overwrite's learnt."""
    log = MatrixLog(layout.eval_matrix, enabled=True)
    for step, stage, learnt, forgotten in ((2, "learn", 0.2, 0.0), (4, "learn", 1.0, 0.0), (6, "overwrite", 0.6, 0.4),
                                           (8, "overwrite", 0.0, 1.0)):
        log.write([matrix_record(step, stage, "learn", "loss", "eval_loss", 6 - learnt),
                   matrix_record(step, stage, "overwrite", "loss", "eval_loss", 6 - forgotten),
                   matrix_record(step, stage, "learn", "facts", "exact", learnt),
                   matrix_record(step, stage, "overwrite", "revised", "exact", forgotten),
                   matrix_record(step, stage, None, "shared", "exact", 0.5)])


def test_matrix_records_and_their_rows(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    two_stage_matrix(layout)
    records = read_metrics(layout.eval_matrix)
    assert len(records) == 20 and records[0] == {"step": 2, "stage": "learn", "eval_stage": "learn", "eval": "loss",
                                                 "metric": "eval_loss", "value": 5.8}
    assert [row_label(r) for r in records[:5]] == ["learn: loss", "overwrite: loss", "learn: facts",
                                                   "overwrite: revised", "shared"]
    MatrixLog(layout.eval_matrix, enabled=False).write(records)  # another rank, or no eval.all_stages
    assert len(read_metrics(layout.eval_matrix)) == 20


def test_a_resume_cuts_the_matrix_and_the_completions_back(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    two_stage_matrix(layout)
    for stage, step in (("learn", 2), ("learn", 4), ("overwrite", 6), ("overwrite", 8)):
        path = layout.completions(stage, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}\n")
    (layout.evals / "overwrite" / "notes.txt").write_text("the user's")  # not ours: kept
    prune_after(layout, 5)
    assert sorted(p.relative_to(layout.evals).as_posix() for p in layout.evals.rglob("*.*")) == [
        "learn/step-00000002.jsonl", "learn/step-00000004.jsonl", "matrix.jsonl", "overwrite/notes.txt"]
    assert {r["step"] for r in read_metrics(layout.eval_matrix)} == {2, 4}
    prune_after(RunLayout(tmp_path / "fresh"), 3)  # nothing to cut


def test_toolkit_plot_draws_the_heatmap_beside_the_loss_plot(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    assert plot_forgetting(tmp_path) is None  # no matrix: no heatmap
    layout.metrics.write_text("".join(json.dumps({"step": s, "stage": "learn" if s < 5 else "overwrite",
                                                  "stage_index": int(s >= 5), "loss": 3.0 / s}) + "\n"
                                      for s in range(1, 9)))
    two_stage_matrix(layout)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["plot", str(tmp_path)]) == 0
    assert out.getvalue().split() == [str(layout.plot), str(layout.matrix_plot)]
    assert layout.matrix_plot == tmp_path / "forgetting.png" and layout.plot.parent == layout.matrix_plot.parent
    data = layout.matrix_plot.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
