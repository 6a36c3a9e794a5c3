"""Run metrics: one JSON object per logged step in `<output_dir>/metrics.jsonl`, written by rank 0 only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append-only JSONL writer; a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (for tests, plots and resume)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_after(path: Path, step: int) -> None:
    """Drop records after `step` (they are recomputed after a resume), so steps are neither missing nor doubled."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    tmp.replace(path)
