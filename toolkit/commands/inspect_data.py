"""`toolkit inspect-data`: what the model will see and learn from a recipe's data, before any training.

Reads each stage through training's own function (`toolkit.data.stages.load_stage`: the entries with their split and
columns, chat template, data.thinking, over-length policy, image tokens for vision-language models) and prints
training's line of counts for it, token statistics, and the first kept rows with the trained tokens marked, each
named by its place in its file (`file:line`, `file row N`). The first thing to run on new data.

`toolkit inspect-data FILE`, with no recipe, reads one file the same way under the built-in model (its family's stock
template; the tiny Qwen2.5-VL when the rows carry images): each refusal that carries its fix (the data entry's
columns, tags, ignore: toolkit/data/shapes.py ShapeError) is applied and the file read again, as the user would,
and the report ends with the data entry to paste into a recipe and why each key is there. A file no shape fits is
refused with the keys found and the closest shapes. A file of preference pairs is read as a preference stage's:
each pair shown as its prompt once, then its chosen and rejected completions, each with its trained tokens marked.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from toolkit.builtin.dummy_data import DUMMY_PREFIX, write_dummy_files
from toolkit.config.schema import DataEntry, Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.encoding import IGNORE_INDEX, PAIR_IN_SFT
from toolkit.data.pairs import pair_shape
from toolkit.data.plan import PairRows, StageRows, TrainingSet
from toolkit.data.prompts import prompt_set
from toolkit.data.sources import resolve_source
from toolkit.data.stages import load_stage, run_stores, stage_summary, tokenized_cache_dir, unread_keys_summary
from toolkit.errors import ToolkitError, as_terminal_text
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
    return as_terminal_text("".join([*out, tokenizer.decode(pending)]))  # row text, shown as text (cat -v)


def stage_statistics(src: TrainingSet) -> str:
    """Token counts per kept row (after the length policy, before packing) and the share of tokens trained; per
    pair (both sides) for a preference stage."""
    parts = src.samples.parts if isinstance(src.samples, StageRows) else []
    lengths = np.concatenate([p.selection.lengths for p in parts] + [np.zeros(0, np.int64)])
    trained = np.concatenate([p.selection.label_tokens for p in parts] + [np.zeros(0, np.int64)])
    lengths, trained = (lengths, trained) if len(lengths) else (np.zeros(1, np.int64), np.zeros(1, np.int64))
    share = trained.sum() / max(lengths.sum(), 1)
    unit = "pair" if src.stats.pairs else "row"
    return (f"tokens per {unit}: p50 {int(np.percentile(lengths, 50))}, p90 {int(np.percentile(lengths, 90))}, "
            f"max {int(lengths.max())}; trained per {unit}: p50 {int(np.percentile(trained, 50))}, "
            f"max {int(trained.max())}; {share:.1%} of tokens trained")


def mark_pair(chosen: dict[str, Any], rejected: dict[str, Any], tokenizer: Any, *, colour: bool) -> list[str]:
    """A pair as lines: its shared prompt once, then the chosen and the rejected completion, trained tokens marked
    as `mark_trained` marks them."""
    cut = next((i for i, y in enumerate(chosen["labels"]) if y != IGNORE_INDEX), len(chosen["labels"]))
    special = set(tokenizer.all_special_ids)
    lines = ["prompt:", _decode(chosen["input_ids"][:cut], tokenizer, special)]
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        lines += [f"{name}:", mark_trained(side["input_ids"][cut:], side["labels"][cut:], tokenizer, colour=colour)]
    return lines


def video_lines(sample: dict[str, Any], merge: int, where: str, save_frames: Path | None) -> list[str]:
    """A row's videos as the model sees them: frames, the fps they were sampled at (of the file's fps), their size
    and tokens per frame pair, from the frame store; with `save_frames`, each frame written there as a PNG."""
    from PIL import Image

    from toolkit.data.vision import VIDEO_REF

    lines = []
    refs = [(r, g) for r, g in zip(sample.get("images", []), sample.get("image_grid_thw", []), strict=True)
            if r.startswith(VIDEO_REF)]
    for k, (ref, grid) in enumerate(refs):
        folder = Path(ref.removeprefix(VIDEO_REF))
        meta = json.loads((folder / "meta.json").read_text())
        h, w = meta["size"]
        per_pair = grid[1] * grid[2] // merge
        lines.append(f"  video {k}: {meta['source']}: {meta['frames']} frames at {meta['sampled_fps']:.3g} fps (of "
                     f"{meta['total_frames']} at {meta['fps']:.3g} fps; frames {meta['indices']}), {w}x{h} px, "
                     f"{per_pair} tokens per frame pair, {grid[0] * per_pair} tokens")
        if save_frames is not None:
            save_frames.mkdir(parents=True, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", where)
            for j, frame in enumerate(np.load(folder / "frames.npy", mmap_mode="r")):
                Image.fromarray(np.array(frame)).save(save_frames / f"{stem}-video{k}-frame{j:03d}.png")
    return lines


def _shown_rows(parts: list[Any], rows: int, tokenizer: Any, colour: bool, scored: Any, merge: int = 4,
                save_frames: Path | None = None) -> list[str]:
    """The first `rows` kept rows (pairs, for a preference stage), each named by its place in its file; a video
    row's videos described (`video_lines`)."""
    lines = []
    shown = ((p, k) for p in parts for k in range(len(p.selection.index)))
    for part, k in itertools.islice(shown, rows):
        i = int(part.selection.index[k])
        if isinstance(part, PairRows):
            chosen, rejected = part.sides(k)
            full = max(int(part.store.lengths[2 * i]), int(part.store.lengths[2 * i + 1]))
            cut = f", truncated from {full}" if full > part.selection.limit else ""
            lines += [f"--- {as_terminal_text(part.store.where(2 * i))} (pair: {len(chosen['input_ids'])} + "
                      f"{len(rejected['input_ids'])} tokens{cut}) ---",
                      *mark_pair(chosen, rejected, tokenizer, colour=colour)]
            continue
        sample = part.store.sample(i, part.selection.limit)
        full = int(part.store.lengths[i])
        cut = f", truncated from {full}" if full > part.selection.limit else ""
        where = part.store.where(i)
        score = f", {scored[0]} {scored[1][where]:.4g}" if scored and where in scored[1] else ""
        lines += [f"--- {as_terminal_text(where)} ({len(sample['input_ids'])} tokens{cut}{score}) ---",
                  *video_lines(sample, merge, where, save_frames),
                  mark_trained(sample["input_ids"], sample["labels"], tokenizer, colour=colour)]
    return lines


