"""A user reward under TRL's contract, importable as an installed module would be
(`tests.helpers.user_rewards:vowel_share`): a score that differs between the samples of a random tiny model, so
every group has advantages to train on."""

from __future__ import annotations

from typing import Any


def vowel_share(completions: list[Any], **kwargs: Any) -> list[float]:
    """The share of the completion's letters that are vowels (conversational completions: the assistant turn)."""
    out = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        letters = [c for c in text.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return out
