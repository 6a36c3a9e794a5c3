"""Which parameters train in which stage: per-stage `trainable` lists resolved against the model.

An entry is the keyword `lora` (the LoRA adapters and `lora.modules_to_save`; LoRA runs only) or a name pattern:
a run of whole dotted components (`visual.merger` matches `model.visual.merger.mlp.0.weight`, not
`model.visual.merger_x.weight`), or a glob (`*.bias`, `model.layers.1[01].*`) matched against the full name or any
suffix/prefix run of it.

With LoRA, a pattern names whole modules, and they train in full as PEFT `modules_to_save`: the saved adapter then
carries their trained weights and `PeftModel.from_pretrained` restores them (a base parameter trained in place would
be silently missing from the adapter). Such a module trains only in the stages that name it. Without LoRA, patterns
select parameters directly and the default is every parameter.

Every parameter that trains in any stage is handed to the optimizer once, in one param group per *signature* (the
tuple of stages it trains in); `freezer.StageFreezer` then keeps the groups a stage freezes bit-identical, with
their Adam state untouched, under every strategy.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from toolkit.config.schema import LORA_KEYWORD
from toolkit.errors import ToolkitError
from toolkit.strategies.deepspeed import full_numel

_GLOB = frozenset("*?[")


def matches(name: str, pattern: str) -> bool:
    """True when `pattern` names `name`: a run of whole dotted components of it, or a glob over it or a run of it."""
    if _GLOB & set(pattern):
        return any(fnmatch.fnmatchcase(name, p) for p in (pattern, f"*.{pattern}", f"{pattern}.*", f"*.{pattern}.*"))
    return f".{pattern}." in f".{name}."


def _component_runs(names: Iterable[str], length: int) -> set[str]:
    runs = set()
    for name in names:
        parts = name.split(".")
        runs.update(".".join(parts[i:i + length]) for i in range(len(parts) - length + 1))
    return runs


def _no_match_error(key: str, pattern: str, what: str, names: list[str], model: torch.nn.Module) -> ToolkitError:
    """Name the key and pattern, and list the closest real names (whole runs of components, same length)."""
    close = difflib.get_close_matches(pattern, sorted(_component_runs(names, pattern.count(".") + 1)), n=5,
                                      cutoff=0.5)
    hint = f" Close names: {', '.join(close)}." if close else f" Some {what} names: {', '.join(names[:5])}."
    return ToolkitError(f"{key}: '{pattern}' matches no {what} of {type(model).__name__}.{hint} "
                        "Patterns are whole dotted name components (e.g. visual.merger) or globs (e.g. *.bias).")


def _patterns(entries: Sequence[str]) -> list[str]:
    return [e for e in entries if e != LORA_KEYWORD]


def modules_to_train(model: torch.nn.Module, stage_entries: Sequence[Sequence[str] | None],
                     keys: list[str]) -> list[str]:
    """LoRA runs: the outermost modules named by the stages' patterns, to be made PEFT `modules_to_save`.

    Call on the base model, before LoRA is applied. `keys` names each stage's setting for error messages.
    """
    names = [n for n, _ in model.named_modules() if n]
    chosen: list[str] = []
    for entries, key in zip(stage_entries, keys, strict=True):
        for pattern in _patterns(entries or []):
            hits = [n for n in names if matches(n, pattern)]
            if not hits:
                raise _no_match_error(key, pattern, "module", names, model)
            chosen += [n for n in hits if not any(n.startswith(f"{h}.") for h in hits)]  # outermost only
    return list(dict.fromkeys(chosen))


@dataclass(frozen=True)
class TrainablePlan:
    """Per-stage trainable parameter names, the optimizer groups by signature, and per-stage counts."""

    stage_names: list[frozenset[str]]
    groups: list[tuple[tuple[bool, ...], list[str]]]  # (trains in stage i?, parameter names), in model order
    stage_counts: list[int]  # trainable elements per stage (ZeRO-3 partitioned parameters counted in full)

    def param_groups(self, model: torch.nn.Module) -> list[dict[str, list[torch.nn.Parameter]]]:
        """Optimizer param groups, one per signature, in the order of `groups`."""
        params = dict(model.named_parameters())
        return [{"params": [params[n] for n in names]} for _, names in self.groups]


def plan_trainable(model: torch.nn.Module, stage_entries: Sequence[Sequence[str] | None], keys: list[str], *,
                   lora: bool) -> TrainablePlan:
    """Resolve each stage's `trainable` entries (None = the default) and set `requires_grad` on their union.

    With LoRA, call after `apply_lora` with the modules from `modules_to_train` among its `modules_to_save`:
    candidates are then the parameters PEFT left trainable. Without LoRA every parameter is a candidate.
    """
    named = list(model.named_parameters())
    candidates = [n for n, p in named if p.requires_grad or not lora]
    every = [e for entries in stage_entries for e in (entries or [])]
    owned = {n for n in candidates if any(matches(n, p) for p in _patterns(every))}  # trained by patterns only
    if lora:
        clash = sorted(n for n in owned if "lora_" in n)
        if clash:
            raise ToolkitError(f"trainable patterns name modules that LoRA adapts ({clash[0]}, ...): train them "
                               "through 'lora', or keep LoRA out of them with lora.exclude_modules.")
    sets = []
    for entries, key in zip(stage_entries, keys, strict=True):
        if entries is None:
            sets.append(frozenset(n for n in candidates if n not in owned) if lora else frozenset(candidates))
            continue
        chosen = {n for n in candidates if n not in owned} if LORA_KEYWORD in entries else set()
        for pattern in _patterns(entries):
            hits = {n for n in owned if matches(n, pattern)}
            if not hits:
                raise _no_match_error(key, pattern, "trainable parameter", candidates, model)
            chosen |= hits
        sets.append(frozenset(chosen))
    union = frozenset().union(*sets)
    for n, p in named:
        p.requires_grad_(n in union)
    by_signature: dict[tuple[bool, ...], list[str]] = {}
    for n, _ in named:
        if n in union:
            by_signature.setdefault(tuple(n in s for s in sets), []).append(n)
    numel = {n: full_numel(p) for n, p in named}
    return TrainablePlan(stage_names=sets, groups=list(by_signature.items()),
                         stage_counts=[sum(numel[n] for n in s) for s in sets])
