"""A run's report page: `<output_dir>/report.html`, one self-contained file (no network, opened by double-click).

It is drawn only from the files of the run's folder (run.json, recipe.yaml, metrics.jsonl, evals/, final/), so the
live run (rank 0 rewrites it after each evaluation, at each stage end and when the run ends, however it ends) and
`toolkit report` on a finished run, or on several runs side by side, give the same page. The page holds the data as
one JSON object and draws it in the browser with the small inline script of `report_assets/report.js` (SVG, no
library, no CDN): the stage timeline, the curves with a band per stage, the forgetting matrix as a heatmap with its
values in the cells, the completions by stage and step, the resolved recipe (diffed between runs) and the model
card.

Size: every logged step is kept, each value to 6 significant digits (a 10k-step run logged every step: about
0.8 MB). The browser draws each curve from at most four points per pixel column (first, lowest, highest, last:
the line looks the same), and the hover reads the kept value of the nearest logged step. Completions keep every
row; only their texts are shortened, evenly, when all of them together would pass `COMPLETIONS_BUDGET` characters
(the cut says so and names the file with the full text).
"""

from __future__ import annotations

import html
import json
import logging
import os
import stat
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from toolkit.atomic import write_text_atomic
from toolkit.config.schema import PreferenceConfig, RewardConfig, RlConfig, describe_objective
from toolkit.errors import ToolkitError
from toolkit.runtime.run_dir import RunLayout

log = logging.getLogger(__name__)

GENERATOR = "curriculum-toolkit report"
"""The page's `<meta name="generator">`: `toolkit report --out` replaces only a file that carries it."""

COMPLETIONS_BUDGET = 1_000_000
"""Characters of completion text (prompts, outputs, references) one page holds at most."""

MIN_TEXT = 200
"""The shortest a completion text is cut to, however many there are."""

TRAIN_PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"),
                ("tokens_per_sec", "tokens / s"), ("mfu", "MFU"), ("peak_memory_gb", "peak memory (GiB)"))
"""The train record keys drawn, in order, each in its own chart (any other numeric key of a train record, such as
a preference stage's rewards and accuracy, gets a chart of its own after them)."""

NOT_CURVES = {"step", "stage_index", "stage_step", "tokens", "samples", "skipped", "samples_per_sec", "step_time",
              "padding_fraction"}
"""Numeric keys of a train record that are counters or bookkeeping, not curves."""

EVAL_BOOKKEEPING = {"step", "stage_index", "eval_tokens", "eval_seconds", "eval_gen_seconds", "eval_ppl"}

MAX_CURVES = 64
"""Metric keys drawn per kind (train, eval) at most; the page names the rest. 12k distinct keys in a 0.2 MB
metrics file would otherwise make a 24 MB page (one series of every logged step per key)."""


