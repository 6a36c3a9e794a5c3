"""The run's data: which sources each stage reads (generated dummy files included), their token stores (prepared
once per machine, without any collective wait), their fingerprint for resume checks, and every stage's training and
eval rows."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.builtin.dummy_data import DUMMY_PREFIX
from toolkit.config.schema import MODEL_MEASURES, ORDERED, SCORED_MEASURES, DataConfig, DataEntry
from toolkit.config.stages import ResolvedStage
from toolkit.data.encoding import NOT_READ, TextEncoder
from toolkit.data.plan import (
    STORE_MEASURES,
    KtoRows,
    PairRows,
    Selection,
    SourceRows,
    StageRows,
    TrainingSet,
    drop_by_difficulty,
    drop_counts,
    kept_difficulty,
    kept_subset,
    select_pairs,
    select_rows,
    training_set,
)
from toolkit.data.prompts import prompt_set
from toolkit.data.sources import resolve_source
from toolkit.data.store import Store, open_store
from toolkit.errors import ToolkitError
from toolkit.runtime.run_dir import RunLayout

log = logging.getLogger("toolkit")


def uses_dummy_data(stages: list[ResolvedStage]) -> bool:
    """Whether any stage trains or evaluates on generated dummy files."""
    return any(path.startswith(DUMMY_PREFIX) for stage in stages for path in _files(stage))


def _files(stage: ResolvedStage) -> list[str]:
    """Every data file a stage reads: training, eval, generation-eval prompts."""
    return [*stage.paths, *stage.eval, *(path for g in stage.generation for path in g.data)]


def tokenized_cache_dir(cache_dir: str | None, output_dir: str | Path) -> Path | None:
    """Where token stores (and data-file hashes) live (data.cache_dir, by default beside the output dir); None when
    data.cache_dir is 'none'."""
    if cache_dir == "none":
        return None
    return Path(cache_dir or RunLayout(output_dir).tokenized)


def data_fingerprint(stages: list[ResolvedStage], dummy_dir: Path, cache: Path | None) -> dict[str, str]:
    """sha256 of every source the run reads (training, eval and generation-eval prompts), by its recipe entry.
    Stored in checkpoints: a resume on data that changed since is refused (the steps left would see other samples)."""
    entries = {e.name: e for s in stages
               for e in [*s.entries, *(DataEntry(p) for p in [*s.eval, *(p for g in s.generation for p in g.data)])]}
    out = {}
    for path in sorted(entries):
        source = resolve_source(entries[path], dummy_dir)
        if source.fmt == "hub":
            from toolkit.data.sources import open_source

            open_source(source)
        out[path] = source.digest(cache)
    return out


def hub_datasets(stages: list[ResolvedStage], dummy_dir: Path) -> list[str]:
    """The Hub dataset ids the stages train on (entries read from the Hugging Face cache, registry entries with an
    hf_hub_url too), for the model card's front matter."""
    return sorted({source.name for stage in stages for entry in stage.entries
                   if (source := resolve_source(entry, dummy_dir)).fmt == "hub"})


def holds_videos(training_sets: list[TrainingSet], eval_rows: list[Any]) -> bool:
    """Whether any store the run reads holds video rows (its collator then feeds every batch a video)."""
    return any(getattr(part.store, "videos", False) for rows in [*(t.samples for t in training_sets), *eval_rows]
               for part in getattr(rows, "parts", ()))


def store_checksums(training_sets: list[TrainingSet], eval_rows: list[Any]) -> dict[str, str]:
    """sha256 of every token store the run reads (toolkit/data/store.py; stores kept in memory have none), by
    its recipe entry. Stored in checkpoints beside `data_fingerprint`: a resume compares the tokens themselves,
    not only the files they came from."""
    out = {}
    for rows in [*(t.samples for t in training_sets), *eval_rows]:
        for part in getattr(rows, "parts", ()):
            checksum = part.store.meta.get("sha256")
            if checksum is not None:
                out[part.store.source.entry.path] = checksum
    return dict(sorted(out.items()))


