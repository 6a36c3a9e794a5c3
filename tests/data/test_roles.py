"""Column roles (toolkit/data/roles.py) over the whole wild corpus (tests/assets/wild/, origins in its README): each
file trains as it is, or is refused in one line whose data entry, applied as a recipe gives it, trains every row;
each file read by `toolkit inspect-data FILE`; advice that `ignore:`s only metadata; no string of a row dropped in
silence; and refusals of renamed columns that name the right candidates. Cheap: the tiny built-in tokenizer (the VL
processor for image rows), no model forward."""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.data.test_shapes import (
    REFUSED,
    TRAINS,
    WILD,
    _jsonl,
    _samples,
    _trained,
    _wild_samples,
    trains_after_fixes,
    wild_copy,
)
from toolkit.config.schema import DataSource
from toolkit.data import roles as vocab
from toolkit.data.encoding import TextEncoder
from toolkit.data.plan import encode_files
from toolkit.data.shapes import ShapeError, holds_content, to_messages
from toolkit.data.sources import Entry, Source
from toolkit.errors import ToolkitError

PAIRS = {  # file -> the data entry keys its refusals give (a preference stage's pairs)
    "ms_swift_dpo.jsonl": {}, "trl_preference.jsonl": {}, "llamafactory_dpo_en_demo.json": {},
    "orca_dpo_pairs.jsonl": {"columns": {"instruction": "question"}}, "openai_preference.jsonl": {},
    "hh_rlhf.jsonl": {}, "ultrafeedback_binarized.jsonl": {}, "h4_orca_dpo_pairs.jsonl": {},
    "trl_vision_dpo.jsonl": {}, "llamafactory_rlhf_v.json": {}, "ms_swift_vision_dpo.jsonl": {},
}
VISION_PAIRS = {"trl_vision_dpo.jsonl", "llamafactory_rlhf_v.json",  # pairs whose prompt shows an image
                "ms_swift_vision_dpo.jsonl"}
ROUND2 = {  # issue 47's files: file -> (model, the data entry keys its refusals give)
    **dict.fromkeys(("lmsys_chat.jsonl", "wildchat.jsonl", "oasst1_trees.jsonl", "sharegpt90k.json",
                     "openhermes.jsonl", "slimorca.jsonl", "capybara.jsonl", "bare_messages.jsonl",
                     "metamathqa.jsonl", "numinamath_cot.jsonl", "code_alpaca.jsonl", "alpaca_gpt4.jsonl",
                     "no_robots.jsonl", "lima.jsonl", "guanaco.jsonl", "hermes_function_calling.jsonl",
                     "wizardlm_evol.jsonl", "trl_prompt_completion.jsonl", "trl_language_modeling.jsonl",
                     "openai_tools.jsonl", "excel_bom.csv", "pandas_index.parquet", "numinamath_tir.jsonl",
                     "oasst2_flat.jsonl"),
                    ("text", {})),
    "openorca.jsonl": ("text", {"columns": {"instruction": "question", "output": "response",
                                            "system": "system_prompt"}}),
    "aya.jsonl": ("text", {"columns": {"instruction": "inputs", "output": "targets"}}),
    "flan.jsonl": ("text", {"columns": {"instruction": "inputs", "output": "targets"}}),
    "xlam.jsonl": ("text", {"columns": {"instruction": "query", "output": "answers"}}),
    "medical_o1_reasoning.jsonl": ("text", {"columns": {"instruction": "Question", "output": "Response",
                                                        "reasoning": "Complex_CoT"}}),
    "ms_swift_pretrain.jsonl": ("text", {"columns": {"text": "response"}}),
    "pandas_index.csv": ("text", {"columns": {"instruction": "question", "output": "answer"}}),
    **dict.fromkeys(("llava_instruct.json", "sharegpt4v.json", "minicpmv.json", "llamafactory_mllm_demo.json",
                     "internvl_placeholder.jsonl"), ("vl", {})),
}
REFUSED2 = {
    # ms-swift's image-preference rows (one answer, two pictures) and VideoDPO's (answers that are videos): a pair
    # here is two answers to one prompt, whose media both sides share
    "ms_swift_rejected_images.jsonl": r"ms_swift_rejected_images.jsonl:1: 'rejected_images' is not the row's "
                                      r"'images' .*: a pair whose sides show different media is not built",
    "videodpo_llamafactory.json": r"videodpo_llamafactory.json row 1: the chosen completion holds an image: a pair's "
                                  r"images and videos belong to its prompt",
    "minicpmv_multi.json": r"the row has 'image' .* that is not a path or a list of paths",
    "qwen_vl_v1.json": r"the text holds '<img>assets/demo.jpeg</img>', image markup of another tool",
    "ms_swift_image_url.jsonl": r"the row's images include 'https://.*', a URL; images are read from files",
    # TRL's prompt-only rows train in an RL stage (tests/data/test_prompts.py); as SFT rows they have no answer
    "trl_prompt_only.jsonl": r"trl_prompt_only.jsonl:2: the row has a 'prompt' and no 'completion': TRL's "
                             r"prompt-only rows train in an RL stage \(objective: grpo\)",
    # TRL's unpaired preference rows train in a kto stage (tests/data/test_kto_rows.py); as SFT rows they would
    # learn the undesirable completions
    "trl_unpaired_preference.jsonl": r"trl_unpaired_preference.jsonl:1: the row has a true/false 'label' \(KTO "
                                     r"preference data\), which is not supported in a stage of rows.*objective: kto",
}
ROWS_TRAIN = {**TRAINS, **ROUND2}
ALL_REFUSED = {**REFUSED, **REFUSED2}
CORPUS = sorted(p.name for p in WILD.iterdir() if p.name != "README.md")
ENTRY = re.compile(r"Give the data entry (\{.*?\})\.(?: |$)")


