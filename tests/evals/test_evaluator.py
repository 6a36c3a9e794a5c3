"""An eval's completions reach the trackers: W&B gets a table of every row (TensorBoard's text is read back from a
real run in tests/e2e/test_steering.py). W&B itself is not installed here: a stand-in records what reaches its API."""

from __future__ import annotations

import json
from typing import Any

from toolkit.evals.evaluator import completions_to_trackers
from toolkit.runtime import process as distributed


class WandbStandIn:
    """What accelerate's WandBTracker offers the toolkit: its name and `log_table`."""

    name = "wandb"

    def __init__(self) -> None:
        self.tables: list[dict[str, Any]] = []

    def log_table(self, table_name: str, columns: list[str], data: list[list[Any]], step: int) -> None:
        self.tables.append({"table_name": table_name, "columns": columns, "data": data, "step": step})


def test_completions_go_to_a_wandb_table() -> None:
    accelerator = distributed.build_accelerator(1, 10)
    wandb = WandbStandIn()
    accelerator.trackers.append(wandb)
    try:
        lines = [{"eval": "facts", "eval_stage": "learn", "row": i, "where": f"e.jsonl:{i + 1}", "prompt": f"Q{i}|",
                  "output": "blue\nred", "reference": "blue", "score": {"exact": float(i == 0)}} for i in range(40)]
        completions_to_trackers(accelerator, "learn", 6, lines)
    finally:
        accelerator.trackers.remove(wandb)
    [table] = wandb.tables
    assert (table["table_name"], table["step"]) == ("completions/learn", 6)
    assert table["columns"] == ["eval", "row", "prompt", "output", "reference", "score"]
    assert len(table["data"]) == 40  # every row (TensorBoard's text shows the first 32)
    assert table["data"][0] == ["facts", 0, "Q0|", "blue\nred", "blue", json.dumps({"exact": 1.0})]
