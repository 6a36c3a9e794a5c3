"""Preference pairs through the data layer: a preference stage's rows become pair stores (two rows a pair, chosen
then rejected, encoded by the run's own encoder and chat template), `select_pairs` applies `fit_pair`'s policy
from the store's columns, `PairRows` / `StageRows` / `PairSides` serve the same sides, `pair_collator` gives each
micro-batch's pairs as separate sequences (padded or packed), and what is no pair where pairs train, or a pair
where rows train, is refused in one line.

Real rows (tests/assets/wild/, origins in its README): LLaMA-Factory's data/dpo_en_demo.json, ms-swift's DPO
example and its multimodal DPO rows, TRL's preference formats and vision DPO rows, LLaMA-Factory's RLHF-V row, a
VideoDPO row as a LLaMA-Factory user posted it."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from transformers import AutoTokenizer

from tests.data.test_batching import Process
from tests.data.test_pairs import BAD, CONVERSATIONAL, GOOD, USER, Q
from toolkit.config.load import load_recipe
from toolkit.config.schema import DataEntry
from toolkit.config.stages import ResolvedStage, resolve_stages
from toolkit.curriculum.sampling import StageSampler
from toolkit.data.batching import StageBatches
from toolkit.data.collate import padding_collator, pair_collator
from toolkit.data.encoding import IGNORE_INDEX, TextEncoder
from toolkit.data.packing import PackedCollator, unpack_row
from toolkit.data.pairs import PairStats, fit_pair
from toolkit.data.plan import PairRows, PairSides, StageRows, packed_row, select_pairs
from toolkit.data.sources import resolve_source
from toolkit.data.stages import load_curriculum_data, load_stage, run_stores, stage_summary
from toolkit.data.store import open_store, store_key
from toolkit.errors import ToolkitError
from toolkit.model.load import load_processing

WILD = Path(__file__).parents[1] / "assets" / "wild"


@pytest.fixture(scope="module")
def tok(models: dict[str, str]) -> Any:
    return AutoTokenizer.from_pretrained(models["text"])


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_store(path: Path, tok: Any) -> Any:
    return open_store(resolve_source(DataEntry(str(path)), Path()), TextEncoder(tok, train_on="assistant", pairs=True),
                      None, num_proc=1)


def stage_of(tmp: Path, model: str, paths: list[Path], *, objective: str = "dpo", eval_paths: tuple[Path, ...] = (),
             stage: dict[str, Any] | None = None, **data: Any) -> tuple[ResolvedStage, Any]:
    """One stage on `paths` as a recipe gives it (`stage`: more of its keys), made a preference stage (the schema
    does not train one yet)."""
    tree = {"output_dir": str(tmp / "run"), "model": {"name_or_path": model},
            "data": {"max_seq_len": 512, "num_proc": 1, "cache_dir": "none", **data},
            "stages": [{"name": "prefs", "data": [str(p) for p in paths], "max_steps": 1,
                        "eval": [str(p) for p in eval_paths], **(stage or {})}]}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(tree))
    recipe = load_recipe(tmp / "recipe.yaml")
    [stage] = resolve_stages(recipe)
    return dataclasses.replace(stage, objective=objective), recipe


def completion(side: dict[str, list[int]], tok: Any) -> str:
    return tok.decode([t for t, y in zip(side["input_ids"], side["labels"], strict=True) if y != IGNORE_INDEX])


def prompt_length(side: dict[str, list[int]]) -> int:
    return next(i for i, y in enumerate(side["labels"]) if y != IGNORE_INDEX)


# --- encoding: each shape, two store rows ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", list(CONVERSATIONAL))
def test_each_pair_shape_is_two_store_rows_sharing_the_prompt(shape: str, tmp_path: Path, tok: Any) -> None:
    """Through the tiny Qwen3's own chat template: pair k is store rows 2k (chosen) and 2k + 1 (rejected), both
    numbered by the source line, the prompt tokens shared and the labels on the completion only; every shape gives
    the tokens of TRL's explicit shape."""
    store = pair_store(write(tmp_path / "p.jsonl", [CONVERSATIONAL["trl explicit"], CONVERSATIONAL[shape]]), tok)
    assert len(store) == 4 and store.numbers.tolist() == [1, 1, 2, 2] and store.where(3).endswith("p.jsonl:2")
    expected = [store.sample(0), store.sample(1)]
    chosen, rejected = store.sample(2), store.sample(3)
    assert [chosen, rejected] == expected
    cut = prompt_length(chosen)
    assert cut == prompt_length(rejected) and chosen["input_ids"][:cut] == rejected["input_ids"][:cut]
    assert Q in tok.decode(chosen["input_ids"][:cut])
    assert GOOD in completion(chosen, tok) and BAD in completion(rejected, tok) and Q not in completion(chosen, tok)