@pytest.fixture(scope="module")
def tok() -> Any:
    from toolkit.builtin.text_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def vl_processor(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoProcessor

    from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin

    return AutoProcessor.from_pretrained(materialize_builtin(TINY_VL_MODEL, tmp_path_factory.mktemp("vl")))


def test_the_corpus_is_wide_and_every_file_has_its_origin() -> None:
    """At least 60 files of real rows, each expected to train (rows or pairs) or to be refused, and each named in
    the README with where its rows come from."""
    assert len(CORPUS) >= 60
    told = [*ROWS_TRAIN, *PAIRS, *ALL_REFUSED]
    assert sorted(told) == CORPUS and len(set(told)) == len(told)
    readme = (WILD / "README.md").read_text()
    assert [n for n in CORPUS if f"`{n}`" not in readme] == []


def rows_in(path: Path) -> list[Any]:
    """The file's rows as stored (before any shape is read)."""
    if path.suffix == ".csv":
        with path.open(encoding="utf-8-sig", newline="") as f:
            return list(csv.DictReader(f))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith(("[", "{")):
        try:
            rows = json.loads(text)
            return rows if isinstance(rows, list) else [rows]
        except json.JSONDecodeError:
            pass
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def trained_rows(name: str) -> int:
    """The rows a file trains as: one per row, or per tree of a flat message export (a message whose parent is
    null)."""
    rows = rows_in(WILD / name)
    return sum(r["parent_id"] is None for r in rows) if name == "oasst2_flat.jsonl" else len(rows)


@pytest.fixture(scope="module")
def inspected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`toolkit inspect-data FILE` on every corpus file (one output dir, so the built-in models are written once):
    its report, or its one-line refusal."""
    from toolkit.commands.inspect_data import inspect_file

    folder = tmp_path_factory.mktemp("wild")
    out = {}
    for name in CORPUS:
        path = wild_copy(folder, name)
        try:
            out[name] = inspect_file(str(path), ["data.num_proc=1", f"output_dir={folder / 'run'}"], rows=50,
                                     colour=False)
        except ToolkitError as e:
            out[name] = f"REFUSED {e}"
    return out


def pasted(report: str) -> dict[str, Any]:
    entry = yaml.safe_load(report.split("data entry to paste into a recipe stage:\n")[1].split("\nwhy")[0])
    entry = entry["data"][0]
    return {k: v for k, v in entry.items() if k != "path"} if isinstance(entry, dict) else {}


@pytest.mark.parametrize("name", CORPUS)
def test_every_file_through_inspect_data(name: str, inspected: dict[str, str]) -> None:
    """Each file as `toolkit inspect-data FILE` reads it: every row kept (pairs for a pair file) under the entry it
    prints, which holds the keys the refusals gave; or refused in one line."""
    report = inspected[name]
    if name in ALL_REFUSED:
        assert report.startswith("REFUSED ") and "\n" not in report, report
        assert re.search(ALL_REFUSED[name], report), report
        return
    assert not report.startswith("REFUSED"), report
    rows = trained_rows(name)
    unit = "pairs" if name in PAIRS else "rows"
    assert re.search(rf"data(?: \(dpo\))?: {rows} {unit}, {rows} kept", report), report
    assert pasted(report) == (PAIRS[name] if name in PAIRS else ROWS_TRAIN[name][1])
    assert ("model builtin:tiny-qwen2.5-vl" in report) == (
        name in VISION_PAIRS or (name not in PAIRS and ROWS_TRAIN[name][0] == "vl"))
    if name in SHAPES:
        assert f"\nshape: {SHAPES[name]}\n" in report, report


SHAPES = {  # the shape inspect-data names for chats told by their values
    "lmsys_chat.jsonl": "a chat under 'conversation' (turns, told by its values)",
    "capybara.jsonl": "a chat under 'conversation' (exchanges, told by its values)",
    "oasst1_trees.jsonl": "a chat under 'prompt' (a message tree, told by its values)",
    "glaive_function_calling.jsonl": "a chat under 'chat' (a dialog in one string, told by its values)",
    "bare_messages.jsonl": "a bare list of turns: the row's chat",
    "oasst2_flat.jsonl": "a flat message export (one message per row, linked by 'parent_id'): rebuilt into message "
                         "trees",
}


@pytest.mark.parametrize("name", sorted(ROUND2))
def test_round2_files_train_or_their_refusal_gives_the_entry_that_does(name: str, tmp_path: Path, tok: Any,
                                                                       vl_processor: Any) -> None:
    """Each refusal's entry, applied as a recipe gives it (through the recipe's schema), until the file trains:
    every row kept, some tokens trained, and the keys applied the ones expected."""
    kind, fix = ROUND2[name]
    data, applied, _ = trains_after_fixes(wild_copy(tmp_path, name), kind, tok, vl_processor)
    assert applied == fix
    assert data.stats.kept == data.stats.rows == trained_rows(name) and data.stats.label_tokens > 0


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_pair_files_train_under_the_entry_printed(name: str, tmp_path: Path, tok: Any,
                                                  inspected: dict[str, str], request: pytest.FixtureRequest) -> None:
    """The entry inspect-data prints for a pair file, applied through the recipe's schema, stores every pair
    (two sides each, every side with trained tokens; a vision pair's through the VL encoder)."""
    from toolkit.data.vision import VLEncoder

    entry = DataSource(path=str(wild_copy(tmp_path, name)), **pasted(inspected[name])).entry()
    encoder = (VLEncoder(request.getfixturevalue("vl_processor"), train_on="assistant", pairs=True)
               if name in VISION_PAIRS else TextEncoder(tok, train_on="assistant", pairs=True))
    data = encode_files([entry], tok, max_seq_len=4096, overlength="error", train_on="assistant", encoder=encoder)
    pairs = len(rows_in(WILD / name))
    assert data.stats.rows == data.stats.kept == 2 * pairs
    assert all(any(y != -100 for y in s["labels"]) for s in data.samples)


def advice(report: str) -> list[dict[str, Any]]:
    """Every data entry a report or refusal offers: the pasted one and those in its refusals' lines."""
    found = [yaml.safe_load(m) for m in ENTRY.findall(report)]
    return found + ([pasted(report)] if "data entry to paste" in report else [])


def drops_a_role(entry: dict[str, Any], rows: list[Any]) -> list[str]:
    """What an entry does wrong by the rows' roles: an `ignore:`d key that is not metadata, or a key mapped to a
    field that reads another role (reasoning as input, a prompt as text)."""
    sample = {k: v for r in rows if isinstance(r, dict) for k, v in r.items()}
    roles = vocab.infer_roles(sample, holds_content)
    wrong = [f"ignores {k} ({roles.get(k)})" for k in entry.get("ignore", []) if roles.get(k, "metadata") != "metadata"]
    for field, key in entry.get("columns", {}).items():
        role = roles.get(key)
        if role in vocab.FIELDS and vocab.FIELDS[role] != field and not (field == "text" and role == "answer"):
            wrong.append(f"maps {key} ({role}) to {field}")
    return wrong


def test_advice_never_drops_a_role(inspected: dict[str, str]) -> None:
    """Over every file, every entry offered `ignore:`s only metadata, and maps each key to the field of its role:
    reasoning to the thinking block, tools to the template's tools. The last round's advice fails the check."""
    rows = {name: rows_in(WILD / name) for name in CORPUS}
    bad = {name: w for name in CORPUS for e in advice(inspected[name]) if (w := drops_a_role(e, rows[name]))}
    assert bad == {}
    aya = rows["aya.jsonl"]
    assert drops_a_role({"columns": {"text": "targets"}, "ignore": ["inputs"]}, aya) == ["ignores inputs (prompt)"]
    assert drops_a_role({"ignore": ["Complex_CoT"]}, rows["medical_o1_reasoning.jsonl"]) == \
        ["ignores Complex_CoT (reasoning)"]
    assert drops_a_role({"columns": {"input": "Complex_CoT"}}, rows["medical_o1_reasoning.jsonl"]) == \
        ["maps Complex_CoT (reasoning) to input"]


def strings(value: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """Every string of a row with the keys above it (JSON text decoded into its own strings)."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings(v, (*path, str(k)))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v, path)]
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "[{":
            try:
                return strings(json.loads(text), path)
            except json.JSONDecodeError:
                pass
        turns = vocab.split_dialog(text)
        if turns:
            return [(path, t["content"]) for t in turns]
        text = vocab.MARKER.sub("", text, count=1) if vocab.MARKER.match(text) else text  # Glaive's `SYSTEM: `
        return [(path, text)] if text else []
    return []


def flat(text: str) -> str:
    text = text.replace("[[", "").replace("]]", "")
    for tag in ("<image>", "<IMG_CONTEXT>", "<video>"):
        text = text.replace(tag, " ")
    return " ".join(re.sub(r"<\|(image|video)_pad\|>x\d+|<\|vision_(start|end)\|>", " ", text).split())


@pytest.mark.parametrize("name", sorted(n for n in CORPUS if n not in ALL_REFUSED))
def test_no_string_of_a_row_is_dropped_in_silence(name: str, inspected: dict[str, str]) -> None:
    """Every string in every row trains or is shown as prompt or system text by inspect-data, or a key above it
    (row key or turn key) is named in a log line that says it is not read, not trained or trained once; media paths
    are read as the row's images (a vision-language row). Structure is no content: a turn's role name, a part's
    type, an id without a space under a metadata name."""
    report = inspected[name]
    shown = flat(report.split("\nshape: ")[0])
    said = [line for line in report.splitlines() if line.startswith("stage ")
            and re.search(r"not read|not trained|are not|trained once", line)]
    vision = "model builtin:tiny-qwen2.5-vl" in report
    silent = []
    for row in rows_in(WILD / name):
        row = {"_": row} if isinstance(row, list) else row
        for path, text in strings(row):
            leaf = path[-1] if path else ""
            if leaf in vocab.ROLE_KEYS or leaf == "type" or (vocab.named_roles(leaf) == ["metadata"] and
                                                             not re.search(r"\s", text)):
                continue
            if flat(text) in shown or (vision and text.lower().endswith(vocab_media())):
                continue
            if not any(re.search(rf"(?<![\w]){re.escape(k)}\b", line) for k in path for line in said):
                silent.append((path, text[:60]))
    assert silent == []


def vocab_media() -> tuple[str, ...]:
    from toolkit.data.shapes import MEDIA_SUFFIXES

    return MEDIA_SUFFIXES


# --- names the tests do not know: a seeded generator (hypothesis is not installed) ----------------------------

TEXT = ["What is the boiling point of water at sea level?", "Water boils at 100 degrees Celsius at sea level.",
        "You are a careful assistant.", "First recall the pressure at sea level, then the boiling point.",
        "The passage: water boils when its vapour pressure equals the air's."]


def unknown_name(rng: random.Random) -> str:
    """A key name no vocabulary row holds (nor its metadata suffixes)."""
    while True:
        name = "".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(4, 8))) + \
            rng.choice(["", "_txt", "_field", "_col"])
        if not vocab.named_roles(name):
            return name


def refusal(row: dict[str, Any]) -> ShapeError:
    source = Source(Entry("gen.jsonl"), "jsonl", [], "gen.jsonl")
    with pytest.raises(ShapeError) as e:
        to_messages(row, source, "gen.jsonl:1")
    return e.value


def test_renamed_columns_name_the_right_candidates() -> None:
    """Rows generated from the vocabulary (a prompt and an answer, maybe a system, a reasoning, a context), with
    one or two keys renamed to names no row of the table holds: the refusal names each renamed key as a candidate
    for the role it lost, with the entry that maps it; a single candidate is the refusal's fix, which maps every
    key to the field of its role."""
    rng = random.Random(47)
    for _ in range(300):
        chosen = {"prompt": rng.choice(vocab.VOCABULARY["prompt"][:7]),
                  "answer": rng.choice(vocab.VOCABULARY["answer"][:10])}
        for role in ("system", "reasoning", "context"):
            if rng.random() < 0.4:
                chosen[role] = rng.choice(vocab.VOCABULARY[role][:4])
        if chosen.get("context") == "input" or (chosen["prompt"] in ("input", "inputs") and "context" in chosen):
            chosen.pop("context")
        if chosen["prompt"] in ("query",) and chosen["answer"] == "response":
            chosen["answer"] = "output"  # ms-swift's query/response rows read as they are
        renamed = rng.sample(sorted(chosen), rng.choice([1, 1, 2]))
        keys = {role: unknown_name(rng) if role in renamed else name for role, name in chosen.items()}
        row = {keys[role]: TEXT[i] for i, role in enumerate(chosen)}
        row["id"] = rng.randint(0, 9999)
        error = refusal(row)
        message = str(error)
        for role in renamed:
            lost = role if role in ("prompt", "answer") or not {"prompt", "answer"} & set(renamed) else None
            if lost is not None:
                assert f"'{keys[role]}' as the {lost}" in message or error.fix, message
        if error.fix:
            columns = error.fix["columns"]
            want = {vocab.FIELDS[r]: keys[r] for r in chosen if keys[r] != vocab.FIELDS[r]}
            assert columns == want, (message, want)
            assert "ignore" not in error.fix
        else:
            assert "candidates:" in message, message


# --- the rules, one by one ------------------------------------------------------------------------------------

def test_a_chat_under_any_key_with_any_role_names(tmp_path: Path, tok: Any) -> None:
    """Turns are told by their values: any key, role/from/speaker and content/value/text keys, OASST's prompter and
    ShareGPT dumps' chatgpt / Vicuna's USER; the same rows as the toolkit's own messages."""
    u, a = "What is 2 + 3?", "It is 5."
    want = _samples([_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": u},
                                                                 {"role": "assistant", "content": a}]}])], tok)
    for turns in ([{"role": "prompter", "text": u}, {"role": "assistant", "text": a}],
                  [{"from": "USER", "value": u}, {"from": "chatgpt", "value": a}],
                  [{"speaker": "human", "utterance": u}, {"speaker": "bot", "utterance": a}]):
        for key in ("conversation", "dialogue", "thread"):
            path = _jsonl(tmp_path / f"{key}.jsonl", [{key: turns, "conversation_id": "x1"}])
            assert _samples([path], tok) == want, (key, turns)
    bare = _jsonl(tmp_path / "bare.jsonl", [[{"role": "user", "content": u}, {"role": "assistant", "content": a}]])
    assert _samples([bare], tok) == want