def row_encoder(data: DataConfig, tokenizer: Any, processor: Any | None, *, pairs: bool = False,
                kto: bool = False) -> Any:
    """What turns the run's rows into tokens: the text encoder, or for a vision-language model (`processor`
    given) the processor's encoder. With `pairs`, a preference stage's: each source row a pair, stored as its
    chosen and rejected rows (a vision pair's images on both, toolkit/data/pairs.py). With `kto`, a kto stage's:
    each row stored with its true/false `label` (text only: kto rows with images are not built)."""
    if kto and processor is not None:
        raise ToolkitError("A kto stage on a vision-language model: kto rows with images or video are not built "
                           "yet; train the kto stage on a text model, or use a dpo, orpo or simpo stage of pairs.")
    if processor is not None:
        from toolkit.data.frames import VideoSettings
        from toolkit.data.vision import VLEncoder, tokens_per_second

        video = VideoSettings().over(data.video.model_dump() if data.video else None, "data.video")
        return VLEncoder(processor, train_on=data.train_on, min_pixels=data.min_pixels, max_pixels=data.max_pixels,
                         chat_template=data.chat_template, empty_answers=data.empty_answers,
                         renderer=data.renderer, video=video, tokens_per_second=tokens_per_second(processor),
                         pairs=pairs)
    return TextEncoder(tokenizer, train_on=data.train_on, thinking=data.thinking, chat_template=data.chat_template,
                       empty_answers=data.empty_answers, pairs=pairs, completion_newline=data.completion_newline,
                       renderer=data.renderer, kto=kto)


def num_proc(data: DataConfig) -> int:
    """Processes that tokenise a source: data.num_proc, by default every core this process may use."""
    if data.num_proc is not None:
        return data.num_proc
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def loader_workers(data: DataConfig, *, vision: bool) -> int:
    """DataLoader worker processes per rank: data.num_workers, by default 1 (text: collation off the training
    thread) or 2 (vision-language: images decoded and resized there)."""
    if data.num_workers is not None:
        return data.num_workers
    return 2 if vision else 1


class Stores:
    """The run's token stores, one per source and mode, opened (or prepared) once each however many stages use
    them: a stage of rows reads a source's row store (`encoder`), a preference stage its pair store (`pair_encoder`,
    each source row stored as its chosen and rejected rows). `max_tokens` is the longest max_seq_len of the run: a
    row far longer than it is stored cut (see toolkit/data/store.py, the size guard)."""

    def __init__(self, encoder: Any, dummy_dir: Path, cache: Path | None, processes: int,
                 max_tokens: int | None = None, pair_encoder: Any | None = None, kto_encoder: Any | None = None
                 ) -> None:
        self.encoder, self.dummy_dir, self.cache, self.processes = encoder, dummy_dir, cache, processes
        self.max_tokens = max_tokens
        self.pair_encoder = pair_encoder
        self.kto_encoder = kto_encoder  # a kto stage's rows, each with its label (None: refused when asked for)
        self._open: dict[tuple[DataEntry, bool | str], Store] = {}

    def __call__(self, entry: DataEntry, *, pairs: bool = False, kto: bool = False) -> Store:
        mode: bool | str = "kto" if kto else pairs
        if (entry, mode) not in self._open:
            encoder = self.kto_encoder if kto else self.encoder if not pairs else self.pair_encoder
            if encoder is None:
                raise ToolkitError(f"{entry.name}: a kto stage on a vision-language model: kto rows with images or "
                                   "video are not built yet; use a dpo, orpo or simpo stage of pairs.")
            source = resolve_source(entry, self.dummy_dir)
            if hasattr(encoder, "with_video"):  # a VL encoder: frames beside the stores, the entry's video settings
                if encoder.frame_store is None and self.cache is not None:
                    encoder.frame_store = self.cache / "frames"
                encoder = encoder.with_video(dict(entry.video), f"{entry.name}: video")
            self._open[entry, mode] = open_store(source, encoder, self.cache, num_proc=self.processes,
                                                 max_tokens=self.max_tokens)
        return self._open[entry, mode]


