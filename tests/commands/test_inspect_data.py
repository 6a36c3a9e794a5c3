"""`toolkit inspect-data` reads what training reads: on every data shape the suite trains on (formats, folders,
ShareGPT, Alpaca, a column mapping, a split, a mixture, drop / truncate, packing, data.thinking, train_on: all,
vision-language rows), its "stage 'x' data: ..." line is the one training's data loading logs, and it names rows by
their place in their file."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import CHAT, stock_template
from tests.data.test_shapes import TRAINS, wild_copy
from tests.data.test_sources import ALPACA, ROWS, SHAREGPT, _jsonl, _table, _write
from toolkit.builtin.dummy_data import write_dummy_files
from toolkit.commands.inspect_data import inspect_data
from toolkit.config.load import load_recipe
from toolkit.config.schema import Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.stages import tokenized_cache_dir
from toolkit.runtime.run_dir import RunLayout

LONG = {"messages": [{"role": "user", "content": "Count: " + " ".join(map(str, range(40)))},
                     {"role": "assistant", "content": "Done."}]}


def _recipe(tmp_path: Path, model: str, stages: list[dict[str, Any]], **data: Any) -> Recipe:
    tree = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": model},
            "data": {"max_seq_len": 512, "num_proc": 1, **data},
            "stages": [{"max_steps": 1, **s} for s in stages]}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    return load_recipe(tmp_path / "recipe.yaml")


def _training_lines(recipe: Recipe, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What training's data loading logs per stage: train_curriculum.py's own calls (toolkit/train/setup.py), from
    the model check to the built curriculum, in one CPU process (dummy data: 16 rows a file, as the tests write)."""
    from accelerate import Accelerator

    from toolkit.train.setup import build_stages, check_model, prepare_inputs

    layout, resolved = RunLayout(recipe.output_dir), resolve_stages(recipe)
    accelerator = Accelerator(cpu=True)
    model = recipe.model.name_or_path
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="toolkit"):
        vision = check_model(model, trust_remote_code=recipe.model.trust_remote_code)
        processor, tokenizer = prepare_inputs(recipe, resolved, accelerator, model, layout.dummy_data, vision=vision,
                                              dummy_samples=16)
        build_stages(recipe, resolved, accelerator, tokenizer, processor if vision else None, layout.dummy_data,
                     tokenized_cache_dir(recipe.data.cache_dir, recipe.output_dir))
    return [line for r in caplog.records for line in r.getMessage().splitlines() if line.startswith("stage '")]


def _agree(recipe: Recipe, caplog: pytest.LogCaptureFixture) -> str:
    """inspect-data's report, once its stage lines are shown to be training's."""
    shown = inspect_data(recipe, stage=None, rows=2, colour=False)
    lines = [line for line in shown.splitlines() if line.startswith("stage '")]
    assert len(lines) >= len(recipe.stages)  # a stage's line, and its unread-keys line where it has one
    assert lines == _training_lines(recipe, caplog)
    return shown


def _formats(tmp_path: Path) -> list[dict[str, Any]]:
    import datasets

    stages = [{"name": fmt.replace("_", "-"), "data": [str(_write(fmt, tmp_path / fmt, ROWS))]}
              for fmt in ["jsonl", "json-array", "parquet", "csv", "arrow-stream", "save_to_disk"]]
    shards = tmp_path / "shards"
    for i in range(2):
        _write("jsonl", shards, ROWS, name=f"part-{i}")
    renamed = [{"dialog": r["messages"], "id": i} for i, r in enumerate(ROWS)]
    datasets.DatasetDict({"train": _table(renamed[:1]), "test": _table(renamed[1:])}).save_to_disk(
        str(tmp_path / "dd"))
    _jsonl(tmp_path / "shapes.jsonl", [SHAREGPT, ALPACA, {"instruction": "Say hi.", "output": "Hi."}])
    _jsonl(tmp_path / "pc.jsonl", [{"prompt": "2 + 2 =", "completion": "five", "answer": " 4"},
                                   {"prompt": "3 + 3 =", "completion": "seven", "answer": " 6"}])
    _jsonl(tmp_path / "text.jsonl", [{"text": "Plain text trains on every token."}] * 2)
    return [*stages,
            {"name": "folder", "data": [str(shards)]},
            {"name": "glob", "data": [str(tmp_path / "**" / "part-*.jsonl")]},
            {"name": "split", "data": [{"path": str(tmp_path / "dd"), "split": "test",
                                        "columns": {"messages": "dialog"}}]},
            {"name": "shapes", "data": [str(tmp_path / "shapes.jsonl")]},
            {"name": "columns", "data": [{"path": str(tmp_path / "pc.jsonl"), "columns": {"completion": "answer"}}]},
            {"name": "text", "data": [str(tmp_path / "text.jsonl")]},
            {"name": "mixture", "data": [{"path": str(tmp_path / "jsonl" / "data.jsonl"), "weight": 3},
                                         {"path": str(tmp_path / "shapes.jsonl"), "weight": 1}]}]