def test_a_message_tree_trains_its_best_ranked_thread(tmp_path: Path, tok: Any) -> None:
    """OASST's tree: at each turn the reply ranked best (rank 0) trains, whichever comes first; a trailing
    question is not trained; the log says the other threads are not."""
    tree = json.loads((WILD / "oasst1_trees.jsonl").read_text())
    replies = tree["prompt"]["replies"]
    first = _trained(_samples([_jsonl(tmp_path / "a.jsonl", [tree])], tok)[0], tok)
    replies[0]["rank"], replies[1]["rank"] = 1, 0
    second = _trained(_samples([_jsonl(tmp_path / "b.jsonl", [tree])], tok)[0], tok)
    assert replies[0]["text"][:40] in first and replies[1]["text"][:40] not in first
    assert replies[1]["text"][:40] in second and replies[0]["text"][:40] not in second


def test_reasoning_and_tool_columns_reach_the_template(tmp_path: Path, tok: Any) -> None:
    """A reasoning set's CoT column trains in the thinking block of its answer; xLAM's `answers` train as the
    assistant's tool calls and its `tools` are rendered as the template's tools, never as text of the answer."""
    medical = DataSource(path=str(wild_copy(tmp_path, "medical_o1_reasoning.jsonl")),
                         columns={"instruction": "Question", "output": "Response", "reasoning": "Complex_CoT"})
    trained = _trained(_samples([medical.entry()], tok)[0], tok)
    assert trained.startswith("<think>\nOkay, let's think about this step by step.") and "</think>" in trained
    xlam = DataSource(path=str(wild_copy(tmp_path, "xlam.jsonl")), columns={"instruction": "query",
                                                                          "output": "answers"})
    sample = _samples([xlam.entry()], tok)[0]
    shown, trained = tok.decode(sample["input_ids"]), _trained(sample, tok)
    assert "live_giveaways_by_type" in shown.split("<|im_start|>user")[0]  # the tools, in the system turn
    assert trained.count("<tool_call>") == 2 and '"type": "beta"' in trained