def run_stores(stages: list[ResolvedStage], data: DataConfig, tokenizer: Any, processor: Any | None,
               dummy_dir: Path, cache: Path | None) -> Stores:
    """The stores of a run's stages: its encoder (`row_encoder`), cache and processes, and the size guard's cap (the
    longest max_seq_len of the stages)."""
    pair_encoder = row_encoder(data, tokenizer, processor, pairs=True)
    kto_encoder = None if processor is not None else row_encoder(data, tokenizer, None, kto=True)
    return Stores(row_encoder(data, tokenizer, processor), dummy_dir, cache, num_proc(data),
                  max_tokens=max((s.max_seq_len for s in stages), default=None), pair_encoder=pair_encoder,
                  kto_encoder=kto_encoder)


def load_stage(stage: ResolvedStage, data: DataConfig, stores: Stores) -> TrainingSet:
    """A stage's training rows over its entries' stores: each entry's selection under the stage's length policy
    (data.max_seq_len, data.overlength), rows with nothing to train skipped, the stage's `drop` shares left out,
    packed with data.packing, and the difficulty easy_to_hard / hard_to_easy order by (`stage.difficulty`: the
    rows' field, their sampled video frames, or token length, `STORE_MEASURES`; by default the `difficulty` key
    when every row has one; a model's scores are set at training, toolkit/train/stage_scores.py, and the rows stand
    in length order until then; so does a drop by them: its counts are set here, `TrainingSet.dropped_by_score`,
    the rows left out once the scores exist). A preference stage (`stage.pairs`) reads its entries' pair stores:
    its rows are pairs (`select_pairs`, `PairRows`), ordered by their length or difficulty field, never
    bin-packed. Training and `toolkit inspect-data` both read a stage through this."""
    ordered = stage.order in ORDERED
    by = stage.difficulty.by if stage.difficulty is not None else None
    needs = (ordered or stage.drop is not None) and by not in ("length", *SCORED_MEASURES)  # scores: at training
    if stage.pairs and by in MODEL_MEASURES:
        raise ToolkitError(f"Stage '{stage.name}' (objective {stage.objective}) has difficulty.by {by}, a model's "
                           "score of rows, not of preference pairs; use difficulty.by: margin or chosen_loss, "
                           "length or field.")
    measure = STORE_MEASURES.get(by or "field", kept_difficulty)
    picked = []
    for entry in stage.entries:
        store = stores(entry, pairs=stage.pairs, kto=stage.kto)
        check_frame_budget(stage, store)
        if stage.pairs:
            selection = select_pairs(store, max_seq_len=stage.max_seq_len, overlength=data.overlength,
                                     identical=data.identical_pairs)
            values = measure(store, pair_rows(selection)) if needs else None
        else:
            selection = select_rows(store, max_seq_len=stage.max_seq_len, overlength=data.overlength)
            values = measure(store, selection) if needs else None
        if by == "field" and values is None:
            field = stage.difficulty.field if stage.difficulty is not None else "difficulty"
            raise ToolkitError(f"{entry.name}: stage '{stage.name}' has difficulty.by field but no row has the key "
                               f"'{field}'; add it to every row or use difficulty.by: length.")
        picked.append((store, selection, values))
    if by == "frames" and not any(store.videos for store, _, _ in picked):
        raise ToolkitError(f"Stage '{stage.name}' has difficulty.by frames but none of its rows holds a video "
                           f"({', '.join(e.name for e in stage.entries)}); order it by length or a field.")
    scored_drop = stage.drop is not None and by in SCORED_MEASURES  # by the scores: at training, over the rows
    if stage.drop is not None and not scored_drop:
        every = all(v is not None for _, _, v in picked)
        keys = [v if every and v is not None else sel.lengths.astype(np.float64) for _, sel, v in picked]
        masks = drop_by_difficulty(keys, easiest=stage.drop.easiest, hardest=stage.drop.hardest)
        picked = [(store, kept_subset(sel, keep), None if v is None else v[keep])
                  for (store, sel, v), keep in zip(picked, masks, strict=True)]
    parts: list[SourceRows | PairRows | KtoRows] = [
        PairRows(store, selection, difficulty=values if ordered else None) if stage.pairs else
        KtoRows(store, selection, chunk=stage.micro_batch_size, difficulty=values if ordered else None) if stage.kto
        else SourceRows(store, selection, packing=data.packing, difficulty=values if ordered else None)
        for store, selection, values in picked]
    rows = training_set(parts, needs_difficulty=ordered)
    if scored_drop and stage.drop is not None:
        rows.dropped_by_score = drop_counts(len(rows.samples), easiest=stage.drop.easiest, hardest=stage.drop.hardest)
    return rows


