"""`toolkit score --config R [--stage NAME]`: a stage's rows scored by the recipe's model before any training, with
the pass training uses (toolkit/evals/scoring.py), for the user to look at: a histogram, the easiest and hardest rows
by `file:line`, and every row's score in a parquet file.

The stage's rows are training's own (`load_stage` over the stores training opens, unpacked: each row scored alone).
The measure is the stage's `difficulty.by` when it is a model's (loss, perplexity, ifd), else loss. The model is the
run's before training (`model: base`; with LoRA the adapters start at zero effect); a stage ordered by the `current`
policy is scored by that policy only at its entry in training, which this command cannot know beforehand: it says
so. It runs in this one process, on its device (CUDA when there is one): the model whole, not sharded.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.atomic import write_atomic
from toolkit.commands.inspect_data import _dummy_dir
from toolkit.config.schema import MODEL_MEASURES, Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.plan import KeptRows, StageRows
from toolkit.data.stages import load_stage, run_stores, tokenized_cache_dir
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import cached_row_sums, measure, response_alone
from toolkit.runtime.run_dir import RunLayout

log = logging.getLogger(__name__)

SHOWN = 5  # easiest and hardest rows printed


def histogram(values: np.ndarray, bins: int = 10, width: int = 40) -> list[str]:
    """A text histogram of the finite values, one line per bin."""
    finite = values[np.isfinite(values)]
    if not len(finite):
        return ["(no finite score)"]
    counts, edges = np.histogram(finite, bins=bins)
    top = max(int(counts.max()), 1)
    return [f"  {lo:10.4g} - {hi:10.4g} | {'#' * round(width * c / top):<{width}} {c}"
            for lo, hi, c in zip(edges[:-1], edges[1:], counts.tolist(), strict=True)]


def score(recipe: Recipe, *, stage: str | None, out: Path | None) -> str:
    """Score one stage's rows (`stage`, default: the first stage a model orders, else the first) and write every
    row's score to `out` (default `<output_dir>/scores/<stage>.parquet`, ours to replace; a named `out` that
    exists is refused). Returns the report."""
    import torch

    from toolkit.builtin.models import materialize_builtin
    from toolkit.model.load import is_vision_language, load_processing
    from toolkit.runtime import process as distributed
    from toolkit.train.setup import build_collator, build_model

    resolved = resolve_stages(recipe)
    names = [s.name for s in resolved]
    if stage is not None and stage not in names:
        raise ToolkitError(f"--stage {stage!r} is not a stage of the recipe; its stages are {names}.")
    scored = [s for s in resolved if s.difficulty is not None and s.difficulty.by in MODEL_MEASURES]
    st = next(s for s in resolved if s.name == stage) if stage is not None else (scored or resolved)[0]
    if st.pairs:
        raise ToolkitError(f"Stage '{st.name}' trains on preference pairs (objective {st.objective}); toolkit score "
                           "scores a stage's rows: name a stage of rows with --stage.")
    how = st.difficulty if st.difficulty is not None and st.difficulty.by in MODEL_MEASURES else None
    name = how.by if how is not None else "loss"
    target = out if out is not None else RunLayout(recipe.output_dir).scores / f"{st.name}.parquet"
    if out is not None and out.exists():
        raise ToolkitError(f"--out {out} exists; name a new file (toolkit score never replaces a file you named).")
    layout = RunLayout(recipe.output_dir)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = materialize_builtin(recipe.model.name_or_path, layout.cache)
        trust = recipe.model.trust_remote_code
        vision = is_vision_language(model_path, trust_remote_code=trust)
        if vision:
            raise ToolkitError("toolkit score scores text models only for now; this recipe's model is "
                               "vision-language.")
        _, tokenizer = load_processing(model_path, vision=False, trust_remote_code=trust,
                                       chat_template=recipe.data.chat_template)
        stores = run_stores([st], recipe.data, tokenizer, None, _dummy_dir(recipe, Path(tmp), vision=False),
                            tokenized_cache_dir(recipe.data.cache_dir, recipe.output_dir))
        src = load_stage(st, recipe.data, stores)
        assert isinstance(src.samples, StageRows)
        rows = KeptRows(src.samples.parts)
        if not len(rows):
            raise ToolkitError(f"Stage '{st.name}' has no usable rows to score.")
        accelerator = distributed.build_accelerator(1, 10)
        model, _ = build_model(recipe, resolved, model_path, vision=False)
        model.to(accelerator.device)
        collate = build_collator(recipe, model_path, tokenizer, vision=False)
        with torch.no_grad():
            given = cached_row_sums(accelerator, model, rows, collate, st.micro_batch_size, cache=None,
                                    what=f"scoring stage '{st.name}'")
            alone = None
            if name == "ifd":
                alone = cached_row_sums(accelerator, model, [response_alone(rows[i]) for i in range(len(rows))],
                                        collate, st.micro_batch_size, cache=None, what="responses alone (ifd)")
    values = measure(name, given, alone)
    where = [part.store.where(int(i)) for part in rows.parts for i in part.selection.index]
    columns = {"row": where, name: values, "loss_sum": given.loss, "tokens": given.tokens}
    if alone is not None:
        columns |= {"alone_loss_sum": alone.loss, "alone_tokens": alone.tokens}
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, lambda f: pq.write_table(pa.table(columns), f))
    order = np.argsort(np.where(np.isfinite(values), values, np.inf), kind="stable")
    lines = [f"stage '{st.name}': {len(values)} rows scored by {name} of the base model ({recipe.model.name_or_path}"
             f"{', LoRA at zero effect' if recipe.lora.enabled else ''})"]
    if how is not None and how.model == "current":
        lines.append("  (training orders this stage by the policy as it enters it, known only then; these are the "
                     "base model's scores)")
    lines += histogram(values)
    lines += [f"easiest {min(SHOWN, len(order))}:"] + [f"  {values[i]:.4g}  {where[i]}" for i in order[:SHOWN]]
    lines += [f"hardest {min(SHOWN, len(order))}:"] + [f"  {values[i]:.4g}  {where[i]}" for i in order[::-1][:SHOWN]]
    lines.append(f"scores: {target}")
    return "\n".join(lines)