def test_every_thread_of_a_tree_with_threads_all(tmp_path: Path, tok: Any) -> None:
    """`threads: all` trains every thread of the tree that ends with an answer, one row each (the trailing question
    of the first thread is not trained); it is part of the store's key."""
    from toolkit.data.sources import resolve_source
    from toolkit.data.store import store_key

    path = wild_copy(tmp_path, "oasst1_trees.jsonl")
    replies = json.loads(path.read_text())["prompt"]["replies"]
    entry = DataSource(path=str(path), threads="all").entry()
    rows = _samples([entry], tok)
    assert len(rows) == 2
    assert [r["text"][:40] in _trained(s, tok) for s in rows for r in replies] == [True, False, False, True]
    assert "Now explain it to a dog" not in "".join(tok.decode(s["input_ids"]) for s in rows)

    class Enc:
        fingerprint = "f"

        @staticmethod
        def options() -> dict[str, Any]:
            return {}

    keys = [store_key(resolve_source(e, tmp_path), "d", Enc()) for e in (Entry(str(path)), entry)]
    assert "threads" not in keys[0] and keys[1]["threads"] == "all"


def flat_messages(node: dict[str, Any], parent: str | None = None) -> list[dict[str, Any]]:
    """A message tree as OASST's flat export lays it out: each message a row without its replies, linked to its
    parent's `message_id` by `parent_id` (the card's tree leaves it null), replies after the message they answer."""
    return [{**{k: v for k, v in node.items() if k != "replies"}, "parent_id": parent},
            *(m for r in node.get("replies", []) for m in flat_messages(r, node["message_id"]))]