def describe_entry(entry: DataEntry, weight: float | None) -> str:
    """A data entry as the recipe gives it: path, split, column mapping, tags, ignored keys, mixture weight."""
    extras = ([f"split {entry.split}"] if entry.split else []) + \
        ([f"columns {', '.join(f'{ours}: {theirs}' for ours, theirs in entry.columns)}"] if entry.columns else []) + \
        ([f"tags {', '.join(f'{tag}: {name}' for tag, name in entry.tags)}"] if entry.tags else []) + \
        ([f"ignore {', '.join(entry.ignore)}"] if entry.ignore else []) + \
        ([f"weight {weight:g}"] if weight is not None else [])
    return entry.name + (f" ({'; '.join(extras)})" if extras else "")


def inspect_data(recipe: Recipe, *, stage: str | None, rows: int, colour: bool | None = None,
                 pairs: bool = False, save_frames: Path | None = None) -> str:
    """The report as text (colour: ANSI colour for trained tokens; default when stdout is a terminal). A
    preference stage's rows are pairs, shown as their prompt once and each completion marked; `pairs` reads every
    stage so (a pair file given alone, `inspect_file`). A shown video row lists its videos' frames (count, sampled
    fps, size, tokens per frame pair); `save_frames` writes them there as PNGs.

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
        if pairs:
            stages = [replace(st, objective="dpo") if st.objective == "sft" else st for st in stages]
        stores = run_stores(stages, recipe.data, tokenizer, processor if vision else None, dummy_dir,
                            tokenized_cache_dir(recipe.data.cache_dir, recipe.output_dir))
        lines = [f"model {recipe.model.name_or_path}; trained tokens "
                 f"{'in green' if colour else f'between {OPEN} and {CLOSE}'}; data.thinking: {recipe.data.thinking}"]
        for st in stages:
            if stage is not None and st.name != stage:
                continue
            weights = st.weights or [None] * len(st.entries)
            if st.prompts:  # an RL stage: its prompts as the rollout sees them, and their references
                lines += _prompt_stage(st, recipe, tokenizer, dummy_dir, weights, rows)
                continue
            src = load_stage(st, recipe.data, stores)
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
            merge = processor.image_processor.merge_size ** 2 if vision else 4
            lines += _shown_rows(parts, rows, tokenizer, colour, _scores(layout, st.name), merge, save_frames)
    return "\n".join(lines)


def _prompt_stage(st: Any, recipe: Recipe, tokenizer: Any, dummy_dir: Path, weights: list[Any], rows: int
                  ) -> list[str]:
    """An RL stage's report: training's data line (`prompt_set`), then its first `rows` prompts as the rollout
    feeds them (chat template and generation prompt applied), each with its reference and the columns its rewards
    get."""
    src = prompt_set(st, [resolve_source(e, dummy_dir) for e in st.entries], tokenizer, thinking=recipe.data.thinking)
    lines = ["", f"=== stage '{st.name}' "
                 f"({', '.join(describe_entry(e, w) for e, w in zip(st.entries, weights, strict=True))}) ===",
             stage_summary(st, src, recipe.data)]
    special = set(tokenizer.all_special_ids)
    for sample in list(src.samples)[:rows]:
        lines += [f"--- {sample['where']} (prompt: {len(sample['prompt_ids'])} tokens) ---",
                  _decode(sample["prompt_ids"], tokenizer, special),
                  f"reference: {sample['reference']!r}" if sample["reference"] is not None else "reference: none"]
        if sample["columns"]:
            lines.append(f"columns for the rewards: {', '.join(sorted(sample['columns']))}")
    return lines


def _scores(layout: RunLayout, stage: str) -> tuple[str, dict[str, float]] | None:
    """(measure, row -> score) from `toolkit score`'s file of the stage (`<output_dir>/scores/<stage>.parquet`),
    None when there is none."""
    import pyarrow.parquet as pq

    path = layout.stage_scores(stage)
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


MAX_FIXES = 6
"""Refusals with a fix `inspect_file` applies before it gives up (each names other keys)."""
VISION_WORDS = ("needs a vision-language model", "a vision-language model reads it")
"""What the text model's refusal of an image row says (toolkit/data/encoding.py): read with the VL model instead."""


