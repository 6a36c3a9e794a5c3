"""`toolkit inspect-data`: what the model will see and learn from a recipe's data, before any training.

Reads each stage through training's own function (`toolkit.data.stages.load_stage`: the entries with their split and
columns, chat template, data.thinking, over-length policy, image tokens for vision-language models) and prints
training's line of counts for it, token statistics, and the first kept rows with the trained tokens marked, each
named by its place in its file (`file:line`, `file row N`). The first thing to run on new data.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.builtin.dummy_data import DUMMY_PREFIX, write_dummy_files
from toolkit.config.schema import DataEntry, Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.plan import StageRows, TrainingSet
from toolkit.data.stages import load_stage, run_stores, stage_summary, tokenized_cache_dir, unread_keys_summary
from toolkit.errors import ToolkitError
from toolkit.runtime.run_dir import RunLayout

GREEN, RESET = "\033[1;32m", "\033[0m"
OPEN, CLOSE = "[[", "]]"
REPEAT_MIN = 4  # runs of one special token this long (image pads) are shown as token x count


def mark_trained(ids: list[int], labels: list[int], tokenizer: Any, *, colour: bool) -> str:
    """The row's text with each run of trained tokens coloured (TTY) or put in [[ ]]."""
    special = set(tokenizer.all_special_ids)
    pieces, i = [], 0
    while i < len(ids):
        trained = labels[i] != IGNORE_INDEX
        j = i
        while j < len(ids) and (labels[j] != IGNORE_INDEX) == trained:
            j += 1
        text = _decode(ids[i:j], tokenizer, special)
        pieces.append((GREEN + text + RESET if colour else OPEN + text + CLOSE) if trained else text)
        i = j
    return "".join(pieces)


def _decode(ids: list[int], tokenizer: Any, special: set[int]) -> str:
    """Decoded text; a long run of one special token (image pads) is shown as `<|image_pad|>x64`."""
    out: list[str] = []
    pending: list[int] = []
    for token, group in itertools.groupby(ids):
        run = len(list(group))
        if token in special and run >= REPEAT_MIN:
            out += [tokenizer.decode(pending), f"{tokenizer.decode([token])}x{run}"]
            pending = []
        else:
            pending += [token] * run
    return "".join([*out, tokenizer.decode(pending)])


def stage_statistics(src: TrainingSet) -> str:
    """Token counts per kept row (after the length policy, before packing) and the share of tokens trained."""
    parts = src.samples.parts if isinstance(src.samples, StageRows) else []
    lengths = np.concatenate([p.selection.lengths for p in parts] + [np.zeros(0, np.int64)])
    trained = np.concatenate([p.selection.label_tokens for p in parts] + [np.zeros(0, np.int64)])
    lengths, trained = (lengths, trained) if len(lengths) else (np.zeros(1, np.int64), np.zeros(1, np.int64))
    share = trained.sum() / max(lengths.sum(), 1)
    return (f"tokens per row: p50 {int(np.percentile(lengths, 50))}, p90 {int(np.percentile(lengths, 90))}, "
            f"max {int(lengths.max())}; trained per row: p50 {int(np.percentile(trained, 50))}, "
            f"max {int(trained.max())}; {share:.1%} of tokens trained")


def describe_entry(entry: DataEntry, weight: float | None) -> str:
    """A data entry as the recipe gives it: path, split, column mapping, mixture weight."""
    extras = ([f"split {entry.split}"] if entry.split else []) + \
        ([f"columns {', '.join(f'{ours}: {theirs}' for ours, theirs in entry.columns)}"] if entry.columns else []) + \
        ([f"tags {', '.join(f'{tag}: {name}' for tag, name in entry.tags)}"] if entry.tags else []) + \
        ([f"weight {weight:g}"] if weight is not None else [])
    return entry.name + (f" ({'; '.join(extras)})" if extras else "")