def test_a_flat_message_export_trains_the_threads_of_its_trees(tmp_path: Path, tok: Any) -> None:
    """A file of flat messages is read whole and rebuilt into trees by `parent_id`: the card's tree, flattened and
    its rows shuffled, trains the same rows as the trees export, main thread and `threads: all` (JSON Lines, and a
    .json array); the wild flat
    rows (a prompt and its rank-0 answer) train as that two-message tree does: the answer, not the question. A
    reply whose parent is not in the file is refused in one line, and so is a message in a file that does not start
    with one."""
    tree = json.loads((WILD / "oasst1_trees.jsonl").read_text())
    messages = flat_messages(tree["prompt"])
    random.Random(0).shuffle(messages)
    trees, rows = _jsonl(tmp_path / "trees.jsonl", [tree]), _jsonl(tmp_path / "flat.jsonl", messages)
    for threads in (None, "all"):
        want, got = (_samples([DataSource(path=str(p), threads=threads).entry()], tok) for p in (trees, rows))
        assert [s["input_ids"] for s in got] == [s["input_ids"] for s in want]
        assert [s["labels"] for s in got] == [s["labels"] for s in want] and len(want) == (2 if threads else 1)
    array = tmp_path / "flat.json"  # a .json array of the same messages is rebuilt the same way
    array.write_text(json.dumps(messages))
    assert [s["input_ids"] for s in _samples([Entry(str(array))], tok)] == \
        [s["input_ids"] for s in _samples([Entry(str(trees))], tok)]
    asked, answer = rows_in(WILD / "oasst2_flat.jsonl")  # the real export's prompt and its rank-0 answer
    wild = _samples([Entry(str(wild_copy(tmp_path, "oasst2_flat.jsonl")))], tok)
    as_tree = _samples([_jsonl(tmp_path / "tree.jsonl", [{"prompt": {**asked, "replies": [answer]}}])], tok)
    assert [s["labels"] for s in wild] == [s["labels"] for s in as_tree]
    assert len(wild) == 1 and _trained(wild[0], tok).strip().endswith(answer["text"][-60:] + "<|im_end|>")
    assert asked["text"] in tok.decode(wild[0]["input_ids"]) and asked["text"] not in _trained(wild[0], tok)
    orphan = [m for m in messages if m["parent_id"] != tree["prompt"]["message_id"]]
    with pytest.raises(ToolkitError, match=r"flat.jsonl:\d+: \d+ message\(s\) of the flat export reply to a message "
                                           r"not in the file \('parent_id'"):
        _samples([Entry(str(_jsonl(tmp_path / "flat.jsonl", orphan)))], tok)
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": "Hello"}]}, *messages])
    with pytest.raises(ToolkitError, match=r"mixed.jsonl:2: the row is one message of a flat message export"):
        _samples([Entry(str(mixed))], tok)