def check_frame_budget(stage: ResolvedStage, store: Store) -> None:
    """Refuse a stage whose video settings sample more tokens of a row's videos than the stage's max_seq_len holds
    (the store was checked against the longest max_seq_len of the run, toolkit/data/vision.py): the row could only
    be dropped unseen, as a stage of a short-to-long curriculum given a long stage's frame caps would drop every
    video row. The first such row is named, with the largest max_frames that fits."""
    if not store.videos:
        return
    over = np.flatnonzero(store.video_counts()[0] > stage.max_seq_len)
    if over.size:
        from toolkit.data.vision import frame_budget_problem  # torch and the image processors: video stages only

        row = int(over[0])
        problem = frame_budget_problem(store.video_grids(row), store.video_merge, stage.max_seq_len,
                                       f"stage '{stage.name}''s max_seq_len")
        raise ToolkitError(f"{store.where(row)}: {problem}")


def pair_rows(selection: Selection) -> Selection:
    """A pair selection as one of its pairs' chosen rows in the store (2k): what a pair's `difficulty` is read from
    (both sides carry the source row's)."""
    return replace(selection, index=2 * selection.index)


def stage_rows(stage: ResolvedStage, paths: list[str], data: DataConfig, stores: Stores) -> StageRows:
    """Rows of some files under a stage's length policy, unpacked: the stage's eval rows (pairs for a preference
    stage)."""
    parts: list[SourceRows | PairRows] = []
    for path in paths:
        store = stores(DataEntry(path), pairs=stage.pairs)
        if stage.pairs:
            parts.append(PairRows(store, select_pairs(store, max_seq_len=stage.max_seq_len,
                                                      overlength=data.overlength, identical=data.identical_pairs)))
        else:
            parts.append(SourceRows(store, select_rows(store, max_seq_len=stage.max_seq_len,
                                                       overlength=data.overlength), packing=False))
    return StageRows(parts)


def stage_summary(stage: ResolvedStage, src: TrainingSet, data: DataConfig) -> str:
    """The stage's data line, as training logs it at the stage's start (inspect-data prints the same line). A
    preference stage counts pairs; with packing, each micro-batch's pairs are flattened into one row."""
    if stage.prompts:
        return (f"stage '{stage.name}' data ({stage.objective}): {src.stats.rows} prompts, {src.stats.kept} kept "
                f"({src.stats.tokens} prompt tokens), {src.stats.dropped_overlength} dropped leaving no room for "
                "rl.max_completion_length under max_seq_len")
    by_score = ""
    if src.dropped_by_score is not None and stage.difficulty is not None:
        easy, hard = src.dropped_by_score
        what = "pairs" if stage.pairs else "rows"
        by_score = (f"; drop by {stage.difficulty.by} of the {stage.difficulty.model} model: {easy} easiest and "
                    f"{hard} hardest of {len(src.samples)} {what} once scored, {src.planned_rows} kept")
    videos = ""
    parts = [p for p in getattr(src.samples, "parts", ()) if getattr(p.store, "videos", False)]
    if parts:  # what a video stage's frame caps buy: its rows' video tokens (the short-to-long curriculum's lever)
        # a pair's two sides share its prompt's videos: counted once, on the chosen side (store row 2k)
        counted = [p.store.video_tokens(2 * p.selection.index if stage.pairs else p.selection.index) for p in parts]
        videos = (f"; {sum(t for t, _ in counted)} video tokens ({sum(f for _, f in counted)} frames) in its "
                  f"kept {'pairs' if stage.pairs else 'rows'}")
    if stage.pairs:
        return (f"stage '{stage.name}' data ({stage.objective}): {src.stats.summary()}"
                f"{'; each micro-batch of pairs flattened into one row' if data.packing else ''}{by_score}{videos}")
    return (f"stage '{stage.name}' data: {src.stats.summary()}"
            f"{f'; packed into {len(src.samples)} rows' if data.packing else ''}{by_score}{videos}")