def entry_tree(entry: DataEntry) -> dict[str, Any] | str:
    """A data entry as a recipe writes it: the bare path, or {path, columns, tags, ignore} where any is set."""
    tree: dict[str, Any] = {"path": entry.path}
    tree.update({k: dict(v) for k, v in (("columns", entry.columns), ("tags", entry.tags)) if v})
    if entry.ignore:
        tree["ignore"] = list(entry.ignore)
    if entry.threads:
        tree["threads"] = entry.threads
    return tree if len(tree) > 1 else str(entry.path)


def file_recipe(entry: DataEntry, overrides: list[str], folder: Path, *, vision: bool) -> Recipe:
    """The embedded default recipe with one stage on `entry`, the built-in model (text, or VL for image rows),
    max_seq_len 4096, token stores in memory and its output in `folder`; then the user's overrides."""
    from toolkit.builtin.models import TINY_MODEL, TINY_VL_MODEL
    from toolkit.config.load import DEFAULT_RECIPE, load_recipe

    tree = json.loads(json.dumps(DEFAULT_RECIPE))
    tree.update(output_dir=str(folder / "run"), model={"name_or_path": TINY_VL_MODEL if vision else TINY_MODEL},
                data={"max_seq_len": 4096, "cache_dir": "none"},
                stages=[{"name": Path(str(entry.path)).stem or "data", "data": [entry_tree(entry)]}])
    path = folder / "inspect-file.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return load_recipe(path, overrides)


def _first_row(path: str) -> Any:
    """The file's first row as stored (before any shape is read): an object, a bare list, or a table row."""
    from toolkit.data.sources import open_source, resolve_source

    source = resolve_source(DataEntry(path), Path())
    if source.fmt == "jsonl":
        with source.files[0].open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    return json.loads(line)
        return {}
    open_source(source)
    if source.tables:
        return source.tables[0][0] if len(source.tables[0]) else dict.fromkeys(source.tables[0].column_names)
    return source.arrays[0][0] if source.arrays and source.arrays[0] else {}


def _first_keys(path: str) -> list[str]:
    """The keys of the file's first row as stored, for a file no shape fits."""
    row = _first_row(path)
    return sorted(row) if isinstance(row, dict) else []


def _chat_shape(row: Any, entry: DataEntry) -> str | None:
    """The shape of a row whose chat is told by its values (toolkit/data/roles.py): a bare list of turns, or turns,
    exchanges, a message tree or a dialog in one string under a key no named shape has; or one message of a flat
    message export, whose file is rebuilt into trees."""
    from toolkit.data.roles import exchange_keys, flat_message, is_tree, is_turns

    if (flat := flat_message(row)) is not None:
        return f"a flat message export (one message per row, linked by '{flat[1]}'): rebuilt into message trees"
    if isinstance(row, list):
        return "a bare list of turns: the row's chat" if is_turns(row) else None
    if not isinstance(row, dict) or any(k in row for k in ("messages", "conversations")) or entry.columns:
        return None
    keys = [k for k, v in row.items() if is_turns(v) or is_tree(v)]
    if len(keys) != 1 or (keys[0] in ("prompt", "completion") and isinstance(row[keys[0]], list)):
        return None
    value = row[keys[0]]
    what = "a message tree" if is_tree(value) else "a dialog in one string" if isinstance(value, str) else \
        "exchanges" if all(isinstance(t, dict) and exchange_keys(t) for t in value) else "turns"
    return f"a chat under '{keys[0]}' ({what}, told by its values)"