def test_other_tools_image_placeholders(tmp_path: Path, vl_processor: Any) -> None:
    """`<IMG_CONTEXT>`, `<|image|>`, `<image_placeholder>` are placeholders like `<image>`: the row trains as
    its `<image>` twin does; without images a placeholder is refused in one line, never trained as text."""
    wild_copy(tmp_path, "gsm8k.jsonl")  # writes the corpus's image files
    rows = {}
    for tag in ("<image>", "<IMG_CONTEXT>", "<|image|>", "<image_placeholder>"):
        row = {"messages": [{"role": "user", "content": f"{tag}\nWhat colour is it?"},
                            {"role": "assistant", "content": "Red."}], "images": ["images/001.jpg"]}
        path = _jsonl(tmp_path / f"t{len(rows)}.jsonl", [row])
        rows[tag] = _wild_samples(Entry(str(path)), "vl", None, vl_processor).samples[0]["input_ids"]
    assert all(ids == rows["<image>"] for ids in rows.values())
    text = _jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": "<|image|>What is it?"},
                                                       {"role": "assistant", "content": "A cat."}]}])
    with pytest.raises(ToolkitError, match=r"n.jsonl:1: the text holds <\|image\|>, an image placeholder, but the "
                                           r"row has no images"):
        _wild_samples(Entry(str(text)), "vl", None, vl_processor)


