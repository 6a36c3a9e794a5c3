"""Reading a recipe: YAML (a repeated key refused) plus `key.sub=value` overrides, validated into the schema with
errors that name the key; and its dumps (resolved YAML, flat tables for trackers)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from toolkit.builtin.models import TINY_MODEL
from toolkit.config.schema import Recipe
from toolkit.errors import ToolkitError

DEFAULT_RECIPE: dict[str, Any] = {
    "output_dir": "outputs/demo",
    "model": {"name_or_path": TINY_MODEL},
    "lora": {"r": 8, "alpha": 16},
    "data": {"max_seq_len": 256},
    "stages": [
        {"name": "warmup_short", "data": ["dummy:stage1"], "lr": 1e-2},
        {"name": "longer_multiturn", "data": ["dummy:stage2"], "lr": 5e-3},
    ],
    "train": {"micro_batch_size": 4, "grad_accum": 2},
    "logging": {"logging_steps": 1},
}
"""The embedded default: tiny local Qwen3, dummy data, a 2-stage curriculum. Runs anywhere."""


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (plain YAML silently keeps the last value)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"key '{key}' is given twice, on lines {seen[key]} and {line}: keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """Parse `a.b.c=value` strings; values are YAML scalars/lists (`lr=1e-4`, `target_modules=[q_proj]`)."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ToolkitError(f"Override '{item}' is not of the form key.sub=value (for example optimizer.lr=1e-4).")
        try:
            value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw else None
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e)
            raise ToolkitError(f"Override '{item}': the value is not valid YAML ({problem}). Quote strings with "
                               "YAML special characters, and close brackets: key=[a, b].") from None
        parsed.append((key.strip().split("."), value))
    return parsed


def _apply_override(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = tree
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                where = ".".join(path[: i + 1])
                raise ToolkitError(f"Override '{where}': index out of range (the list has {len(node)} items).")
            node = node[int(part)]
        else:
            if node.get(part) is None:  # absent, or an empty YAML section
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict | list):
                where = ".".join(path[: i + 1])
                raise ToolkitError(f"Override '{'.'.join(path)}': '{where}' is a value, not a section.")
    last = path[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ToolkitError(f"Override '{'.'.join(path)}': index out of range (the list has {len(node)} items).")
        node[int(last)] = value
    else:
        node[last] = value


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """Valid field names of the section at `loc` (for 'did you mean' hints)."""
    model: type[BaseModel] = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            break
        ann = info.annotation
        inner = getattr(ann, "__args__", (ann,))
        sub = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None:
            break
        model = sub
    return list(model.model_fields)


def _is_union_tag(part: Any) -> bool:
    """Pydantic names the member of a union it tried in the error's location ('str', 'DataSource',
    "literal['all-linear']"); recipe keys are lower-case names or list indices."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in ("str", "int", "float", "bool"))


def _key_errors(err: ValidationError) -> list[dict[str, Any]]:
    """The errors with union members dropped from their locations; of the alternatives a union produced for one
    key, only those that went deepest (`{path, weight: 0}` is a bad weight, not 'not a string')."""
    errors = [e | {"loc": tuple(p for p in e["loc"] if not _is_union_tag(p))} for e in err.errors()]
    return [e for e in errors if not any(len(o["loc"]) > len(e["loc"]) and o["loc"][:len(e["loc"])] == e["loc"]
                                         for o in errors)]


def _explain(err: ValidationError, source: str) -> ToolkitError:
    lines = []
    for e in _key_errors(err):
        loc = e["loc"]
        key = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _fields_at(loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), valid, n=3, cutoff=0.5)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            lines.append(f"unknown key '{key}'.{hint} Valid keys here: {', '.join(valid)}.")
        elif e["type"] == "missing":
            lines.append(f"'{key}' is required.")
        elif not loc:  # a check across sections: its message names the keys; the input is the whole recipe
            lines.append(f"{e['msg'].removeprefix('Value error, ')}.")
        else:
            lines.append(f"'{key}': {e['msg']} (got {e.get('input')!r}).")
    return ToolkitError(f"Invalid recipe {source}: " + " ".join(lines))


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe from YAML (or the embedded default when `path` is None) and apply overrides."""
    if path is None:
        tree: dict[str, Any] = yaml.safe_load(yaml.safe_dump(DEFAULT_RECIPE))
        source = "(embedded default)"
    else:
        path = Path(path)
        if path.is_dir():
            raise ToolkitError(f"--config {path} is a directory; pass a recipe YAML file (e.g. recipes/smoke.yaml).")
        if not path.is_file():
            raise ToolkitError(f"Recipe file {path} does not exist. Pass an existing YAML file to --config.")
        try:
            tree = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
        except UnicodeDecodeError as e:
            raise ToolkitError(f"Recipe file {path} is not UTF-8 text (byte offset {e.start}).") from None
        except _DuplicateKey as e:
            raise ToolkitError(f"Recipe file {path}: {e}.") from None
        except yaml.YAMLError as e:
            raise ToolkitError(f"Recipe file {path} is not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(tree, dict):
            raise ToolkitError(f"Recipe file {path} must hold a mapping of keys at the top level.")
        source = str(path)
    for keys, value in parse_overrides(overrides or []):
        _apply_override(tree, keys, value)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise _explain(e, source) from None


def flat_config(recipe: Recipe) -> dict[str, Any]:
    """The recipe as flat `section.key` scalars, for experiment trackers' hyperparameter tables."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(f"{prefix}.{i}", v)
        else:
            flat[prefix] = node if isinstance(node, int | float | str | bool) else str(node)

    walk("", recipe.model_dump(mode="json"))
    return flat


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe (defaults filled in), as saved next to the run's outputs."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
