"""`toolkit inspect-data`: what the model will see and learn from a recipe's data, before any training.

Tokenises each stage's rows exactly as training does (chat template, data.thinking, over-length policy, image
tokens for vision-language models) and prints the first rows with the trained tokens marked, then each stage's
token statistics. The first thing to run on new data.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.config import Recipe, resolve_stages
from toolkit.data import DUMMY_PREFIX, encode_files, resolve_data_paths
from toolkit.errors import ToolkitError
from toolkit.labels import IGNORE_INDEX
from toolkit.run_data import row_encoder, write_dummy_files
from toolkit.run_dir import RunLayout

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


def stage_statistics(samples: list[dict[str, Any]]) -> str:
    lengths = np.array([len(s["input_ids"]) for s in samples] or [0])
    trained = np.array([sum(lab != IGNORE_INDEX for lab in s["labels"]) for s in samples] or [0])
    share = trained.sum() / max(lengths.sum(), 1)
    return (f"tokens per row: p50 {int(np.percentile(lengths, 50))}, p90 {int(np.percentile(lengths, 90))}, "
            f"max {int(lengths.max())}; trained per row: p50 {int(np.percentile(trained, 50))}, "
            f"max {int(trained.max())}; {share:.1%} of tokens trained")


def inspect_data(recipe: Recipe, *, stage: str | None, rows: int, colour: bool | None = None) -> str:
    """The report as text (colour: ANSI colour for trained tokens; default when stdout is a terminal)."""
    from toolkit.model import is_vision_language, load_processing, materialize_builtin

    names = [s.name for s in recipe.stages]
    if stage is not None and stage not in names:
        raise ToolkitError(f"--stage {stage!r} is not a stage of the recipe; its stages are {names}.")
    if rows < 0:
        raise ToolkitError(f"--rows must be 0 or more, got {rows}.")
    colour = sys.stdout.isatty() if colour is None else colour
    with tempfile.TemporaryDirectory() as tmp:
        model_path = materialize_builtin(recipe.model.name_or_path, Path(tmp))
        trust = recipe.model.trust_remote_code
        vision = is_vision_language(model_path, trust_remote_code=trust)
        processor, tokenizer = load_processing(model_path, vision=vision, trust_remote_code=trust,
                                               chat_template=recipe.data.chat_template)
        dummy_dir = _dummy_dir(recipe, Path(tmp), vision=vision)
        lines = [f"model {recipe.model.name_or_path}; trained tokens "
                 f"{'in green' if colour else f'between {OPEN} and {CLOSE}'}; data.thinking: {recipe.data.thinking}"]
        for st in resolve_stages(recipe):
            if stage is not None and st.name != stage:
                continue
            files = resolve_data_paths(list(st.paths), dummy_dir)
            data = encode_files(files, tokenizer, max_seq_len=st.max_seq_len, overlength=recipe.data.overlength,
                                train_on=recipe.data.train_on,
                                encoder=row_encoder(recipe.data, tokenizer, processor if vision else None))
            lines += ["", f"=== stage '{st.name}' ({', '.join(map(str, files))}) ===",
                      data.stats.summary(), stage_statistics(data.samples)]
            for n, sample in enumerate(data.samples[:rows], start=1):
                lines += [f"--- row {n} ({len(sample['input_ids'])} tokens) ---",
                          mark_trained(sample["input_ids"], sample["labels"], tokenizer, colour=colour)]
    return "\n".join(lines)


def _dummy_dir(recipe: Recipe, tmp: Path, *, vision: bool) -> Path:
    """The run's dummy data when it was generated, else a fresh copy (the rows --create_dummy_data writes)."""
    run_dir = RunLayout(recipe.output_dir).dummy_data
    if not any(p.startswith(DUMMY_PREFIX) for s in recipe.stages for p in s.paths) or run_dir.is_dir():
        return run_dir
    fresh = RunLayout(tmp).dummy_data
    write_dummy_files(fresh, 64, seed=recipe.train.seed, vision=vision)
    return fresh
