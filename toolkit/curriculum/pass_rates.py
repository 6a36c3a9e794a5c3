"""Which prompts an RL stage draws, from how often the model solves them: the state a checkpoint keeps.

* ``SuccessRates``: each prompt's running success rate (correct completions over completions drawn), and
  ``sample``: Kimi k1.5's prioritised sampling, prompts drawn without replacement in proportion to
  ``1 - success rate`` (a prompt never drawn counts as never solved). A pure function of the rates, the run's seed
  and the step, so every rank draws the same prompts and a resumed run draws what the first run would have.
* ``DrawCounts``: what DAPO's dynamic sampling drew and dropped (groups whose binary correctness is all equal;
  toolkit/train/grpo.py ``informative_groups``), counted over the stage.
* ``pass_rate_buckets``: how a batch's groups split between all wrong, mixed and all right (a metric).

Each has ``state_dict`` / ``load_state_dict`` of plain lists and numbers, for the checkpoint's JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toolkit.errors import ToolkitError


class SuccessRates:
    """Running success rates of a stage's ``num_prompts`` prompts."""

    def __init__(self, num_prompts: int) -> None:
        self.attempts = np.zeros(num_prompts, dtype=np.float64)
        self.successes = np.zeros(num_prompts, dtype=np.float64)

    def record(self, prompts: Sequence[int], correct: Sequence[float]) -> None:
        """Count completions: ``prompts[i]``'s completion was correct (1) or not (0); fractional scores count as
        that fraction of a success. Every rank records the whole global batch, so the rates agree everywhere."""
        if len(prompts) != len(correct):
            raise ValueError(f"{len(prompts)} prompts, {len(correct)} outcomes")
        index = np.asarray(prompts, dtype=np.int64)
        np.add.at(self.attempts, index, 1.0)
        np.add.at(self.successes, index, np.clip(np.asarray(correct, dtype=np.float64), 0.0, 1.0))

    @property
    def rates(self) -> np.ndarray:
        """Each prompt's success rate; NaN for a prompt never drawn."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.attempts > 0, self.successes / np.maximum(self.attempts, 1.0), np.nan)

    def weights(self) -> np.ndarray:
        """Kimi k1.5's sampling weights: ``1 - success rate``, 1 for a prompt never drawn."""
        rates = self.rates
        return np.where(np.isnan(rates), 1.0, 1.0 - rates)

    def sample(self, k: int, *, seed: int, step: int, draw: int = 0, among: np.ndarray | None = None) -> np.ndarray:
        """``k`` distinct prompts drawn in proportion to ``weights`` (prompts every completion of which was right
        come last, uniformly, only when fewer than ``k`` others have weight), from a generator seeded by
        (seed, step), and ``draw`` when above 0 (a step's later draws: dynamic sampling's): the same on every rank,
        and again after a resume. ``among``: the prompts that may be drawn (a stage's ``drop`` keeps; None: all)."""
        candidates = np.arange(len(self.attempts)) if among is None else np.asarray(among, dtype=np.int64)
        n = len(candidates)
        if not 0 < k <= n:
            raise ValueError(f"cannot draw {k} of {n} prompts")
        rng = np.random.default_rng([seed, step, draw] if draw else [seed, step])
        weights = self.weights()
        live = candidates[weights[candidates] > 0]
        if len(live) >= k:
            return rng.choice(live, size=k, replace=False, p=weights[live] / weights[live].sum())
        rest = candidates[weights[candidates] <= 0]
        return np.concatenate([rng.permutation(live), rng.choice(rest, size=k - len(live), replace=False)])

    def state_dict(self) -> dict[str, Any]:
        return {"attempts": self.attempts.tolist(), "successes": self.successes.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        attempts, successes = (np.asarray(state[k], dtype=np.float64) for k in ("attempts", "successes"))
        if attempts.shape != self.attempts.shape or successes.shape != self.successes.shape:
            raise ToolkitError(f"the checkpoint's success rates cover {len(attempts)} prompts but the stage has "
                               f"{len(self.attempts)}: its data changed since the checkpoint; resume with the same "
                               "data, or start the stage afresh.")
        self.attempts, self.successes = attempts, successes


@dataclass
class DrawCounts:
    """Dynamic sampling over a stage: groups drawn, and of them dropped (all right or all wrong), and the draws
    (rollouts) it took."""

    drawn: int = 0
    dropped: int = 0
    rollouts: int = 0

    def add(self, informative: Sequence[bool]) -> None:
        """One rollout's groups, each informative (kept) or not (dropped)."""
        self.rollouts += 1
        self.drawn += len(informative)
        self.dropped += sum(1 for keep in informative if not keep)

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn, "dropped": self.dropped, "rollouts": self.rollouts}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.drawn, self.dropped, self.rollouts = int(state["drawn"]), int(state["dropped"]), int(state["rollouts"])


def pass_rate_buckets(correct: Sequence[float], num_generations: int) -> dict[str, float]:
    """The fraction of a batch's groups (``num_generations`` consecutive completions) all wrong, mixed and all
    right by their binary correctness: ``pass_rate/zero``, ``pass_rate/mixed``, ``pass_rate/all``."""
    grouped = np.asarray(correct, dtype=np.float64).reshape(-1, num_generations) > 0.5
    groups = max(len(grouped), 1)
    right = grouped.all(axis=1)
    wrong = ~grouped.any(axis=1)
    return {"pass_rate/zero": float(wrong.sum()) / groups, "pass_rate/mixed": float((~right & ~wrong).sum()) / groups,
            "pass_rate/all": float(right.sum()) / groups}