def test_csv_index_and_bom_are_never_content(tmp_path: Path, tok: Any) -> None:
    """pandas' unnamed index column is named once in the log (`Unnamed: 0`) and never trained; Excel's byte order
    mark is not part of the first column's name."""
    from toolkit.data.encoding import row_notes

    bom = _samples([wild_copy(tmp_path, "excel_bom.csv")], tok)
    assert "Bonjour" in _trained(bom[1], tok) and "\ufeff" not in _trained(bom[0], tok)
    entry = DataSource(path=str(wild_copy(tmp_path, "pandas_index.csv")),
                       columns={"instruction": "question", "output": "answer"}).entry()
    row = to_messages({"": "0", "question": "Q?", "answer": "A."} | {"Unnamed: 0": "0"},
                      Source(entry, "csv", [], "p.csv"), "p.csv row 1")
    assert any("Unnamed: 0" in n for n in row_notes(row))
    assert "#### 72" in _trained(_samples([entry], tok)[0], tok)


def test_a_tools_column_that_repeats_the_system_turn_renders_once(tmp_path: Path, tok: Any) -> None:
    """hermes-function-calling's real row: its `tools` column is a JSON copy of the `<tools>` block its system turn
    writes. Rendered once, from the system turn (the log says why the column is not given to the template); tools
    that differ from the block still reach the template."""
    from toolkit.data.encoding import row_notes

    path = wild_copy(tmp_path, "hermes_function_calling.jsonl")
    raw = rows_in(path)[0]
    described = "Retrieves the live feed from a specified security camera."
    source = Source(Entry(str(path)), "jsonl", [], path.name)
    row = to_messages(dict(raw), source, f"{path.name}:1")
    assert "tools" not in row and any("repeats the <tools> block" in n for n in row_notes(row))
    full = tok.decode(_samples([path], tok, max_seq_len=4096)[0]["input_ids"])
    assert full.count(described) == 1
    other = [{"type": "function", "function": {"name": "pan_tilt", "description": "Pans and tilts a camera.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    kept = to_messages({**raw, "tools": json.dumps(other)}, source, f"{path.name}:1")
    assert kept["tools"] == other


def test_the_role_table_decides_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shapes read as they are are rows of the role table (vocab.SHAPES), one reader per role set: Alpaca's and
    ms-swift's exchanges become the same chat from the same texts; a row of the table added for gsm8k's
    `question` / `answer` makes that file's row read as an exchange, with no code path of its own (without the row
    it is refused with the entry)."""
    source = Source(Entry("t.jsonl"), "jsonl", [], "t.jsonl")
    texts = {"system": "Be brief.", "history": [["Hi", "Hello."]], "reasoning": "Add them."}
    alpaca = to_messages({"instruction": "2+2?", "input": "Integers.", "output": "4", **texts}, source, "t:1")
    swift = to_messages({"query": "2+2?\nIntegers.", "response": "4", **texts}, source, "t:2")
    assert alpaca == swift and [m["role"] for m in alpaca["messages"]] == ["system", "user", "assistant", "user",
                                                                           "assistant"]
    assert alpaca["messages"][-1] == {"role": "assistant", "content": "4", "reasoning_content": "Add them."}
    row = rows_in(WILD / "gsm8k.jsonl")[0]
    with pytest.raises(ShapeError, match=r"their roles read as one exchange"):
        to_messages(dict(row), source, "t:3")
    gsm8k = ("gsm8k (a test's row)", {"prompt": "question", "answer": "answer"}, ("prompt", "answer"), "exchange")
    monkeypatch.setattr(vocab, "SHAPES", (*vocab.SHAPES, gsm8k))
    read = to_messages(dict(row), source, "t:3")
    assert read["messages"] == [{"role": "user", "content": row["question"]},
                                {"role": "assistant", "content": row["answer"]}]


def test_roles_are_inferred_once_per_file(tmp_path: Path, tok: Any) -> None:
    """A file's column roles come from its first rows, once (vocab.file_roles): a column empty in the first row
    keeps the role its other rows give it (the first row's refusal already names it), and a row whose value
    contradicts the file's roles (text where the file's rows hold a chat under a name of no shape) is refused in one
    line naming the file's row. `toolkit inspect-data` prints the same roles."""
    from toolkit.commands.inspect_data import _column_roles

    chat = [{"speaker": "human", "text": "Name a prime."}, {"speaker": "bot", "text": "Seven."}]
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"dialogue_log": chat}, {"dialogue_log": chat},
                                              {"dialogue_log": "a note in place of the chat"}])
    with pytest.raises(ToolkitError, match=rf"^{re.escape(str(mixed))}:3: 'dialogue_log' holds text of 27 "
                                           r"characters, .* where the file's rows hold a chat \(a file's column "
                                           r"roles are inferred once, from its first 64 rows\)"):
        _samples([mixed], tok)
    rows = [{"question": "Name a prime.", "answer": "Seven.", "zqxv_note": ""},
            {"question": "Name an even prime.", "answer": "Two.", "zqxv_note": "the only one there is"}]
    empty_first = _jsonl(tmp_path / "empty_first.jsonl", rows)
    with pytest.raises(ShapeError, match=rf"^{re.escape(str(empty_first))}:1: .*'zqxv_note' as the "):
        _samples([empty_first], tok)
    assert vocab.file_roles(rows, holds_content) == {"question": "prompt", "answer": "answer",
                                                     "zqxv_note": "unknown"}
    assert _column_roles(str(empty_first)) == ["column roles (inferred once, from the first 64 rows): question: "
                                               "prompt, answer: answer, zqxv_note: no role the vocabulary names"]