def unread_keys_summary(stage: ResolvedStage, stores: Stores) -> str | None:
    """The stage's lines naming the message keys and the row keys (none of them content: toolkit/data/shapes.py
    refuses those) nothing reads, the shape chosen where rows hold their dialog twice, and empty answers left
    untrained, each with how many rows it holds for (None: nothing to say): said once per stage, so nothing in the
    data is dropped in silence."""
    unread: Counter[str] = Counter()
    notes: Counter[str] = Counter()
    for entry in stage.entries:
        unread.update(stores(entry, pairs=stage.pairs, kto=stage.kto).unread_keys)
        notes.update(stores(entry, pairs=stage.pairs, kto=stage.kto).notes)
    lines = []
    if unread:
        lines.append(f"stage '{stage.name}' data: messages carry keys not read: "
                     f"{', '.join(f'{k} ({n} rows)' for k, n in sorted(unread.items()))}")
    grouped: dict[str, list[str]] = {}
    for note, n in sorted(notes.items()):
        head, _, key = note.partition(": ")
        if key and head == NOT_READ:
            grouped.setdefault(head, []).append(f"{key} ({n} rows)")
        else:
            grouped.setdefault(note, []).append(f"{n} rows")
    lines += [f"stage '{stage.name}' data: {head}: {', '.join(said)}" for head, said in grouped.items()]
    return "\n".join(lines) or None


def load_curriculum_data(stages: list[ResolvedStage], data: DataConfig, tokenizer: Any, processor: Any | None,
                         dummy_dir: Path, cache: Path | None) -> tuple[list[TrainingSet], list[StageRows]]:
    """Every stage's training rows (`load_stage`: length policy applied, packed with packing) and eval rows, over
    the sources' token stores. A store missing on this machine is prepared by the first rank to ask for it while
    the others poll for it (toolkit/data/store.py): no collective runs here.

    A vision-language model's rows go through its processor (`processor` given): image tokens are expanded from
    the images' sizes and never cut.
    """
    logging.getLogger("toolkit.data").setLevel(logging.INFO)  # whichever rank prepares a store says so
    n_sources = len({e for s in stages for e in s.entries} | {p for s in stages for p in s.eval})
    log.info("data: %d source(s), token stores in %s", n_sources, cache if cache is not None else "memory")
    stores = run_stores(stages, data, tokenizer, processor, dummy_dir, cache)
    training_sets = []
    for stage in stages:
        if stage.prompts:  # an RL stage's prompts (toolkit/data/prompts.py): read and rendered, no token store
            src = prompt_set(stage, [resolve_source(e, dummy_dir) for e in stage.entries], tokenizer,
                             thinking=data.thinking)
        else:
            src = load_stage(stage, data, stores)
        if not len(src.samples):
            raise ToolkitError(f"Stage '{stage.name}' has no usable rows ({src.stats.summary()}). Check its data.")
        log.info("%s", stage_summary(stage, src, data))
        if not stage.prompts and (unread := unread_keys_summary(stage, stores)) is not None:
            log.info("%s", unread)
        training_sets.append(src)
    evals = [stage_rows(stage, stage.eval, data, stores) for stage in stages]  # the same stores: from eval.data
    return training_sets, evals