def inspect_data(recipe: Recipe, *, stage: str | None, rows: int, colour: bool | None = None) -> str:
    """The report as text (colour: ANSI colour for trained tokens; default when stdout is a terminal).

    Each stage is read by training's own `load_stage` over the stores training opens (`run_stores`: the same
    encoder, chat template, entries with their split and columns, length policy and filters), so its counts are
    training's "stage 'x' data: ..." line. Only the tokenizer (and a VL model's processor) is loaded, never the
    weights. Token stores go to the run's data.cache_dir, which training would prepare the same stores into (it is
    beside the output dir, never in it), so the training run that follows opens them instead of tokenising again;
    dummy data training has not generated yet is written to a temporary folder, as is nothing in the output dir."""
    from toolkit.builtin.models import materialize_builtin
    from toolkit.model.load import is_vision_language, load_processing

    names = [s.name for s in recipe.stages]
    if stage is not None and stage not in names:
        raise ToolkitError(f"--stage {stage!r} is not a stage of the recipe; its stages are {names}.")
    if rows < 0:
        raise ToolkitError(f"--rows must be 0 or more, got {rows}.")
    colour = sys.stdout.isatty() if colour is None else colour
    layout = RunLayout(recipe.output_dir)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = materialize_builtin(recipe.model.name_or_path, layout.cache)  # where training puts it
        trust = recipe.model.trust_remote_code
        vision = is_vision_language(model_path, trust_remote_code=trust)
        processor, tokenizer = load_processing(model_path, vision=vision, trust_remote_code=trust,
                                               chat_template=recipe.data.chat_template)
        dummy_dir = _dummy_dir(recipe, Path(tmp), vision=vision)
        stages = resolve_stages(recipe)
        stores = run_stores(stages, recipe.data, tokenizer, processor if vision else None, dummy_dir,
                            tokenized_cache_dir(recipe.data.cache_dir, recipe.output_dir))
        lines = [f"model {recipe.model.name_or_path}; trained tokens "
                 f"{'in green' if colour else f'between {OPEN} and {CLOSE}'}; data.thinking: {recipe.data.thinking}"]
        for st in stages:
            if stage is not None and st.name != stage:
                continue
            src = load_stage(st, recipe.data, stores)
            weights = st.weights or [None] * len(st.entries)
            lines += ["", f"=== stage '{st.name}' "
                          f"({', '.join(describe_entry(e, w) for e, w in zip(st.entries, weights, strict=True))}) ===",
                      stage_summary(st, src, recipe.data)]
            if (unread := unread_keys_summary(st, stores)) is not None:
                lines.append(unread)
            if not len(src.samples):
                lines.append(f"training refuses this stage: Stage '{st.name}' has no usable rows.")
            parts = src.samples.parts if isinstance(src.samples, StageRows) else []
            if len(parts) > 1:  # per entry, in the stage's order
                lines += [f"  {describe_entry(e, w)}: {p.selection.stats.summary()}"
                          for e, w, p in zip(st.entries, weights, parts, strict=True)]
            lines.append(stage_statistics(src))
            scored = _scores(layout, st.name)
            shown = ((p, int(i)) for p in parts for i in p.selection.index)
            for part, i in itertools.islice(shown, rows):
                sample = part.store.sample(i, part.selection.limit)
                full = int(part.store.lengths[i])
                cut = f", truncated from {full}" if full > part.selection.limit else ""
                where = part.store.where(i)
                score = f", {scored[0]} {scored[1][where]:.4g}" if scored and where in scored[1] else ""
                lines += [f"--- {where} ({len(sample['input_ids'])} tokens{cut}{score}) ---",
                          mark_trained(sample["input_ids"], sample["labels"], tokenizer, colour=colour)]
    return "\n".join(lines)


def _scores(layout: RunLayout, stage: str) -> tuple[str, dict[str, float]] | None:
    """(measure, row -> score) from `toolkit score`'s file of the stage (`<output_dir>/scores/<stage>.parquet`),
    None when there is none."""
    import pyarrow.parquet as pq

    path = layout.scores / f"{stage}.parquet"
    if not path.is_file():
        return None
    table = pq.read_table(path).to_pydict()
    name = next((m for m in ("loss", "perplexity", "ifd") if m in table), None)
    return None if name is None else (name, dict(zip(table["row"], table[name], strict=True)))


def _dummy_dir(recipe: Recipe, tmp: Path, *, vision: bool) -> Path:
    """The run's dummy data when it was generated, else a fresh copy (the rows --create_dummy_data writes)."""
    run_dir = RunLayout(recipe.output_dir).dummy_data
    if not any(p.startswith(DUMMY_PREFIX) for s in recipe.stages for p in s.paths) or run_dir.is_dir():
        return run_dir
    fresh = RunLayout(tmp).dummy_data
    write_dummy_files(fresh, 64, seed=recipe.train.seed, vision=vision)
    return fresh