def test_turn_keys_are_inferred_from_the_turns_not_the_fields_name() -> None:
    """A chat's turn keys come from its turns' values (role-like and content-like keys), whatever field holds them:
    ShareGPT's from/value under `messages` and OpenAI's role/content under `conversations` read the same chat; a
    tag naming one key leaves the other to the turns (here the content `utterance`, not the field's default), and
    the key most turns give wins over one turn's odd keys, whose missing content is named."""
    source = Source(Entry("t.jsonl"), "jsonl", [], "t.jsonl")
    want = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]
    sharegpt = [{"from": "human", "value": "Name a prime."}, {"from": "gpt", "value": "Seven."}]
    openai = [dict(m) for m in want]
    assert to_messages({"messages": sharegpt}, source, "t:1")["messages"] == want
    assert to_messages({"conversations": openai}, source, "t:2")["messages"] == want
    tagged = Source(Entry("t.jsonl", tags=(("role_tag", "who_said"), ("user_tag", "customer"),
                                           ("assistant_tag", "agent"))), "jsonl", [], "t.jsonl")
    turns = [{"who_said": "customer", "utterance": "Name a prime."}, {"who_said": "agent", "utterance": "Seven."}]
    assert to_messages({"conversations": turns}, tagged, "t:3")["messages"] == want
    odd = [*sharegpt, {"from": "human"}]
    with pytest.raises(ToolkitError, match=r"^t:4: conversations\[2\] has no 'value'"):
        to_messages({"conversations": odd}, source, "t:4")