def test_real_pair_files_store_their_pairs(tmp_path: Path, tok: Any) -> None:
    """TRL's three preference rows (standard text stays text), ms-swift's DPO rows (a multi-turn prompt whose
    earlier answer is context) and LLaMA-Factory's dpo_en_demo rows as pairs."""
    for name, pairs in (("trl_preference.jsonl", 3), ("ms_swift_dpo.jsonl", 2), ("llamafactory_dpo_en_demo.json", 2)):
        shutil.copy(WILD / name, tmp_path / name)
        store = pair_store(tmp_path / name, tok)
        assert len(store) == 2 * pairs and (store.label_tokens > 0).all()
    store = pair_store(tmp_path / "trl_preference.jsonl", tok)
    assert tok.decode(store.sample(0)["input_ids"]).startswith("The sky is blue.")  # standard: plain text
    assert completion(store.sample(1), tok) == " green.<|im_end|>"  # the text completion ends with EOS
    assert completion(store.sample(3), tok).endswith("It is green.<|im_end|>")
    assert store.sample(2) == store.sample(4) and store.sample(3) == store.sample(5)  # implicit == explicit
    store = pair_store(tmp_path / "ms_swift_dpo.jsonl", tok)
    assert completion(store.sample(2), tok).endswith("It equals 3<|im_end|>")
    assert completion(store.sample(3), tok).endswith("I don't know<|im_end|>")
    assert "It equals 2" not in completion(store.sample(2), tok)  # the prompt's answer is context


def test_the_store_key_differs_between_pair_and_row_mode(tmp_path: Path, tok: Any) -> None:
    source = resolve_source(DataEntry(str(write(tmp_path / "p.jsonl", [CONVERSATIONAL["trl explicit"]]))), Path())
    rows, pairs = TextEncoder(tok, train_on="assistant"), TextEncoder(tok, train_on="assistant", pairs=True)
    assert pairs.options() == {**rows.options(), "pairs": True}
    assert store_key(source, "d", rows) != store_key(source, "d", pairs)
    store = open_store(source, pairs, tmp_path / "cache", num_proc=1)
    assert store.path is not None and store.path.name in {p.name for p in (tmp_path / "cache" / "stores").iterdir()}


# --- selection: fit_pair pair by pair -------------------------------------------------------------------------------

def long_pairs() -> list[dict[str, Any]]:
    """Pairs of every fit: short, a prompt longer than the limits below, long completions, one side much longer."""
    def pair(prompt: str, good: str, bad: str) -> dict[str, Any]:
        return {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}]}

    return [pair(Q, GOOD, BAD), pair("word " * 60 + Q, GOOD, BAD), pair(Q, "long " * 40, BAD),
            pair("a b c " * 8, "x " * 5, "y " * 30), pair("word " * 30, "p " * 30, "q " * 30), pair("Hi", "4", "5")]