def inspect_file(path: str, overrides: list[str], *, rows: int = 2, colour: bool | None = None,
                 save_frames: Path | None = None) -> str:
    """`toolkit inspect-data FILE`: the file read by training's own path (`inspect_data` on a one-stage recipe,
    `file_recipe`), each refusal's fix applied in turn, and the data entry that trains it, with why. A file that
    no fix reads is refused in one line: the keys found, the closest shapes and training's refusal."""
    from toolkit.data.shapes import ShapeError, closest_shapes, with_fix

    entry, why, vision, pairs = DataEntry(path), [], False, False
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(MAX_FIXES + 3):
            try:
                report = inspect_data(file_recipe(entry, overrides, Path(tmp), vision=vision), stage=None,
                                      rows=rows, colour=colour, pairs=pairs, save_frames=save_frames)
                break
            except ShapeError as e:
                if not e.fix:
                    raise _no_fit(path, e, closest_shapes) from None
                why.append(str(e))
                entry = with_fix(entry, e.fix)
            except ToolkitError as e:
                if not pairs and PAIR_IN_SFT in str(e):  # a pair file: read as a preference stage's
                    pairs = True
                    why.append("the rows are preference pairs: a stage trains them with objective: dpo (or orpo / "
                               "simpo), and reads them as pairs (docs/preference.md)")
                    continue
                if vision or not any(w in str(e) for w in VISION_WORDS):
                    raise  # a refusal that is not about the shape (a missing image, bad JSON) says it all
                vision = True
                why.append(f"{e} (read with the built-in vision-language model instead)")
        else:
            raise ToolkitError(f"{path}: still refused after {MAX_FIXES} fixes: {why[-1]}")
    entry_lines = yaml.safe_dump({"data": [entry_tree(entry)]}, sort_keys=False, default_flow_style=None).rstrip()
    keys: list[str] = []
    first: Any = {}
    with contextlib.suppress(ToolkitError, OSError, ValueError):
        first = _first_row(path)
        theirs = {t: ours for ours, t in entry.columns}
        keys = [theirs.get(k, k) for k in (sorted(first) if isinstance(first, dict) else [])
                if k not in entry.ignore]
    shape = _chat_shape(first, entry) or next(iter(closest_shapes(keys)), "none of the named shapes' keys")
    if pairs and (named := pair_shape(keys)) is not None:
        shape = f"preference pairs, {named[0]}: {', '.join(named[1])}"
    lines = [report, "", f"shape: {shape}", *_column_roles(path), "data entry to paste into a recipe stage:",
             entry_lines]
    lines += ["why:"] + [f"  - {w}" for w in why] if why else ["why: the rows train as they are; no key to map."]
    return "\n".join(lines)


def _column_roles(path: str) -> list[str]:
    """The role of each column of the file (its first file's), inferred once from its first rows as training's
    reader infers them (`toolkit.data.sources.file_roles_of`): one line, or none for a file of no columns."""
    from toolkit.data.roles import SAMPLE_ROWS
    from toolkit.data.sources import file_roles_of, resolve_source

    roles: dict[str, str] = {}
    with contextlib.suppress(ToolkitError, OSError, ValueError):
        roles = file_roles_of(resolve_source(DataEntry(path), Path()), 0)
    said = ", ".join(f"{k}: {'no role the vocabulary names' if r == 'unknown' else r}" for k, r in roles.items())
    return [f"column roles (inferred once, from the first {SAMPLE_ROWS} rows): {said}"] if said else []


def _no_fit(path: str, error: ToolkitError, closest: Any) -> ToolkitError:
    keys: list[str] = []
    with contextlib.suppress(ToolkitError, OSError, ValueError):  # the refusal below says what is wrong with it
        keys = _first_keys(path)
    near = closest(keys)
    return ToolkitError(f"{path}: no shape reads it as it is (keys found: {keys}; closest shapes: "
                        f"{'; '.join(near) if near else 'none'}). Training says: {error}")
