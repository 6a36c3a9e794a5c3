"""The run's data: which files each stage reads (generated dummy files included), where their tokenised form is
cached, their fingerprint for resume checks, and every stage's training and eval rows loaded once."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from toolkit.config import DataConfig, ResolvedStage, StageConfig
from toolkit.data import DUMMY_PREFIX, TrainingSet, content_digest, encode_files, load_training_set, resolve_data_paths
from toolkit.errors import ToolkitError
from toolkit.run_dir import RunLayout

log = logging.getLogger("toolkit")


def use_dummy_data(stages: list[StageConfig], *, vision: bool) -> None:
    """`--create_dummy_data`: stages not already on dummy data train on the generated files (image-text ones for a
    vision-language model), stage 1 on the first file, later stages on the second. Changes the recipe's stages, so
    the saved recipe.yaml names the files the run read."""
    first, second = ("dummy:vl_stage1", "dummy:vl_stage2") if vision else ("dummy:stage1", "dummy:stage2")
    for i, stage in enumerate(stages):
        if not all(path.startswith(DUMMY_PREFIX) for path in stage.paths):
            stage.data = [first if i == 0 else second]  # type: ignore[list-item]


def uses_dummy_data(stages: list[ResolvedStage]) -> bool:
    """Whether any stage trains or evaluates on generated dummy files."""
    return any(path.startswith(DUMMY_PREFIX) for stage in stages for path in _files(stage))


def _files(stage: ResolvedStage) -> list[str]:
    """Every data file a stage reads: training, eval, generation-eval prompts."""
    return [*stage.paths, *stage.eval, *(path for g in stage.generation for path in g.data)]


def tokenized_cache_dir(cache_dir: str | None, output_dir: str | Path) -> Path | None:
    """Where tokenised files (and data-file hashes) are cached (data.cache_dir, by default beside the output
    dir); None when data.cache_dir is 'none'."""
    if cache_dir == "none":
        return None
    return Path(cache_dir or RunLayout(output_dir).tokenized)


def data_fingerprint(stages: list[ResolvedStage], dummy_dir: Path, cache: Path | None) -> dict[str, str]:
    """sha256 of every data file the run reads (training and eval), by its recipe entry. Stored in checkpoints:
    a resume on data that changed since is refused (the steps left would see other samples)."""
    entries = sorted({p for s in stages for p in _files(s)})
    paths = resolve_data_paths(entries, dummy_dir)
    return {entry: content_digest(path, cache) for entry, path in zip(entries, paths, strict=True)}


def write_dummy_files(dummy_dir: Path, num_samples: int, *, seed: int, vision: bool) -> None:
    """The generated dummy data files (`dummy:NAME` entries): text ones, and image-text ones for a VL model."""
    from toolkit.dummy_data import write_dummy_data, write_dummy_facts, write_dummy_vl_data  # dummy-data runs only

    write_dummy_data(dummy_dir, num_samples, seed=seed)
    write_dummy_facts(dummy_dir, num_samples)
    if vision:
        write_dummy_vl_data(dummy_dir, num_samples, seed=seed)


def encoding(max_seq_len: int, data: DataConfig, processor: Any | None) -> dict[str, Any]:
    """The keyword arguments that encode a stage's rows (`encode_files`, `load_training_set`): its length policy
    and loss mask, and for a vision-language model (`processor` given) the processor's row encoder."""
    encoder = None
    if processor is not None:
        from toolkit.vl_data import vl_encoder  # image rows only

        encoder = vl_encoder(processor, max_seq_len=max_seq_len, overlength=data.overlength, train_on=data.train_on,
                             min_pixels=data.min_pixels, max_pixels=data.max_pixels)
    return {"max_seq_len": max_seq_len, "overlength": data.overlength, "train_on": data.train_on,
            "thinking": data.thinking, "encoder": encoder}


def load_curriculum_data(stages: list[ResolvedStage], data: DataConfig, tokenizer: Any, processor: Any | None,
                         dummy_dir: Path, cache: Path | None, accelerator: Accelerator
                         ) -> tuple[list[TrainingSet], list[list[dict[str, Any]]]]:
    """Every stage's training rows (tokenised, length policy applied, packed with packing) and eval rows.

    A vision-language model's rows go through its processor (`processor` given): image tokens are expanded and
    never cut, and the rows are neither cached nor packed.
    """
    if processor is not None and data.packing:
        raise ToolkitError("data.packing is not supported for vision-language models: set data.packing: false "
                           "(data.group_by_length: true also cuts padding).")

    # One rank per machine tokenises text first and the others read its cache; image rows (not cached) are
    # encoded by every rank at once.
    order = contextlib.nullcontext if processor is not None else accelerator.local_main_process_first
    training_sets = []
    for stage in stages:
        with order():
            src = load_training_set(resolve_data_paths(list(stage.paths), dummy_dir), tokenizer,
                                    packing=data.packing, needs_difficulty=stage.order == "easy_to_hard",
                                    cache_dir=cache, **encoding(stage.max_seq_len, data, processor))
        if not src.samples:
            raise ToolkitError(f"Stage '{stage.name}' has no usable rows ({src.stats.summary()}). Check its data.")
        log.info("stage '%s' data: %s%s", stage.name, src.stats.summary(),
                 f"; packed into {len(src.samples)} rows" if data.packing else "")
        training_sets.append(src)
    evals = [encode_files(resolve_data_paths(list(stage.eval), dummy_dir), tokenizer,
                          **encoding(stage.max_seq_len, data, processor)).samples
             if stage.eval else [] for stage in stages]  # the same files for every stage when from eval.data
    return training_sets, evals