@pytest.mark.parametrize("overlength", ["drop", "truncate"])
@pytest.mark.parametrize("limit", [512, 60, 40, 25, 12, 2, 1])
def test_select_pairs_equals_fit_pair_pair_by_pair(overlength: str, limit: int, tmp_path: Path, tok: Any) -> None:
    store = pair_store(write(tmp_path / "p.jsonl", long_pairs()), tok)
    stats, expected = PairStats(), []
    for k in range(len(store) // 2):
        fitted = fit_pair(store.sample(2 * k), store.sample(2 * k + 1), max_seq_len=limit, overlength=overlength,
                          where=store.where(2 * k), stats=stats)
        if fitted is not None:
            expected.append((k, fitted))
    selection = select_pairs(store, max_seq_len=limit, overlength=overlength)
    assert selection.index.tolist() == [k for k, _ in expected]
    assert selection.lengths.tolist() == [sum(len(s["input_ids"]) for s in f) for _, f in expected]
    assert selection.label_tokens.tolist() == [sum(sum(y != IGNORE_INDEX for y in s["labels"]) for s in f)
                                               for _, f in expected]
    got = selection.stats
    assert (got.rows, got.kept, got.dropped_overlength, got.truncated, got.no_label_tokens) == (
        stats.pairs, stats.kept, stats.dropped_overlength, stats.truncated, stats.no_completion)
    assert got.pairs and got.summary().startswith(f"{stats.pairs} pairs, {stats.kept} kept")
    rows = PairRows(store, selection)
    assert [rows[k] for k in range(len(rows))] == [packed_row(list(f)) for _, f in expected]
    if overlength == "truncate" and limit <= 12:  # prompts cut down to their last token first
        assert stats.truncated == stats.pairs and all(s["labels"][0] == IGNORE_INDEX for _, f in expected for s in f)
    if overlength == "truncate" and limit == 1:  # the completions cut away entirely: dropped, counted
        assert stats.no_completion == stats.pairs and not len(rows)


def test_select_pairs_refuses_an_over_length_pair_naming_its_line(tmp_path: Path, tok: Any) -> None:
    store = pair_store(write(tmp_path / "p.jsonl", long_pairs()), tok)
    with pytest.raises(ToolkitError, match=r"p\.jsonl:2: \d+ tokens, over data\.max_seq_len=40"):
        select_pairs(store, max_seq_len=40, overlength="error")
    assert len(select_pairs(store, max_seq_len=4096, overlength="error").index) == 6



def test_a_pair_the_size_guard_cut_is_over_length_not_without_completion(tmp_path: Path, tok: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair of many short messages (issue 48: 100k of them in 3.5 MB) is cut by the size guard to its first
    tokens, all prompt: it was counted as a pair with no completion, kept out silently under data.overlength: error
    and truncate. It is over-length: dropped and counted so under drop, refused naming its line otherwise. (The
    guard's floor lowered: the same code at a thousand messages.)"""
    import toolkit.data.encoding as encoding_mod

    monkeypatch.setattr(encoding_mod, "GUARD_MIN_CHARS", 100)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(999)]
    big = {"chosen": [*many, {"role": "assistant", "content": "yes"}],
           "rejected": [*many, {"role": "assistant", "content": "no"}]}
    path = write(tmp_path / "p.jsonl", [CONVERSATIONAL["trl implicit"], big, CONVERSATIONAL["trl implicit"]])
    store = open_store(resolve_source(DataEntry(str(path)), Path()), TextEncoder(tok, train_on="assistant", pairs=True),
                       None, num_proc=1, max_tokens=128)
    assert set(store.capped) == {2, 3} and store.label_tokens.tolist()[2:4] == [0, 0]  # only the prompt is stored
    stats = select_pairs(store, max_seq_len=128, overlength="drop").stats
    assert (stats.rows, stats.kept, stats.dropped_overlength, stats.no_label_tokens) == (3, 2, 1, 0)
    for policy in ("error", "truncate"):
        with pytest.raises(ToolkitError, match=r"p\.jsonl:2: at least 129 tokens \(\d+ characters\), over "
                                               r"data\.max_seq_len=128"):
            select_pairs(store, max_seq_len=128, overlength=policy)

# --- rows, sides, collation, batches --------------------------------------------------------------------------------

def test_pair_rows_stage_rows_and_pair_sides_agree(tmp_path: Path, models: dict[str, str], tok: Any) -> None:
    a = write(tmp_path / "a.jsonl", long_pairs())
    b = write(tmp_path / "b.jsonl", [CONVERSATIONAL[s] for s in CONVERSATIONAL])
    stage, recipe = stage_of(tmp_path, models["text"], [a, b], overlength="truncate", max_seq_len=40,
                             packing=True)
    stores = run_stores([stage], recipe.data, tok, None, tmp_path, None)
    src = load_stage(stage, recipe.data, stores)
    rows, sides = src.samples, PairSides(src.samples.parts)
    assert isinstance(rows, StageRows) and all(isinstance(p, PairRows) for p in rows.parts)
    assert src.sizes == [len(p) for p in rows.parts] and len(sides) == 2 * len(rows) == 2 * src.stats.kept
    assert src.lengths.tolist() == [len(rows[i]["input_ids"]) for i in range(len(rows))]
    for i in range(len(rows)):
        row = rows[i]
        assert row["pair_index"] == i and row["position_ids"].count(0) == 2
        assert unpack_row(row) == [sides[2 * i], sides[2 * i + 1]]
        assert sides[2 * i]["labels"][0] == IGNORE_INDEX == sides[2 * i + 1]["labels"][0]
    line = stage_summary(stage, src, recipe.data)
    assert line.startswith(f"stage 'prefs' data (dpo): {len(long_pairs()) + len(CONVERSATIONAL)} pairs, ")
    assert "flattened into one row" in line and "packed into" not in line


def test_a_preference_stage_reads_its_eval_files_as_pairs(tmp_path: Path, models: dict[str, str], tok: Any) -> None:
    a = write(tmp_path / "a.jsonl", long_pairs())
    stage, recipe = stage_of(tmp_path, models["text"], [a], eval_paths=(a,))
    [src], [evals] = load_curriculum_data([stage], recipe.data, tok, None, tmp_path, None)
    assert len(evals) == len(src.samples) == len(long_pairs())
    assert [evals[i] for i in range(len(evals))] == [src.samples[i] for i in range(len(evals))]


def test_pairs_order_by_length_or_difficulty(tmp_path: Path, models: dict[str, str], tok: Any) -> None:
    rows = [dict(r, difficulty=float(-i)) for i, r in enumerate(long_pairs())]
    a = write(tmp_path / "a.jsonl", rows)
    stage, recipe = stage_of(tmp_path, models["text"], [a])
    src = load_stage(dataclasses.replace(stage, order="easy_to_hard"), recipe.data, run_stores(
        [stage], recipe.data, tok, None, tmp_path, None))
    assert src.difficulty.tolist() == [r["difficulty"] for r in rows]  # each pair's own, from its chosen row
    drop = SimpleNamespace(easiest=0.0, hardest=0.5)
    dropped = load_stage(dataclasses.replace(stage, drop=drop), recipe.data, run_stores(
        [stage], recipe.data, tok, None, tmp_path, None))
    assert dropped.stats.dropped_by_difficulty == 3 and len(dropped.samples) == 3
    assert "3 dropped by difficulty" in dropped.stats.summary()
    scored = write(tmp_path / "s.jsonl", [dict(r, score=float(i % 3)) for i, r in enumerate(long_pairs())])
    by_field, recipe = stage_of(tmp_path, models["text"], [scored], stage={
        "order": "hard_to_easy", "difficulty": {"by": "field", "field": "score"}})
    src = load_stage(by_field, recipe.data, run_stores([by_field], recipe.data, tok, None, tmp_path, None))
    assert src.difficulty.tolist() == [float(i % 3) for i in range(len(long_pairs()))]


def _pair_batch(rows: list[dict[str, Any]], tok: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return pair_collator(padding_collator(tok))(rows), pair_collator(PackedCollator())(rows)


def test_pair_collator_gives_each_side_its_own_sequence_padded_or_packed(tmp_path: Path, models: dict[str, str],
                                                                         tok: Any) -> None:
    stage, recipe = stage_of(tmp_path, models["text"], [write(tmp_path / "a.jsonl", long_pairs())])
    src = load_stage(stage, recipe.data, run_stores([stage], recipe.data, tok, None, tmp_path, None))
    rows = [src.samples[i] for i in (4, 0, 2)]
    sides = PairSides(src.samples.parts)
    expected = [sides[j] for i in (4, 0, 2) for j in (2 * i, 2 * i + 1)]  # chosen 4, rejected 4, chosen 0, ...
    padded, packed = _pair_batch(rows, tok)
    assert padded["pair_index"] == packed["pair_index"] == [4, 0, 2]
    assert padded["input_ids"].shape[0] == 6
    for j, side in enumerate(expected):
        n = int(padded["attention_mask"][j].sum())
        assert padded["input_ids"][j, :n].tolist() == side["input_ids"]
        assert padded["labels"][j, :n].tolist() == side["labels"]
        assert (padded["labels"][j, n:] == IGNORE_INDEX).all()
    cu = packed["cu_seq_lens_q"].tolist()
    assert len(cu) == 7 and "attention_mask" not in packed  # every sequence its own span: none attends to another
    for j, side in enumerate(expected):
        assert packed["input_ids"][0, cu[j]:cu[j + 1]].tolist() == side["input_ids"]
        assert packed["labels"][0, cu[j]:cu[j + 1]].tolist() == side["labels"]
        assert packed["position_ids"][0, cu[j]:cu[j + 1]].tolist() == list(range(len(side["input_ids"])))
    assert pickle.loads(pickle.dumps(pair_collator(PackedCollator())))(rows)["pair_index"] == [4, 0, 2]
    with pytest.raises(ValueError, match="exactly two sides"):
        pair_collator(PackedCollator())([sides[0]])


@pytest.mark.parametrize("workers", [0, 1])
def test_stage_batches_of_a_preference_stage_carry_pair_index(workers: int, tmp_path: Path, models: dict[str, str],
                                                              tok: Any) -> None:
    """Through the real DataLoader (in-process, and from a worker process): a micro-batch of m pairs is 2m
    sequences, its counts two samples a pair, and `pair_index` names the pairs of the step's slots."""
    stage, recipe = stage_of(tmp_path, models["text"], [write(tmp_path / "a.jsonl", long_pairs() * 2)])
    src = load_stage(stage, recipe.data, run_stores([stage], recipe.data, tok, None, tmp_path, None))
    sampler = StageSampler(sizes=src.sizes, weights=None, replacement=False, order="shuffle", difficulty=None,
                           lengths=src.lengths, pacing=None, seed=3, stage_index=0, global_batch=8, total_steps=3)
    fake = SimpleNamespace(index=0, sampler=sampler, data=src, resolved=stage,
                           plan=SimpleNamespace(steps=3, micro_batch=2))
    batches = StageBatches(Process(0), padding_collator(tok), grad_accum=2, group_by_length=False,
                           num_workers=workers)
    seen = []
    for step in range(3):
        for micro in batches.take(fake, step):
            pairs = micro.batch["pair_index"]
            assert micro.batch["input_ids"].shape[0] == 2 * len(pairs) and len(micro.lengths) == 2 * len(pairs)
            assert micro.label_tokens == int((micro.batch["labels"] != IGNORE_INDEX).sum())
            seen += pairs
    assert len(seen) == 3 * 4 and set(seen) <= set(range(len(src.samples)))  # this rank's half of each step


# --- refusals -------------------------------------------------------------------------------------------------------

def test_what_is_no_pair_where_pairs_train_and_a_pair_where_rows_train_are_refused(
        tmp_path: Path, models: dict[str, str], tok: Any) -> None:
    chat = {"messages": [USER, {"role": "assistant", "content": GOOD}]}
    path = write(tmp_path / "mixed.jsonl", [CONVERSATIONAL["trl explicit"], chat])
    stage, recipe = stage_of(tmp_path, models["text"], [path])
    stores = run_stores([stage], recipe.data, tok, None, tmp_path, None)
    with pytest.raises(ToolkitError, match=r"mixed\.jsonl:2: the stage trains on preference pairs \(objective dpo, "
                                           r"orpo or simpo\) but this row is no pair: a pair has 'chosen' and "
                                           r"'rejected' .*docs/preference\.md for the shapes; the row has keys "
                                           r"\['messages'\]\.$"):
        load_stage(stage, recipe.data, stores)
    with pytest.raises(ToolkitError, match=r"mixed\.jsonl:1: the row has 'chosen': preference pairs train in a "
                                           r"preference stage: set the stage's objective: dpo \(or orpo / simpo\)"):
        load_stage(dataclasses.replace(stage, objective="sft"), recipe.data, stores)
    swift = write(tmp_path / "swift.jsonl", [{"messages": chat["messages"], "rejected_response": BAD}])
    with pytest.raises(ToolkitError, match=r"swift\.jsonl:1: the row has 'rejected_response': preference pairs"):
        load_stage(dataclasses.replace(stage, objective="sft", entries=(DataEntry(str(swift)),)), recipe.data, stores)


def vision_folder(tmp: Path) -> Path:
    """The wild vision pairs (TRL's vision DPO rows, LLaMA-Factory's RLHF-V row and its registry entry, ms-swift's
    multimodal DPO rows and its image-preference rows) beside the small PNGs they name, written here (images of other
    sizes, so their grids differ)."""
    folder = tmp / "vision"
    (folder / "images").mkdir(parents=True)
    for name, size, colour in (("rlaif_v_0", (56, 84), (200, 30, 30)), ("sky", (84, 56), (40, 90, 220))):
        Image.new("RGB", size, colour).save(folder / "images" / f"{name}.png")
    for name, size in (("kitten", (84, 84)), ("puppy", (56, 56))):
        Image.new("RGB", size, "white").save(folder / f"{name}.png")
    for name in ("trl_vision_dpo.jsonl", "ms_swift_vision_dpo.jsonl", "ms_swift_rejected_images.jsonl"):
        shutil.copy(WILD / name, folder / name)
    shutil.copy(WILD / "llamafactory_rlhf_v.json", folder / "rlhf_v.json")
    (folder / "dataset_info.json").write_text(json.dumps({
        # LLaMA-Factory data/dataset_info.json's own entry for RLHF-V (its hf_hub_url as a local file_name)
        "rlhf_v": {"file_name": "rlhf_v.json", "ranking": True, "formatting": "sharegpt",
                   "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                               "images": "images"}}}))
    return folder


def test_vision_pairs_share_their_prompt_s_images_and_what_is_not_built_is_refused(
        tmp_path: Path, models: dict[str, str], tok: Any) -> None:
    processor = load_processing(models["vl"], vision=True, trust_remote_code=False, chat_template=None)[0]
    folder = vision_folder(tmp_path)
    trl = folder / "trl_vision_dpo.jsonl"
    stage, recipe = stage_of(tmp_path, models["vl"], [trl])
    stores = run_stores([stage], recipe.data, processor.tokenizer, processor, tmp_path, None)
    lf = DataEntry(None, dataset="rlhf_v", dataset_dir=str(folder))
    swift = DataEntry(str(folder / "ms_swift_vision_dpo.jsonl"))  # `rejected_images`: the row's own image again
    firsts = []  # each entry's first pair: its chosen and rejected completions
    for entry, pairs in ((DataEntry(str(trl)), 2), (lf, 1), (swift, 2)):
        got = load_stage(dataclasses.replace(stage, entries=(entry,)), recipe.data, stores)
        assert got.stats.kept == pairs
        sides = PairSides(got.samples.parts)
        for k in range(pairs):  # both sides show the prompt's image, as one placeholder's tokens each
            chosen, rejected = sides[2 * k], sides[2 * k + 1]
            assert chosen["images"] == rejected["images"] and len(chosen["images"]) == 1
            assert chosen["image_grid_thw"] == rejected["image_grid_thw"]
            assert prompt_length(chosen) == prompt_length(rejected)
            assert chosen["input_ids"][:prompt_length(chosen)] == rejected["input_ids"][:prompt_length(rejected)]
        firsts.append([completion(sides[k], processor.tokenizer) for k in range(2)])
    assert firsts[0][0].startswith("A young man standing on stage wearing a white shirt"), firsts[0]
    assert [c.split("<")[0] for c in firsts[2]] == ["This is a kitten.", "This is a puppy."]
    assert sides[0]["images"][0].endswith("kitten.png") and sides[2]["images"] == sides[0]["images"]
    # ms-swift's image-preference rows (one answer, another picture on the rejected side) are no pair of answers
    rows = [json.loads(line) for line in (folder / "ms_swift_rejected_images.jsonl").read_text().splitlines()]
    for k, row in enumerate(rows):
        path = write(folder / f"other_media_{k}.jsonl", [row])
        with pytest.raises(ToolkitError, match=rf"other_media_{k}\.jsonl:1: 'rejected_images' is not the row's "
                                               r"'images' \(\['puppy.png'\] against \['kitten.png'\]\): a pair whose "
                                               r"sides show different media is not built"):
            load_stage(dataclasses.replace(stage, entries=(DataEntry(str(path)),)), recipe.data, stores)
    # over max_seq_len under truncate, a vision pair is dropped (the cut, prompt first, would take its image)
    (tmp_path / "short").mkdir()
    short, short_recipe = stage_of(tmp_path / "short", models["vl"], [trl], max_seq_len=24, overlength="truncate")
    cut = load_stage(short, short_recipe.data, run_stores([short], short_recipe.data, processor.tokenizer, processor,
                                                          tmp_path, None))
    assert (cut.stats.rows, cut.stats.dropped_overlength, cut.stats.truncated) == (2, 2, 0)
    # a text model cannot read images; the rest is refused in one line naming the row
    (tmp_path / "text").mkdir()
    text_stage, text_recipe = stage_of(tmp_path / "text", models["text"], [trl])
    with pytest.raises(ToolkitError, match=r"trl_vision_dpo\.jsonl:1: the row has 'images', which needs a "
                                           r"vision-language model"):
        load_stage(text_stage, text_recipe.data, run_stores([text_stage], text_recipe.data, tok, None, tmp_path, None))
    [row, _] = [json.loads(line) for line in trl.read_text().splitlines()]
    two = dict(row, images=["images/rlaif_v_0.png", "images/sky.png"])
    shown = dict(row, chosen=[{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "So."}]}])
    for name, bad, said in (
            ("count", two, r"count\.jsonl:1: 1 \{\"type\": \"image\"\} placeholder\(s\) \(or '<image>' tags\) in "
                           r"'messages' but 2 path\(s\) in 'images'"),
            ("shown", shown, r"shown\.jsonl:1: the chosen completion holds an image: a pair's images and videos "
                             r"belong to its prompt")):
        path = write(folder / f"{name}.jsonl", [bad])
        with pytest.raises(ToolkitError, match=said):
            load_stage(dataclasses.replace(stage, entries=(DataEntry(str(path)),)), recipe.data, stores)


VIDEO_DATA = {"video": {"min_pixels": 3136, "max_pixels": 12544}}  # 56x56 frames: 4 tokens a frame pair


def video_pair_folder(tmp: Path) -> Path:
    """Video pairs in the shapes users have, beside the files they name (written here: a 2 s clip whose frame k is a
    flat grey of level 10k, a frame list, a PNG). `lf.json`: LLaMA-Factory's sharegpt ranking shape (its RLHF-V
    entry's columns, plus `videos`), the prompt and chosen answer of its data/mllm_video_demo.json row 1
    (tests/assets/wild/llamafactory_mllm_video_demo.json), the rejected answer ours. `trl.jsonl`: TRL's
    conversational vision DPO shape (tests/assets/wild/trl_vision_dpo.jsonl) with `{"type": "video"}` parts and
    `videos`: a frame list (Qwen2.5-VL README's video-as-frames form), and the clip shown with an image. The clip is
    in two pairs, so a micro-batch of all three shows it four times."""
    from tests.helpers.video_files import write_frames, write_video

    folder = tmp / "video_pairs"
    write_video(folder / "mllm_demo_data" / "1.mp4", 16, fps=8)
    write_frames([folder / "frames" / f"{k}.png" for k in range(4)], size=(56, 56))
    (folder / "images").mkdir()
    Image.new("RGB", (84, 56), (40, 90, 220)).save(folder / "images" / "sky.png")
    (folder / "lf.json").write_text(json.dumps([{
        "conversations": [{"from": "human", "value": "<video>Why is this video funny?"}],
        "chosen": {"from": "gpt", "value": "Because a baby is reading, and he is so cute!"},
        "rejected": {"from": "gpt", "value": "Because a dog is dancing."},
        "videos": ["mllm_demo_data/1.mp4"]}]))
    (folder / "dataset_info.json").write_text(json.dumps({
        "video_pairs": {"file_name": "lf.json", "ranking": True, "formatting": "sharegpt",
                        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                    "videos": "videos"}}}))

    def trl(parts: list[dict[str, Any]], question: str, good: str, bad: str, **media: Any) -> dict[str, Any]:
        return {**media, "prompt": [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}],
                "chosen": [{"role": "assistant", "content": [{"type": "text", "text": good}]}],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": bad}]}]}

    write(folder / "trl.jsonl", [
        trl([{"type": "video"}], "Does it get brighter?", "Yes, frame by frame.", "No, it stays dark.",
            videos=[[f"frames/{k}.png" for k in range(4)]]),
        trl([{"type": "image"}, {"type": "video"}], "Is the sky in the video?", "No, only greys.", "Yes.",
            images=["images/sky.png"], videos=["mllm_demo_data/1.mp4"])])
    return folder


def video_pair_entries(folder: Path) -> tuple[DataEntry, DataEntry]:
    return DataEntry(None, dataset="video_pairs", dataset_dir=str(folder)), DataEntry(str(folder / "trl.jsonl"))


def test_video_pairs_share_their_prompt_s_video_from_the_frame_store(tmp_path: Path, models: dict[str, str]) -> None:
    """A pair whose prompt holds a video (a file or a frame list, beside an image or not) gives both sides the same
    stored video (one frame store folder, one grid) in the same prompt tokens, ms-swift's `rejected_videos` (the
    row's own video again) included; `<video>` placeholders that do not match `videos`, a video in a completion,
    VideoDPO's answers that are videos and a rejected side with another video are refused in one line naming the
    row."""
    from toolkit.data.vision import VIDEO_REF

    processor = load_processing(models["vl"], vision=True, trust_remote_code=False, chat_template=None)[0]
    folder = video_pair_folder(tmp_path)
    stage, recipe = stage_of(tmp_path, models["vl"], [folder / "trl.jsonl"], **VIDEO_DATA)
    stores = run_stores([stage], recipe.data, processor.tokenizer, processor, tmp_path, None)
    both = dataclasses.replace(stage, entries=video_pair_entries(folder))
    got = load_stage(both, recipe.data, stores)
    assert got.stats.kept == 3
    sides = PairSides(got.samples.parts)
    grids = [g for k in range(0, 6, 2) for r, g in zip(sides[k]["images"], sides[k]["image_grid_thw"], strict=True)
             if r.startswith(VIDEO_REF)]  # the chosen sides' videos: a pair's two sides show the same ones
    tokens, frames = sum(t * h * w // 4 for t, h, w in grids), sum(2 * t for t, _, _ in grids)
    assert stage_summary(both, got, recipe.data).endswith(f"; {tokens} video tokens ({frames} frames) in its kept "
                                                          "pairs")  # each pair's counted once
    refs = []
    for k in range(3):
        chosen, rejected = sides[2 * k], sides[2 * k + 1]
        assert chosen["images"] == rejected["images"] and chosen["image_grid_thw"] == rejected["image_grid_thw"]
        assert chosen["input_ids"][:prompt_length(chosen)] == rejected["input_ids"][:prompt_length(rejected)]
        assert completion(chosen, processor.tokenizer) != completion(rejected, processor.tokenizer)
        refs.append([r for r in chosen["images"] if r.startswith(VIDEO_REF)])
    assert [len(r) for r in refs] == [1, 1, 1] and len(sides[4]["images"]) == 2  # the last: its image, then the clip
    assert refs[0] == refs[2] != refs[1]  # the clip of LLaMA-Factory's row and of the image + video row: one folder
    assert completion(sides[0], processor.tokenizer).startswith("Because a baby is reading")
    # ms-swift's multimodal DPO row (tests/assets/wild/ms_swift_vision_dpo.jsonl), its media a video as its docs
    # say videos go (`<video>`, `videos`, `rejected_videos`): the rejected side's video, the row's own, is shared
    swift = json.loads((WILD / "ms_swift_vision_dpo.jsonl").read_text().splitlines()[0])
    swift = json.loads(json.dumps(swift).replace("<image>", "<video>").replace('"kitten.png"', '"mllm_demo_data/1.mp4"')
                       .replace('"images"', '"videos"').replace('"rejected_images"', '"rejected_videos"'))
    path = write(folder / "swift_video.jsonl", [swift])
    got = load_stage(dataclasses.replace(stage, entries=(DataEntry(str(path)),)), recipe.data, stores)
    chosen, rejected = PairSides(got.samples.parts)[0], PairSides(got.samples.parts)[1]
    assert chosen["images"] == rejected["images"] == refs[0]  # the clip's one frame store folder, on both sides
    assert [completion(s, processor.tokenizer).split("<")[0] for s in (chosen, rejected)] == \
        ["This is a kitten.", "This is a puppy."]
    # VideoDPO's row (tests/assets/wild/videodpo_llamafactory.json): its answers are videos, given as `<image>` frames
    videodpo = json.loads((WILD / "videodpo_llamafactory.json").read_text())[0]
    [_, mixed] = [json.loads(line) for line in (folder / "trl.jsonl").read_text().splitlines()]
    two = dict(mixed, videos=["mllm_demo_data/1.mp4", "mllm_demo_data/1.mp4"])
    shown = dict(mixed, rejected=[{"role": "assistant", "content": "<video>This."}])
    for name, bad, said in (
            ("count", two, r"count\.jsonl:1: 1 \{\"type\": \"video\"\} placeholder\(s\) \(or '<video>' tags\) in "
                           r"'messages' but 2 video\(s\) in 'videos'"),
            ("shown", shown, r"shown\.jsonl:1: the rejected completion holds a video: a pair's images and videos "
                             r"belong to its prompt"),
            ("videodpo", videodpo, r"videodpo\.jsonl:1: the chosen completion holds an image: a pair's images and "
                                   r"videos belong to its prompt"),
            ("other", dict(swift, rejected_videos=[[f"frames/{k}.png" for k in range(4)]]),
             r"other\.jsonl:1: 'rejected_videos' is not the row's 'videos' .*: a pair whose sides show different "
             r"media is not built")):
        path = write(folder / f"{name}.jsonl", [bad])
        with pytest.raises(ToolkitError, match=said):
            load_stage(dataclasses.replace(stage, entries=(DataEntry(str(path)),)), recipe.data, stores)


# --- LLaMA-Factory's registry --------------------------------------------------------------------------------------

def registry(tmp: Path) -> Path:
    folder = tmp / "lf"
    folder.mkdir()
    shutil.copy(WILD / "llamafactory_dpo_en_demo.json", folder / "dpo_en_demo.json")
    write(folder / "alpaca_pairs.jsonl", [{"instruction": "Add", "input": "2 and 2", "chosen": "4", "rejected": "5"}])
    (folder / "dataset_info.json").write_text(json.dumps({
        # LLaMA-Factory data/dataset_info.json's own entry for its demo
        "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
        "alpaca_pairs": {"file_name": "alpaca_pairs.jsonl", "ranking": True,
                         "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                     "rejected": "rejected"}},
        "bare_ranking": {"file_name": "alpaca_pairs.jsonl", "ranking": True},
        "kto": {"file_name": "alpaca_pairs.jsonl", "formatting": "sharegpt", "tags": {"kto_tag": "label"}}}))
    return folder


def test_registry_ranking_entries_load_as_pairs(tmp_path: Path, models: dict[str, str], tok: Any) -> None:
    folder = registry(tmp_path)
    stage, recipe = stage_of(tmp_path, models["text"], [folder / "alpaca_pairs.jsonl"], max_seq_len=4096)
    stores = run_stores([stage], recipe.data, tok, None, tmp_path, None)

    def entry(name: str) -> DataEntry:
        return DataEntry(None, dataset=name, dataset_dir=str(folder))

    demo = load_stage(dataclasses.replace(stage, entries=(entry("dpo_en_demo"),)), recipe.data, stores)
    chosen, rejected = PairSides(demo.samples.parts)[2:4]
    assert demo.stats.kept == 2 and "How can I best prepare for a job interview?" in tok.decode(chosen["input_ids"])
    assert completion(chosen, tok).startswith("<think>\n\n</think>\n\nPreparing for a job interview")
    assert completion(rejected, tok).startswith("<think>\n\n</think>\n\nHere are some tips")
    for name in ("alpaca_pairs", "bare_ranking"):  # a ranking entry without pair columns reads chosen / rejected
        pairs = load_stage(dataclasses.replace(stage, entries=(entry(name),)), recipe.data, stores)
        chosen, rejected = PairSides(pairs.samples.parts)[0:2]
        assert "Add\n2 and 2" in tok.decode(chosen["input_ids"]) and completion(rejected, tok).endswith("5<|im_end|>")
    with pytest.raises(ToolkitError, match=r"dpo_en_demo\.json row 1: the row has 'chosen': preference pairs train "
                                           r"in a preference stage: set the stage's objective: dpo"):
        load_stage(dataclasses.replace(stage, objective="sft", entries=(entry("dpo_en_demo"),)), recipe.data, stores)
    with pytest.raises(ToolkitError, match=r"entry 'kto' is a KTO dataset \(kto_tag\), which is not supported.*"
                       r"TRL's unpaired rows \(prompt, completion, a true/false label\) to a stage with "
                       r"objective: kto"):
        load_stage(dataclasses.replace(stage, entries=(entry("kto"),)), recipe.data, stores)


def test_model_scores_of_pairs_are_refused(tmp_path: Path, models: dict[str, str], tok: Any) -> None:
    stage, recipe = stage_of(tmp_path, models["text"], [write(tmp_path / "a.jsonl", long_pairs())])
    scored = dataclasses.replace(stage, order="easy_to_hard", difficulty=SimpleNamespace(by="loss", field=None))
    with pytest.raises(ToolkitError, match=r"Stage 'prefs' \(objective dpo\) has difficulty.by loss, a model's score "
                                           r"of rows, not of preference pairs; use difficulty.by: margin or "
                                           r"chosen_loss"):
        load_stage(scored, recipe.data, run_stores([stage], recipe.data, tok, None, tmp_path, None))


def test_pair_rows_lengths_match_their_rows(tmp_path: Path, tok: Any) -> None:
    store = pair_store(write(tmp_path / "p.jsonl", long_pairs()), tok)
    rows = PairRows(store, select_pairs(store, max_seq_len=30, overlength="truncate"))
    assert np.array_equal(rows.lengths, [len(rows[k]["input_ids"]) for k in range(len(rows))])
    assert rows.difficulty is None and rows.bins is None and rows.pairs
    assert torch.tensor(rows[0]["labels"]).ne(IGNORE_INDEX).sum() == rows.selection.label_tokens[0]


def test_a_text_prompt_beside_whole_conversations_is_read_off_them(tmp_path: Path, tok: Any) -> None:
    """HuggingFaceH4/ultrafeedback_binarized's shape (its card's features: `prompt` a string, `chosen` and
    `rejected` whole conversations starting with that prompt, `messages` the chosen one again): the prompt is the
    conversations' shared start (TRL's maybe_extract_prompt), never rendered twice."""
    explicit = CONVERSATIONAL["trl explicit"]
    h4 = {"prompt": Q, "prompt_id": "d938b65d", "chosen": CONVERSATIONAL["trl implicit"]["chosen"],
          "rejected": CONVERSATIONAL["trl implicit"]["rejected"], "messages": CONVERSATIONAL["trl implicit"]["chosen"],
          "score_chosen": 8.0, "score_rejected": 5.0}
    store = pair_store(write(tmp_path / "h4.jsonl", [explicit, h4]), tok)
    assert [store.sample(2), store.sample(3)] == [store.sample(0), store.sample(1)]
    assert tok.decode(store.sample(2)["input_ids"]).count(Q) == 1


def test_pairs_whose_sides_render_alike_are_refused_or_skipped_and_counted(tmp_path: Path, models: dict[str, str],
                                                                           tok: Any) -> None:
    """data.identical_pairs (issue 48): a pair whose chosen and rejected render to the same tokens trains at ln 2
    with no gradient. By default it is refused naming its line; with skip it is dropped and counted in the stage's
    data line. "Alike" is after rendering: a string and the same text as content parts are one answer."""
    rows = [{"prompt": [USER], "chosen": [{"role": "assistant", "content": GOOD}],
             "rejected": [{"role": "assistant", "content": BAD}]},
            {"prompt": [USER], "chosen": [{"role": "assistant", "content": GOOD}],
             "rejected": [{"role": "assistant", "content": GOOD}]},
            {"prompt": [USER], "chosen": [{"role": "assistant", "content": GOOD}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": GOOD}]}]}]
    path = write(tmp_path / "p.jsonl", rows)
    stage, recipe = stage_of(tmp_path, models["text"], [path])
    stores = run_stores([stage], recipe.data, tok, None, tmp_path, None)
    with pytest.raises(ToolkitError, match=r"p\.jsonl:2: the chosen and the rejected side render to the same tokens "
                                           r"\(and 1 more pairs\).*data\.identical_pairs: skip"):
        load_stage(stage, recipe.data, stores)
    stage, recipe = stage_of(tmp_path, models["text"], [path], identical_pairs="skip")
    src = load_stage(stage, recipe.data, run_stores([stage], recipe.data, tok, None, tmp_path, None))
    assert src.stats.identical == 2 and src.stats.kept == 1 and src.stats.rows == 3
    assert "2 dropped with chosen = rejected (data.identical_pairs: skip)" in stage_summary(stage, src, recipe.data)
    assert completion(PairSides(src.samples.parts)[1], tok).endswith(BAD + "<|im_end|>")
