"""Tests for the training-curve plot and its stage boundaries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from toolkit.errors import ToolkitError
from toolkit.metrics.plot import plot_run, stage_boundaries

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _records() -> list[dict[str, Any]]:
    """Three stages over 12 logged steps (stage 2 starts at step 5, stage 3 at step 9); two eval points."""
    stages = [("warmup", 4), ("reasoning", 4), ("polish", 4)]
    records, step = [], 0
    for index, (name, steps) in enumerate(stages):
        for stage_step in range(1, steps + 1):
            step += 1
            records.append({"step": step, "stage": name, "stage_index": index, "stage_step": stage_step,
                            "loss": 3.0 / step, "lr": 1e-4 * stage_step / steps, "grad_norm": 1.0 + 0.1 * step,
                            "tokens": 1000 * step, "tokens_per_sec": 500.0 + step, "samples": 8 * step})
    records[3]["eval_loss"] = 1.0
    records[11]["eval_loss"] = 0.5
    return records


def test_stage_boundaries_are_exact() -> None:
    assert stage_boundaries(_records()) == [(5, "reasoning"), (9, "polish")]
    assert stage_boundaries(_records()[:4]) == []
    assert stage_boundaries([]) == []


def test_plot_writes_png(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    png = plot_run(tmp_path)
    assert png == tmp_path / "training.png"
    data = png.read_bytes()
    assert len(data) > 1000
    assert data.startswith(PNG_SIGNATURE)


def test_plot_tolerates_missing_values(tmp_path: Path) -> None:
    records = _records()
    records[0]["grad_norm"] = None  # the first logged step of a run may have no norm yet
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_run(tmp_path).read_bytes().startswith(PNG_SIGNATURE)


def test_missing_or_empty_metrics(tmp_path: Path) -> None:
    with pytest.raises(ToolkitError, match="does not exist"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ToolkitError, match="empty"):
        plot_run(tmp_path)
    assert not (tmp_path / "training.png").exists()


def _size(png: bytes) -> tuple[int, int]:
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # IHDR's width and height


def test_a_preference_stage_adds_a_rewards_panel(tmp_path: Path) -> None:
    """TRL's rewards of a DPO stage's steps, and its eval pairs' accuracy, get a fifth panel; a run without them
    keeps four."""
    plain = tmp_path / "sft"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    records = _records()
    for r in records[8:]:  # the last stage trains on pairs
        r.update({"rewards/chosen": 0.01 * r["step"], "rewards/rejected": -0.01 * r["step"],
                  "rewards/margins": 0.02 * r["step"], "rewards/accuracies": 0.5})
    records.append({"step": 12, "stage": "polish", "stage_index": 2, "eval_loss": 0.6, "pref_accuracy": 0.75})
    paired = tmp_path / "dpo"
    paired.mkdir()
    (paired / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    four, five = _size(plot_run(plain).read_bytes()), _size(plot_run(paired).read_bytes())
    assert four == (900, 960) and five == (900, 1200)  # 2.4 inches a panel at 100 dpi


def test_the_rewards_panel_draws_each_reward_and_the_accuracy_at_their_steps(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48's mutation audit: the rewards panel's content, not only the picture's height. The figure plot_run
    saves is caught where it is saved: its last panel holds one line per reward metric and the eval accuracy, each
    at the steps and with the values metrics.jsonl records."""
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    real = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> Any:
        saved.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    records = _records()
    for r in records[8:]:
        r.update({"rewards/chosen": 0.01 * r["step"], "rewards/rejected": -0.02 * r["step"],
                  "rewards/margins": 0.03 * r["step"]})
    records.append({"step": 12, "stage": "polish", "stage_index": 2, "eval_loss": 0.6, "pref_accuracy": 0.75})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_run(tmp_path)
    (fig,) = saved
    rewards = fig.axes[-1]
    assert rewards.get_ylabel() == "rewards"
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in rewards.get_lines()
             if not line.get_label().startswith("_")}
    steps = list(range(9, 13))
    assert lines == {"rewards/chosen": (steps, [0.01 * s for s in steps]),
                     "rewards/rejected": (steps, [-0.02 * s for s in steps]),
                     "rewards/margins": (steps, [0.03 * s for s in steps]), "pref_accuracy": ([12], [0.75])}