@pytest.mark.parametrize("data", [
    {},
    {"overlength": "drop", "max_seq_len": 48},  # only LONG (63 tokens) is over: ROWS are 45, 37 and 24
    {"overlength": "truncate", "max_seq_len": 40, "packing": True},
    {"thinking": "none", "chat_template": stock_template("qwen3"), "overlength": "truncate", "max_seq_len": 48},
    {"train_on": "all", "overlength": "drop", "max_seq_len": 48, "cache_dir": "none"},
], ids=["default", "drop", "truncate-packing", "thinking", "train-on-all-in-memory"])
def test_inspect_data_counts_what_training_loads(tmp_path: Path, models: dict[str, str], data: dict[str, Any],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    stages = _formats(tmp_path)
    _jsonl(tmp_path / "long.jsonl", [*ROWS, LONG, *ROWS])
    stages.append({"name": "long", "data": [str(tmp_path / "long.jsonl")]})
    if data.get("overlength") is None:
        data = {**data, "overlength": "error"}
        stages.pop()  # its row 4 is refused under error (tested below)
    if data.get("train_on") == "all":  # ShareGPT's "weight": 0 turn is refused under train_on: all
        stages = [s for s in stages if "shapes.jsonl" not in json.dumps(s["data"])]
    shown = _agree(_recipe(tmp_path, models["text"], stages, **data), caplog)
    if data.get("overlength") == "drop":
        assert "stage 'long' data: 7 rows, 6 kept" in shown


def test_inspect_data_on_vision_language_rows(tmp_path: Path, models: dict[str, str],
                                              caplog: pytest.LogCaptureFixture) -> None:
    recipe = _recipe(tmp_path, models["vl"], [{"name": "one", "data": ["dummy:vl_stage1"]},
                                              {"name": "two", "data": ["dummy:vl_stage2", "dummy:stage2"]}],
                     overlength="drop", max_seq_len=256)
    write_dummy_files(RunLayout(recipe.output_dir).dummy_data, 16, seed=recipe.train.seed, vision=True)
    shown = _agree(recipe, caplog)
    assert "<|image_pad|>x" in shown


def test_inspect_data_shows_the_mapped_column_and_the_file_line(tmp_path: Path, models: dict[str, str],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A file with both `completion` and `answer`, mapped `completion: answer`, trains `answer` (inspect-data used
    to show `completion`); a row shown is named by its line in the file, not by its place among the kept rows."""
    path = tmp_path / "qa.jsonl"
    rows = [{"prompt": "Q: 2 + 2?", "completion": "wrong", "answer": " four"},
            {"prompt": "Q: " + " ".join(["long"] * 80), "completion": "x", "answer": " y"},
            {"prompt": "Q: 3 + 3?", "completion": "wrong", "answer": " six"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = _recipe(tmp_path, models["text"], [{"name": "qa", "data": [
        {"path": str(path), "columns": {"completion": "answer"}}]}], overlength="drop", max_seq_len=32)
    shown = _agree(recipe, caplog)
    assert "stage 'qa' data: 3 rows, 2 kept" in shown and "1 dropped over max_seq_len" in shown
    assert f"=== stage 'qa' ({path} (columns completion: answer)) ===" in shown
    first, second = shown.split(f"--- {path}:1 ")[1].split(f"--- {path}:3 ")
    assert "[[ four" in first and "[[ six" in second and "wrong" not in shown
    assert f"--- {path}:2 " not in shown


def test_inspect_data_writes_nothing_in_the_output_dir(tmp_path: Path, models: dict[str, str]) -> None:
    """Only the run's token stores, beside the output dir, where training prepares them too."""
    recipe = _recipe(tmp_path, models["text"], [{"name": "a", "data": [str(_jsonl(tmp_path / "a.jsonl", ROWS))]},
                                                {"name": "d", "data": ["dummy:stage1"]}])
    inspect_data(recipe, stage=None, rows=1, colour=False)
    assert not Path(recipe.output_dir).exists()
    assert any((tmp_path / ".toolkit-cache" / "tokenized" / "stores").iterdir())


def test_inspect_data_on_the_peers_shapes(tmp_path: Path, models: dict[str, str],
                                          caplog: pytest.LogCaptureFixture) -> None:
    """LLaMA-Factory registry entries (alpaca with its columns, sharegpt with tags; another entry's missing file
    does not matter), TRL's conversational prompt/completion, ms-swift's query/response and conversation pairs,
    peers' turn flags and a message key nothing reads: inspect-data's lines, the unread-keys line included, are
    training's."""
    lf = tmp_path / "lf"
    lf.mkdir()
    _jsonl(lf / "alpaca.jsonl", [{"q": "Say hi.", "a": "Hi."}, {"q": "2 + 2?", "a": "4."}])
    _jsonl(lf / "chat.jsonl", [{"conversations": [{"speaker": "customer", "text": "Hi?"},
                                                  {"speaker": "agent", "text": "Hello."}]}])
    (lf / "dataset_info.json").write_text(json.dumps({
        "alpaca_demo": {"file_name": "alpaca.jsonl", "columns": {"prompt": "q", "response": "a"}},
        "chat_demo": {"file_name": "chat.jsonl", "formatting": "sharegpt",
                      "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "customer",
                               "assistant_tag": "agent"}},
        "missing": {"file_name": "nope.jsonl"}}))
    user, answer = {"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5."}
    _jsonl(tmp_path / "peers.jsonl", [
        {"prompt": [user], "completion": [answer]},
        {"query": "2 + 3?", "response": "5.", "history": [["1 + 1?", "2."]]},
        {"conversation": [{"human": "2 + 3?", "assistant": "5."}]},
        {"messages": [user, dict(answer, train=False), {"role": "user", "content": "And 1 + 1?"},
                      dict(answer, content="2.", loss=True, lang="en")]}])
    stages = [{"name": "registry", "data": [{"dataset": "alpaca_demo", "dataset_dir": str(lf), "weight": 1},
                                            {"dataset": "chat_demo", "dataset_dir": str(lf), "weight": 1}]},
              {"name": "peers", "data": [str(tmp_path / "peers.jsonl")]}]
    shown = _agree(_recipe(tmp_path, models["text"], stages), caplog)
    assert "stage 'registry' data: 3 rows, 3 kept" in shown and "stage 'peers' data: 4 rows, 4 kept" in shown
    assert "stage 'peers' data: messages carry keys not read: lang (1 rows)" in shown
    assert f"{lf}/dataset_info.json:alpaca_demo (weight 1)" in shown


def test_a_chat_template_override_changes_what_inspect_data_shows(tmp_path: Path, models: dict[str, str],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """data.chat_template: chatml on a Qwen3 model (whose own template writes an empty think block before the last
    answer): inspect-data renders the rows with ChatML, as training does, not with the model's template."""
    _jsonl(tmp_path / "chat.jsonl", [CHAT] * 2)
    stages = [{"name": "one", "data": [str(tmp_path / "chat.jsonl")]}]
    own = inspect_data(_recipe(tmp_path, models["text"], stages), stage=None, rows=1, colour=False)
    chatml = _agree(_recipe(tmp_path, models["text"], stages, chat_template="chatml"), caplog)
    assert "[[<think>\n\n</think>\n\n4.<|im_end|>]]" in own
    assert "<think>" not in chatml and "<|im_start|>assistant\n[[4.<|im_end|>]]" in chatml


# --- `toolkit inspect-data FILE`, no recipe (issue 38) ----------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TRAINS))
def test_inspect_file_prints_the_entry_that_trains_it(name: str, tmp_path: Path, models: dict[str, str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """For each file of the wild corpus: the shape, two rows with their trained spans under the built-in model's
    stock template, and the data entry which, pasted into a recipe, trains every row through training's own data
    loading (the entry's keys are the ones the refusals gave)."""
    from toolkit.commands.inspect_data import inspect_file

    path = wild_copy(tmp_path / "data", name)
    out = inspect_file(str(path), ["data.num_proc=1"], rows=2, colour=False)
    assert out.count("--- ") >= 1 and "[[" in out and "\nshape: " in out, out
    pasted = yaml.safe_load(out.split("data entry to paste into a recipe stage:\n")[1].split("\nwhy")[0])
    entry = pasted["data"][0]
    assert (entry if isinstance(entry, str) else entry["path"]) == str(path)
    assert {k: v for k, v in (entry if isinstance(entry, dict) else {}).items() if k != "path"} == TRAINS[name][1]
    vision = "model builtin:tiny-qwen2.5-vl" in out
    assert vision == (TRAINS[name][0] == "vl")
    recipe = _recipe(tmp_path, models["vl" if vision else "text"], [{"name": "s", "data": pasted["data"]}],
                     max_seq_len=4096)
    lines = _training_lines(recipe, caplog)
    rows = sum(1 for line in path.read_text().splitlines()[1:]) if path.suffix == ".csv" else \
        len(json.loads(path.read_text())) if path.suffix == ".json" and path.read_text().startswith("[") else \
        1 if path.suffix == ".json" else len(path.read_text().splitlines())
    assert f"stage 's' data: {rows} rows, {rows} kept" in lines[0], lines


def test_inspect_file_no_shape_fits(tmp_path: Path) -> None:
    """A file that no shape reads, and whose refusal offers no entry: the keys found and the closest shapes."""
    from toolkit.commands.inspect_data import inspect_file
    from toolkit.errors import ToolkitError

    path = _jsonl(tmp_path / "q.jsonl", [{"instruction": "When did Virgin Australia start operating?",
                                           "category": "closed_qa"}])
    with pytest.raises(ToolkitError, match=r"q.jsonl: no shape reads it as it is \(keys found: \['category', "
                                           r"'instruction'\]; closest shapes: Alpaca: instruction, input, output\)"):
        inspect_file(str(path), [], rows=2, colour=False)


@pytest.mark.parametrize(("name", "pairs", "shape"), [
    ("ms_swift_dpo.jsonl", 2, "ms-swift: messages, rejected_response"),
    ("trl_preference.jsonl", 3, "TRL explicit: prompt, chosen, rejected"),
    ("llamafactory_dpo_en_demo.json", 2, "LLaMA-Factory ranking, sharegpt: conversations, chosen, rejected"),
])
def test_inspect_file_shows_a_pair_file_as_pairs(name: str, pairs: int, shape: str, tmp_path: Path) -> None:
    """A file of preference pairs, given with no recipe, is read as a preference stage's: its line counts pairs,
    and each pair shows its prompt once, then the chosen and the rejected completion with their trained tokens
    marked."""
    from toolkit.commands.inspect_data import inspect_file

    path = wild_copy(tmp_path / "data", name)
    out = inspect_file(str(path), ["data.num_proc=1"], rows=2, colour=False)
    stem = Path(name).stem
    assert f"stage '{stem}' data (dpo): {pairs} pairs, {pairs} kept" in out, out
    assert "tokens per pair" in out and out.count("(pair: ") == 2
    first = out.split("(pair: ")[1]
    assert first.index("\nprompt:\n") < first.index("\nchosen:\n[[") < first.index("\nrejected:\n[[")
    assert first.split("\nchosen:")[0].count("[[") == 0  # the prompt never trains
    assert f"\nshape: preference pairs, {shape}" in out
    assert "the rows are preference pairs: a stage trains them with objective: dpo" in out


def test_inspect_data_on_an_sft_then_dpo_recipe(tmp_path: Path, models: dict[str, str],
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A recipe's preference stage is shown as training loads it: its line counts pairs (training's own line),
    and its first pairs show the prompt once and each completion marked; the SFT stage beside it shows rows."""
    recipe = _recipe(tmp_path, models["text"], [{"name": "sft", "data": ["dummy:stage1"]},
                                                {"name": "dpo", "data": ["dummy:pairs"], "objective": "dpo"}])
    write_dummy_files(RunLayout(recipe.output_dir).dummy_data, 16, seed=recipe.train.seed, vision=False)
    shown = _agree(recipe, caplog)
    assert "stage 'sft' data: 16 rows, 16 kept" in shown and "stage 'dpo' data (dpo): 16 pairs, 16 kept" in shown
    dpo = shown.split("=== stage 'dpo'")[1]
    assert "tokens per pair" in dpo and dpo.count("(pair: ") == 2
    assert dpo.index("\nprompt:\n") < dpo.index("\nchosen:\n[[") < dpo.index("\nrejected:\n[[")


def test_row_text_is_shown_as_text_never_as_terminal_controls(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A row setting the window title (OSC 0), writing the clipboard (OSC 52) and hiding text (SGR 8): `toolkit
    inspect-data` prints them escaped as `cat -v` does (ESC is ^[, BEL ^G, CR ^M, C1 CSI M-^[), in the row and in
    an error line; nothing of them reaches the terminal raw."""
    from toolkit.commands import cli
    from toolkit.errors import as_terminal_text

    hostile = ("\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[8mhidden\x1b[0m\rover\x7f\x9b2J")
    assert as_terminal_text(hostile) == "^[]0;owned^G^[]52;c;cm0gLXJmIH4=^G^[[8mhidden^[[0m^Mover^?M-^[2J"
    assert as_terminal_text("tab\tand\nnewline, ünïcödé") == "tab\tand\nnewline, ünïcödé"
    path = _jsonl(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": hostile},
                                                           {"role": "assistant", "content": "ok " + hostile}]}])
    capsys.readouterr()
    assert cli.main(["inspect-data", str(path), "data.num_proc=1"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\x9b" not in out
    assert out.count("^[]52;c;cm0gLXJmIH4=^G") == 2
    bad = tmp_path / "bad\x1b]0;x\x07.jsonl"
    bad.write_text("{not json\n{}\n")
    assert cli.main(["inspect-data", str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the built-in model's progress bars, if it was built now
    assert err.startswith("error: ") and "\x1b" not in err and "\x07" not in err and "^[]0;x^G" in err


RL = {"num_generations": 2, "max_completion_length": 16}


def test_inspect_data_shows_an_rl_stage_s_prompts_and_references(tmp_path: Path, models: dict[str, str],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A grpo stage's GSM8K rows through `columns: {prompt, reference}`: training's data line, each prompt as the
    rollout feeds it and its reference; TRL's conversational prompt-only rows rendered with the generation prompt."""
    gsm8k = wild_copy(tmp_path, "gsm8k.jsonl")
    trl = wild_copy(tmp_path, "trl_prompt_only.jsonl")
    recipe = _recipe(tmp_path, models["text"], [
        {"name": "rl", "objective": "grpo", "rewards": [{"scorer": "math"}], "rl": RL,
         "micro_batch_size": 2,
         "data": [{"path": str(gsm8k), "columns": {"prompt": "question", "reference": "answer"}}]},
        {"name": "chat", "objective": "grpo", "rewards": [{"scorer": "json_valid"}], "rl": RL,
         "micro_batch_size": 2,
         "data": [str(trl)]}])
    shown = _agree(recipe, caplog)
    rl, chat = shown.split("=== stage 'rl'")[1].split("=== stage 'chat'")
    assert "stage 'rl' data (grpo): 1 prompts, 1 kept" in rl and f"--- {gsm8k}:1 (prompt: " in rl
    assert "\nNatalia sold clips to 48 of her friends" in rl and "reference: 'Natalia sold 48/2" in rl
    assert "#### 72'" in rl
    assert "stage 'chat' data (grpo): 2 prompts, 2 kept" in chat and chat.count("reference: none") == 2
    assert "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n" in chat
def test_inspect_data_shows_and_saves_a_video_rows_frames(tmp_path: Path) -> None:
    """A video row's frames as the model sees them: count, sampled fps, size and tokens per frame pair, and with
    --save-frames the frames themselves (the frame list's four frames, greys 0, 10, 20, 30)."""
    import numpy as np
    from PIL import Image

    from tests.helpers.video_files import frame_levels, level
    from toolkit.commands.inspect_data import inspect_file

    path = wild_copy(tmp_path / "data", "qwenvl_frame_list.jsonl")
    out = inspect_file(str(path), ["data.num_proc=1"], rows=1, colour=False, save_frames=tmp_path / "frames")
    assert re.search(r"video 0: \['path/to/frame1.jpg', .*\]: 4 frames at 1 fps \(of 4 at 1 fps; frames "
                     r"\[0, 1, 2, 3\]\), \d+x\d+ px, \d+ tokens per frame pair, \d+ tokens", out), out
    saved = sorted((tmp_path / "frames").glob("*.png"))
    assert len(saved) == 4
    assert frame_levels(np.stack([np.asarray(Image.open(p)) for p in saved])) == [level(k) for k in range(4)]