def _text(value: str) -> str:
    """A file or folder name as text: bytes that are not UTF-8 (a Latin-1 folder name, which Python carries as
    lone surrogates) shown as U+FFFD, so the page can be written as UTF-8."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class _Reader:
    """Reads the files of one run folder and nothing outside it: a path any of whose components below the run's
    root is a link is not read (the page names it), so a `final/README.md -> ~/.ssh/id_ed25519` never reaches a
    page meant to be shared. The root itself may be reached through a link: that is the user's own naming."""

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout
        self.not_read: list[str] = []

    def ok(self, path: Path) -> bool:
        """Whether `path` is a regular file of the run, reached without a link."""
        try:
            rel = path.relative_to(self.layout.root)
        except ValueError:
            return False
        here = self.layout.root
        for part in rel.parts:
            here = here / part
            if here.is_symlink():
                name = _text(here.relative_to(self.layout.root).as_posix())  # the link itself
                if name not in self.not_read:
                    self.not_read.append(name)
                    log.warning("%s is a link: the report reads only the run folder's own files, never through "
                                "a link", here)
                return False
        return path.is_file()

    def text(self, path: Path) -> str | None:
        """The text of `path` (undecodable bytes replaced), or None if it is not a file of the run. Opened without
        following a link at its last component, so a link swapped in after the check is not followed either."""
        if not self.ok(path):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read().decode("utf-8", errors="replace")

    def records(self, path: Path) -> list[dict[str, Any]]:
        """The JSON-object records of a JSON Lines file of the run ([] if it is not one); a record whose step is
        not a whole number is left out, as are non-finite numbers (JSON's NaN / Infinity) by `_round` later."""
        text = self.text(path)
        if text is None:
            return []
        lines = text.splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        out = []
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if lineno == len(lines):
                    break  # the last line cut short by a crash
                raise ToolkitError(f"{path}:{lineno} is not a JSON record; the file was edited or damaged.") from None
            if isinstance(record, dict) and ("step" not in record or _whole(record["step"])):
                out.append(record)
        return out


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _round(value: Any) -> float | None:
    """A number to 6 significant digits (None for a missing or non-finite one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(f"{value:.6g}") if value == value and abs(value) != float("inf") else None


def _read_json(reader: _Reader, path: Path) -> dict[str, Any]:
    text = reader.text(path)
    try:
        value = json.loads(text) if text is not None else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _series(records: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    """{"steps": [...], "values": {key: [...]}} over `records`, values rounded (None where a record lacks one)."""
    return {"steps": [int(r["step"]) for r in records],
            "values": {k: [_round(r.get(k)) for r in records] for k in keys}}


def _numeric_keys(records: list[dict[str, Any]], skip: set[str]) -> list[str]:
    keys: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in skip and isinstance(v, int | float) and not isinstance(v, bool):
                keys[k] = None
    return list(keys)


def _source_name(entry: Any) -> tuple[str, float | None]:
    if isinstance(entry, dict):
        name = entry.get("path") or entry.get("dataset") or "?"
        return str(name), entry.get("weight")
    return str(entry), None


def _objective(cfg: dict[str, Any]) -> str:
    """A stage's objective as the model card names it (`describe_objective`: dpo's losses, beta and reference), from
    the recipe as the run folder keeps it; a stage the schema no longer reads is named by its objective alone."""
    objective = str(cfg.get("objective") or "sft")
    try:
        pref = PreferenceConfig.model_validate(cfg["preference"]) if cfg.get("preference") else None
        rl = RlConfig.model_validate(cfg["rl"]) if cfg.get("rl") else None
        rewards = [RewardConfig.model_validate(r) for r in cfg.get("rewards") or ()]
        return describe_objective(objective, pref, rl, rewards)
    except (ValueError, TypeError):
        return objective


def _timeline(run_json: dict[str, Any], recipe: dict[str, Any], records: list[dict[str, Any]]) -> list[dict]:
    """Each stage as planned (run.json), as it ran (its stage_end / early_advance records) and as the recipe sets
    it (mixture, order, trainable)."""
    plans = run_json.get("stages") or []
    stages_cfg = recipe.get("stages") or []
    ends = {r["stage_index"]: r for r in records if r.get("event") == "stage_end"}
    advances = {r["stage_index"]: r for r in records if r.get("event") == "early_advance"}
    entry_pass = {r["stage_index"]: r.get("seconds") for r in records if r.get("event") == "stage_entry_pass"}
    trained = [r for r in records if "loss" in r]
    last_step = max((int(r["step"]) for r in records), default=0)
    default_trainable = (recipe.get("train") or {}).get("trainable") or (
        ["lora"] if (recipe.get("lora") or {}).get("enabled", True) else ["all parameters"])
    count = max(len(plans), len(stages_cfg))
    out, start = [], 0
    for i in range(count):
        plan = plans[i] if i < len(plans) else {}
        cfg = stages_cfg[i] if i < len(stages_cfg) else {}
        end = ends.get(i)
        seen = [int(r["step"]) for r in trained if r.get("stage_index") == i]
        planned = plan.get("steps")
        if end is not None:
            steps, state = int(end["stage_steps"]), "done"
        elif seen:
            steps, state = max(seen) - start, "running"
        else:
            steps, state = 0, "waiting"
        mixture = [_source_name(d) for d in cfg.get("data") or []]
        objective = _objective(cfg)
        out.append({
            "index": i, "name": plan.get("name") or cfg.get("name") or f"stage {i}", "state": state,
            "start": start, "steps": steps, "planned": planned,
            "ended_by": end.get("ended_by") if end else None, "gate": end.get("gate") if end else None,
            "advance": advances.get(i), "samples": end.get("stage_samples") if end else None,
            "tokens": end.get("stage_tokens") if end else None,
            "trainable_params": end.get("trainable_params") if end else
            next(iter((run_json.get("trainable_params") or [])[i:i + 1]), None),
            "mixture": [{"source": s, "weight": w} for s, w in mixture], "objective": objective,
            "entry_pass_seconds": entry_pass.get(i),
            "order": cfg.get("order"), "pacing": cfg.get("pacing"),
            "trainable": cfg.get("trainable") or default_trainable,
            "lr": plan.get("lr", cfg.get("lr")), "schedule": plan.get("schedule", cfg.get("schedule")),
            "global_batch": plan.get("global_batch"), "advance_when": cfg.get("advance_when"),
            "patience": cfg.get("patience"),
            "generation": [g.get("name") for g in cfg.get("generation") or [] if isinstance(g, dict)],
        })
        # the next stage starts where this one ended; one not reached yet, where its plan ends
        start += steps if state == "done" else max(steps, planned or 0)
    if out and out[-1]["state"] == "running":
        out[-1]["steps"] = max(out[-1]["steps"], last_step - out[-1]["start"])
    return out


def _rollouts(reader: _Reader, recipe: dict[str, Any]) -> list[tuple[Path, int, str, list[dict[str, Any]]]]:
    """RL stages' completions (`rollouts/<stage>.jsonl`) as the generation evals' rows: per stage and step, each
    completion of each prompt's group (eval `rollout <stage>`, row: the prompt's index in the stage), its rewards
    by the stage's reward names (the recipe's) as scores, and its advantage."""
    folder = reader.layout.rollouts
    if not folder.is_dir():
        return []
    names: dict[str, list[str]] = {}
    for cfg in recipe.get("stages") or []:
        if isinstance(cfg, dict) and cfg.get("rewards"):
            try:
                names[str(cfg.get("name"))] = [RewardConfig.model_validate(r).metric for r in cfg["rewards"]]
            except (ValueError, TypeError):
                continue
    out = []
    for path in sorted(p for p in folder.glob("*.jsonl") if reader.ok(p)):
        try:
            records = [r for r in reader.records(path) if _whole(r.get("prompt", 0)) and "step" in r]
        except ToolkitError:
            records = []
        by_step: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for r in records:
            stage = str(r.get("stage", path.stem))
            rewards = r.get("rewards") if isinstance(r.get("rewards"), list) else []
            labels = names.get(stage) or [f"reward {i}" for i in range(len(rewards))]
            by_step.setdefault((int(r["step"]), stage), []).append({
                "eval": f"rollout {stage}", "row": int(r.get("prompt", 0)), "stage": stage,
                "prompt": r.get("prompt_text"), "where": r.get("where"), "reference": r.get("reference"),
                "output": r.get("completion", ""), "score": dict(zip(labels, rewards, strict=False)),
                "advantage": r.get("advantage")})
        out += [(path, step, stage, rows) for (step, stage), rows in by_step.items()]
    return out


def _completions(reader: _Reader, budget: int, recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every completions file of the run: the generation evals' (`evals/<stage>/step-N.jsonl`) and the RL stages'
    rollouts (`_rollouts`), prompts once, then each file's rows (texts cut evenly past `budget`)."""
    layout = reader.layout
    files = sorted(p for p in layout.evals.glob("*/step-*.jsonl") if reader.ok(p)) if layout.evals.is_dir() else []
    loaded = []
    for path in files:
        try:
            rows = [r for r in reader.records(path) if _whole(r.get("row", 0))]
        except ToolkitError:
            rows = []
        number = path.stem.removeprefix("step-")
        step = int(number) if number.isdigit() else 0
        stage = next((str(r["stage"]) for r in rows if "stage" in r), path.parent.name)
        loaded.append((path, step, stage, rows))
    loaded += _rollouts(reader, recipe or {})
    loaded.sort(key=lambda item: (item[1], item[2]))
    prompts: dict[tuple[str, int], dict[str, Any]] = {}
    for _, _, _, rows in loaded:
        for r in rows:
            key = (str(r.get("eval")), int(r.get("row", 0)))
            prompt = prompts.setdefault(key, {"eval": key[0], "row": key[1], "eval_stage": r.get("eval_stage"),
                                              "prompt": r.get("prompt"), "reference": r.get("reference")})
            if prompt["prompt"] is None:  # a rollout group's prompt rides on its first completion only
                prompt["prompt"], prompt["reference"] = r.get("prompt"), r.get("reference")
            prompt.setdefault("where", r.get("where"))
    for prompt in prompts.values():  # a rollout without its prompt's text (an older run): where the row is
        where = prompt.pop("where", None)
        prompt["prompt"] = str(prompt["prompt"] if prompt["prompt"] is not None else where or "")
    texts = [p["prompt"] for p in prompts.values()] + [str(p["reference"] or "") for p in prompts.values()] + [
        str(r.get("output", "")) for *_, rows in loaded for r in rows]
    total = sum(len(t) for t in texts)
    limit = max(MIN_TEXT, budget // max(len(texts), 1)) if total > budget else None

    def cut(text: str, where: str) -> str:
        if limit is None or len(text) <= limit:
            return text
        return f"{text[:limit]} [... {len(text) - limit} more characters in {where}]"

    ids = {key: i for i, key in enumerate(prompts)}
    where = "the eval's data"
    prompt_list = [{**p, "prompt": cut(p["prompt"], where),
                    "reference": None if p["reference"] is None else cut(str(p["reference"]), where)}
                   for p in prompts.values()]
    out_files = []
    for path, step, stage, rows in loaded:
        rel = _text(path.relative_to(layout.root).as_posix())
        out_files.append({"file": rel, "stage": stage, "step": step, "rows": [
            {"p": ids[(str(r.get("eval")), int(r.get("row", 0)))], "output": cut(str(r.get("output", "")), rel),
             "score": {k: _round(v) for k, v in (r.get("score") or {}).items()},
             **({"advantage": _round(r["advantage"])} if r.get("advantage") is not None else {})} for r in rows]})
    return {"prompts": prompt_list, "files": out_files, "cut_to": limit}


def _flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """`a.b.0.c: value` lines of a YAML tree (lists of scalars kept whole)."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, list) and any(isinstance(v, dict | list) for v in tree):
        out = {}
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): json.dumps(tree)}


def _capped(keys: list[str], dropped: list[str]) -> list[str]:
    """The first MAX_CURVES keys; the rest go to `dropped` (named on the page)."""
    dropped.extend(keys[MAX_CURVES:])
    return keys[:MAX_CURVES]


def read_run(folder: str | Path) -> dict[str, Any]:
    """What the page shows of the run in `folder`, from its own files only (see _Reader: never through a link)."""
    layout = RunLayout(folder)
    reader = _Reader(layout)
    if not layout.root.is_dir() or not (reader.ok(layout.run_json) or reader.ok(layout.metrics)):
        raise ToolkitError(f"{_text(str(folder))} is not a run's output dir: it holds no run.json or metrics.jsonl "
                           "of its own (a link is not followed). Give the output_dir of a training run.")
    run_json = _read_json(reader, layout.run_json)
    recipe_text = reader.text(layout.recipe) or ""
    try:
        recipe = yaml.safe_load(recipe_text) or {}
    except yaml.YAMLError:
        recipe = {}
    if not isinstance(recipe, dict):
        recipe = {}
    records = reader.records(layout.metrics)
    train = [r for r in records if "loss" in r and "step" in r]
    evals = [r for r in records if "step" in r and "loss" not in r and "event" not in r]
    dropped: list[str] = []
    train_keys = _capped([k for k, _ in TRAIN_PANELS] + [k for k in _numeric_keys(train, NOT_CURVES)
                                                         if k not in dict(TRAIN_PANELS)], dropped)
    eval_keys = _capped(_numeric_keys(evals, EVAL_BOOKKEEPING), dropped)
    # the matrix keeps its values whole: it is small (stages x evals x metrics), and its cells are the numbers a
    # reader compares across runs (a resumed run's page must equal the uninterrupted one's)
    matrix = [{"step": int(r["step"]), "stage": r.get("stage"), "eval_stage": r.get("eval_stage"),
               "eval": r.get("eval"), "metric": r.get("metric"), "value": float(r["value"])}
              for r in reader.records(layout.eval_matrix) if "step" in r and _round(r.get("value")) is not None]
    card = reader.text(layout.model_card)
    return {
        "name": _text(layout.root.resolve().name), "path": _text(str(layout.root.resolve())),
        "run": {k: run_json.get(k) for k in ("run_name", "strategy", "num_processes", "effective_batch",
                                             "mixed_precision", "versions")},
        "finished": card is not None or (layout.final.is_dir() and not layout.final.is_symlink()),
        "last_step": max((int(r["step"]) for r in records if "step" in r), default=0),
        "skipped": sum(int(r.get("skipped") or 0) for r in train if _whole(r.get("skipped") or 0)),
        "stages": _timeline(run_json, recipe, [r for r in records if "step" in r]),
        "train": _series(train, train_keys), "eval": _series(evals, eval_keys), "dropped_keys": dropped,
        "matrix": matrix, "completions": _completions(reader, COMPLETIONS_BUDGET, recipe),
        "recipe": recipe_text, "recipe_flat": _flatten(recipe),
        "card": card, "not_read": reader.not_read,
    }


def _asset(name: str) -> str:
    return resources.files("toolkit.metrics").joinpath("report_assets", name).read_text(encoding="utf-8")


def render(runs: list[dict[str, Any]]) -> str:
    """The page of `runs` (one run, or several side by side), as one HTML document."""
    title = " vs ".join(r["name"] for r in runs)
    data = json.dumps({"runs": runs}, separators=(",", ":"), allow_nan=False)
    data = data.replace("<", "\\u003c")  # still JSON, and never `</script>` or `<!--` inside the <script> element
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="generator" content="{GENERATOR}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}: curriculum report</title>\n<style>{_asset('report.css')}</style></head>\n"
            f'<body><noscript>This page draws its charts with JavaScript: allow it for this file.</noscript>\n'
            f'<main id="app"></main>\n<script type="application/json" id="report-data">{data}</script>\n'
            f"<script>{_asset('report.js')}</script>\n</body></html>\n")


def write_report(output_dir: str | Path) -> Path:
    """Rewrite `<output_dir>/report.html` from the run's files (atomically: a browser never reads half a page)."""
    layout = RunLayout(output_dir)
    write_text_atomic(layout.report, render([read_run(layout.root)]))
    return layout.report


def refresh_report(layout: RunLayout) -> None:
    """The live run's rewrite (rank 0): the page is a view of the run, so failing to draw it is a warning in the
    log, never the end of a training run."""
    try:
        write_report(layout.root)
    except Exception as e:  # a view must not stop hours of training; the warning names what went wrong
        log.warning("report.html was not updated: %s: %s", type(e).__name__, e)


def is_report(path: Path) -> bool:
    """Whether `path` is a page this module wrote (so `--out` may replace it)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            head = f.read(600)
    except OSError:
        return False
    return f'<meta name="generator" content="{GENERATOR}">' in head


def report(runs: list[str | Path], out: str | Path | None = None) -> Path:
    """`toolkit report`: the page of one run (default: its own report.html) or of several side by side (`out`
    needed). An existing `out` is replaced only if it is such a page."""
    if not runs:
        raise ToolkitError("toolkit report needs at least one run's output dir.")
    if out is None:
        if len(runs) > 1:
            raise ToolkitError(f"{len(runs)} runs side by side need --out FILE (each run's own report.html shows "
                               "that run alone).")
        target = RunLayout(runs[0]).report
    else:
        target = Path(out)
        if target.is_dir():
            raise ToolkitError(f"--out {out} is a folder; name the HTML file to write, e.g. {out}/report.html.")
        if target.exists() and not is_report(target):
            raise ToolkitError(f"--out {out} exists and is not a report page of the toolkit; name a new file (it is "
                               "not replaced).")
    data = [read_run(r) for r in runs]  # every run read (and refused if it is none) before anything is written
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, render(data))
    return target
