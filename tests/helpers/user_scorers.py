"""A user scorer importable as an installed module would be (`tests.helpers.user_scorers:length_ratio`)."""

from __future__ import annotations

from typing import Any


def length_ratio(output: str, reference: Any, row: dict[str, Any]) -> float:
    return len(output) / max(len(reference), 1)
