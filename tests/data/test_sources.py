"""The formats users bring (toolkit/data/sources.py): every format, folders and globs of shards, a hub dataset from
the local cache (offline), split and column mapping per entry, ShareGPT and Alpaca rows; each gives the same
training rows as the JSON Lines file of the same rows, and a row missing a field names its file, row and field."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

import toolkit.data.encoding as encoding_mod
from toolkit.builtin.text_model import build_tokenizer
from toolkit.data.encoding import encode_row
from toolkit.data.plan import encode_files
from toolkit.data.sources import Entry
from toolkit.errors import ToolkitError

CHAT = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."},
        {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "It is 8."}]
ROWS: list[dict[str, Any]] = [
    {"messages": CHAT},
    {"messages": [{"role": "system", "content": "Be brief."}, *CHAT[:2]]},
    {"messages": CHAT[:2]},
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def _samples(sources: list[Any], tok: PreTrainedTokenizerFast, cache: Path | None = None) -> list[dict]:
    return encode_files(sources, tok, max_seq_len=512, overlength="error", train_on="assistant",
                        cache_dir=cache).samples


def _expected(rows: list[dict[str, Any]], tok: PreTrainedTokenizerFast) -> list[dict]:
    return [dict(zip(("input_ids", "labels"), encode_row(r, tok, "assistant", "f"), strict=True)) for r in rows]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a datasets table; messages as a list of {role, content} structs."""
    import datasets

    return datasets.Dataset.from_list(rows)


def _write(fmt: str, folder: Path, rows: list[dict[str, Any]], name: str = "data") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        return _jsonl(folder / f"{name}.jsonl", rows)
    if fmt == "json-array":
        path = folder / f"{name}.json"
        path.write_text(json.dumps(rows, indent=1))
        return path
    if fmt == "json-lines":
        return _jsonl(folder / f"{name}.json", rows)
    if fmt == "parquet":
        path = folder / f"{name}.parquet"
        _table(rows).to_parquet(str(path))
        return path
    if fmt in ("csv", "tsv"):
        path = folder / f"{name}.{fmt}"
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["messages"], delimiter="," if fmt == "csv" else "\t")
            writer.writeheader()
            writer.writerows({"messages": json.dumps(r["messages"])} for r in rows)
        return path
    if fmt in ("arrow-stream", "arrow-file"):
        import pyarrow as pa

        path = folder / f"{name}.arrow"
        table = _table(rows).data.table
        with pa.OSFile(str(path), "wb") as sink:
            writer = (pa.ipc.new_stream if fmt == "arrow-stream" else pa.ipc.new_file)(sink, table.schema)
            writer.write_table(table)
            writer.close()
        return path
    if fmt == "save_to_disk":
        path = folder / name
        _table(rows).save_to_disk(str(path))
        return path
    raise AssertionError(fmt)


FORMATS = ["jsonl", "json-array", "json-lines", "parquet", "csv", "tsv", "arrow-stream", "arrow-file", "save_to_disk"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_gives_the_jsonl_rows(tmp_path: Path, tok: PreTrainedTokenizerFast, fmt: str) -> None:
    path = _write(fmt, tmp_path / "in", ROWS)
    assert _samples([path], tok, tmp_path / "cache") == _expected(ROWS, tok)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_folder_or_a_glob_of_shards(tmp_path: Path, tok: PreTrainedTokenizerFast, fmt: str) -> None:
    shards = tmp_path / "shards"
    for i, rows in enumerate([ROWS[:1], ROWS[1:], ROWS[:2]]):
        _write(fmt, shards, rows, name=f"part-{i:03d}")
    (shards / "README.md").write_text("not data")
    want = _expected([*ROWS[:1], *ROWS[1:], *ROWS[:2]], tok)
    assert _samples([shards], tok) == want
    assert _samples([str(shards / f"part-*.{fmt}")], tok) == want
    assert _samples([str(tmp_path / f"**/part-00[12].{fmt}")], tok) == want[1:]


def test_a_bad_row_in_a_shard_names_that_shard(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    _write("parquet", tmp_path / "shards", ROWS, name="a")
    bad = _write("parquet", tmp_path / "shards", [ROWS[0], {"messages": [{"role": "robot", "content": "x"}]}],
                 name="b")
    with pytest.raises(ToolkitError, match=rf"^{bad} row 2: messages\[0\] must have a role"):
        _samples([tmp_path / "shards"], tok)
    _write("jsonl", tmp_path / "mixed", ROWS, name="a")
    _write("parquet", tmp_path / "mixed", ROWS, name="b")
    with pytest.raises(ToolkitError, match=r"holds files of several formats \(jsonl, parquet\); give one entry"):
        _samples([tmp_path / "mixed"], tok)
    with pytest.raises(ToolkitError, match=r"matches no file"):
        _samples([str(tmp_path / "nothing-*.jsonl")], tok)


def test_split_and_columns_per_entry(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    import datasets

    renamed = [{"dialog": r["messages"], "id": i} for i, r in enumerate(ROWS)]
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": _table(renamed[:1]), "test": _table(renamed[1:])}).save_to_disk(str(folder))
    columns = (("messages", "dialog"),)
    assert _samples([Entry(str(folder), None, columns)], tok) == _expected(ROWS[:1], tok)
    assert _samples([Entry(str(folder), "test", columns)], tok) == _expected(ROWS[1:], tok)
    with pytest.raises(ToolkitError, match=rf"Data entry {folder} has no split 'dev'; its splits are \['test', "
                                           r"'train'\]"):
        _samples([Entry(str(folder), "dev", columns)], tok)
    path = _jsonl(tmp_path / "renamed.jsonl", renamed)
    want = _expected(ROWS, tok)
    for _ in range(2):  # the second time from its store
        before = encoding_mod.ENCODE_CALLS
        assert _samples([Entry(str(path), None, columns)], tok, tmp_path / "cache") == want
    assert before == encoding_mod.ENCODE_CALLS
    with pytest.raises(ToolkitError, match=rf"^{path}:1: no field 'chat' \(columns.messages of data entry"):
        _samples([Entry(str(path), None, (("messages", "chat"),))], tok)


def _cached_hub_dataset(home: Path, repo: str, splits: dict[str, list[dict[str, Any]]]) -> None:
    """A dataset as `datasets.load_dataset(repo)` leaves it in HF_HOME's datasets cache, built offline."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    owner, name = repo.split("/")
    folder = home / "datasets" / f"{owner}___{name}" / "default" / "0.0.0" / "0123456789abcdef"
    folder.mkdir(parents=True)
    infos = datasets.SplitDict(dataset_name=name)
    features = None
    for split, rows in splits.items():
        table = _table(rows)
        features = table.features
        with ArrowWriter(path=str(folder / f"{name}-{split}.arrow")) as writer:
            writer.write_table(table.data.table)
            writer.finalize()
        infos.add(datasets.SplitInfo(name=split, num_examples=len(rows), dataset_name=name))
    datasets.DatasetInfo(features=features, config_name="default", dataset_name=name,
                         splits=infos).write_to_directory(str(folder))


def offline_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh Hugging Face home under tmp_path, offline: hub datasets come only from what a test caches there."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_hub_dataset_from_the_local_cache(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    home = offline_hf_home(tmp_path, monkeypatch)
    _cached_hub_dataset(home, "someone/tiny-chat", {"train": ROWS, "validation": ROWS[:1]})
    assert _samples(["someone/tiny-chat"], tok, tmp_path / "cache") == _expected(ROWS, tok)
    assert _samples([Entry("someone/tiny-chat", "validation")], tok) == _expected(ROWS[:1], tok)
    with pytest.raises(ToolkitError, match=r"no hub dataset 'someone/other' is in the local Hugging Face cache"):
        _samples(["someone/other"], tok)
    with pytest.raises(ToolkitError, match=r"^Data file data/chat.jsonl does not exist"):
        _samples(["data/chat.jsonl"], tok)  # a path with a data suffix is never taken for a hub id


SHAREGPT = {"conversations": [{"from": "human", "value": "What is 2 + 3?"}, {"from": "gpt", "value": "5."},
                              {"from": "human", "value": "And 4 + 4?"},
                              {"from": "gpt", "value": "It is 8.", "weight": 0}],
            "system": "Be brief."}
ALPACA = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5.", "system": "Be brief.",
          "history": [["What is 1 + 1?", "2."]]}


def test_sharegpt_and_alpaca_become_messages(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _jsonl(tmp_path / "mixed.jsonl", [SHAREGPT, ALPACA, {"instruction": "Say hi.", "output": "Hi."}])
    want = [
        {"messages": [{"role": "system", "content": "Be brief."}, *CHAT[:3], dict(CHAT[3], weight=0)]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"},
                      {"role": "assistant", "content": "2."}, {"role": "user", "content": "Add the numbers.\n2 and 3"},
                      {"role": "assistant", "content": "5."}]},
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]},
    ]
    got = _samples([path], tok)
    assert got == _expected(want, tok)
    trained = [t for t, lab in zip(got[0]["input_ids"], got[0]["labels"], strict=True) if lab != -100]
    assert tok.decode(trained) == "5.<|im_end|>"  # the turn with weight 0 is left out
    parquet = _write("parquet", tmp_path, [SHAREGPT], name="sharegpt")  # the same through a typed table
    assert _samples([parquet], tok) == got[:1]


def test_sharegpt_tool_calls(tmp_path: Path, qwen_tokenizer: Any) -> None:
    """LLaMA-Factory's function_call / observation turns and its `tools` string reach Qwen3's template."""
    import copy

    from tests.conftest import stock_template

    tok = copy.copy(qwen_tokenizer)
    tok.chat_template = stock_template("qwen3")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    row = {"conversations": [{"from": "human", "value": "Add 2 and 3."},
                             {"from": "function_call", "value": json.dumps({"name": "add",
                                                                            "arguments": {"a": 2, "b": 3}})},
                             {"from": "observation", "value": "5"}, {"from": "gpt", "value": "It is 5."}],
           "tools": json.dumps(tools)}
    messages = [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
    path = _jsonl(tmp_path / "tools.jsonl", [row])
    assert _samples([path], tok) == _expected([{"messages": messages, "tools": tools}], tok)


@pytest.mark.parametrize(("row", "error"), [
    ({"conversations": [{"from": "human"}]}, r"conversations\[0\] has no 'value'"),
    ({"conversations": [{"value": "hi"}]}, r"conversations\[0\] has no 'from'"),
    ({"conversations": [{"from": "robot", "value": "hi"}]}, r"conversations\[0\]\.from is 'robot'; known speakers"),
    ({"conversations": "hello"}, r"'conversations' must be a non-empty list"),
    ({"conversations": [{"from": "human", "value": "a"}], "messages": CHAT},
     r"the row has both 'messages' and 'conversations'"),
    ({"instruction": "Add two."}, r"a row needs .*'instruction' is a prompt with no answer beside it"),
    ({"instruction": "Add.", "output": "5.", "text": "x"},
     r"the row has both 'instruction' and 'text', two shapes that are not one dialog twice"),
    ({"instruction": "Add.", "output": "5.", "history": [["q"]]}, r"'history' must be a list of \[instruction, "),
])
def test_a_row_missing_a_field_names_file_row_and_field(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                        row: dict[str, Any], error: str) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [ROWS[0], row])
    with pytest.raises(ToolkitError, match=rf"^{path}:2: {error}"):
        _samples([path], tok)
    table = _write("json-array", tmp_path, [ROWS[0], row], name="arr")
    with pytest.raises(ToolkitError, match=rf"^{table} row 2: {error}"):
        _samples([table], tok)


def test_bad_files_are_one_line_errors(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    (tmp_path / "broken.json").write_text('[{"messages": ')
    with pytest.raises(ToolkitError, match=r"broken.json: not valid JSON"):
        _samples([tmp_path / "broken.json"], tok)
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(ToolkitError, match=r"Data entry .*broken.parquet could not be read as parquet"):
        _samples([tmp_path / "broken.parquet"], tok)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ToolkitError, match=r"unknown format '.txt'"):
        _samples([tmp_path / "notes.txt"], tok)
    csv_path = tmp_path / "bad.csv"
    csv_path.write_text('messages\n"[{""role"": "\n')
    with pytest.raises(ToolkitError, match=rf"^{csv_path} row 1: field 'messages' is text that is not valid JSON"):
        _samples([csv_path], tok)


def test_a_run_trains_on_them(tmp_path: Path, models: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                              caplog: pytest.LogCaptureFixture) -> None:
    """Through a recipe: a parquet file with a column mapping, a glob of ShareGPT shards, Alpaca eval rows."""
    import yaml

    from tests.conftest import base_recipe
    from tests.helpers.inprocess import Call, invoke

    _write("parquet", tmp_path, [{"dialog": r["messages"]} for r in ROWS * 4], name="chat")
    for i in range(2):
        _jsonl(tmp_path / f"share-{i}.jsonl", [SHAREGPT] * 4)
    _jsonl(tmp_path / "eval.jsonl", [ALPACA] * 2)
    recipe = base_recipe(models["text"]) | {"stages": [
        {"name": "parquet", "data": [{"path": "chat.parquet", "columns": {"messages": "dialog"}}], "max_steps": 1},
        {"name": "sharegpt", "data": ["share-*.jsonl"], "max_steps": 1}], "eval": {"data": ["eval.jsonl"]}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rc, stderr = invoke(Call(["--config", "recipe.yaml"], tmp_path / "run"), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert "stage 'parquet' data: 12 rows, 12 kept" in caplog.text and "stage 'sharegpt' data: 8 rows, 8 kept" in \
        caplog.text
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records if "loss" in r] == ["parquet", "sharegpt"]
    assert sum("eval_loss" in r for r in records) == 2


# --- walking folders: each real file once; never a non-regular file -------------------------------------------------

def _within(seconds: float, fn: Any) -> Any:
    """fn() on a daemon thread; the test fails (instead of hanging) when it has not returned in time."""
    import threading

    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # re-raised on the test's thread
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.mark.parametrize("loops", [1, 2])
def test_a_glob_over_symlink_loops_visits_each_file_once(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                         loops: int) -> None:
    """`sub/up -> ..` made `**` list one file 41 times (and train on it); two such links never finished."""
    from toolkit.data.sources import resolve_source

    data = tmp_path / "data"
    data.mkdir()
    _jsonl(data / "a.jsonl", ROWS)
    for i in range(loops):
        (data / f"sub{i}").mkdir()
        (data / f"sub{i}" / "up").symlink_to("..", target_is_directory=True)
    (data / "deep").mkdir()
    _jsonl(data / "deep" / "b.jsonl", ROWS[:1])
    (data / "again.jsonl").symlink_to("a.jsonl")  # a second name of a file listed already
    source = _within(20, lambda: resolve_source(Entry(str(data / "**" / "*.jsonl")), tmp_path))
    assert source.files == [data / "a.jsonl", data / "deep" / "b.jsonl"]
    assert _within(20, lambda: _samples([str(tmp_path / "**" / "*.jsonl")], tok)) == _expected([*ROWS, ROWS[0]], tok)
    assert resolve_source(Entry(str(data)), tmp_path).files == [data / "a.jsonl"]  # the folder itself, once
    # A link to a folder outside the pattern's root is followed, once.
    other = tmp_path / "other"
    other.mkdir()
    _jsonl(other / "c.jsonl", ROWS[:1])
    (data / "linked").symlink_to(other, target_is_directory=True)
    (data / "linked2").symlink_to(other, target_is_directory=True)
    files = _within(20, lambda: resolve_source(Entry(str(data / "**" / "*.jsonl")), tmp_path).files)
    assert files == [data / "a.jsonl", data / "deep" / "b.jsonl", data / "linked" / "c.jsonl"]


def test_glob_matches_as_glob_does(tmp_path: Path) -> None:
    """The walk matches what glob.glob(recursive=True) matches, on a tree without links."""
    import glob

    from toolkit.data.sources import walk_glob

    for rel in ["a.jsonl", "b.json", ".hidden.jsonl", "x/c.jsonl", "x/y/d.jsonl", "x/.h/e.jsonl", "z/part-1.jsonl",
                "z/part-2.jsonl", "z/part-10.jsonl"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}\n")
    for pattern in ["*.jsonl", "**/*.jsonl", "x/**", "**/part-?.jsonl", "z/part-[12].jsonl", "*/*.jsonl",
                    ".*.jsonl", "x/**/d.jsonl", "**/x/*.jsonl"]:
        full = str(tmp_path / pattern)
        want = sorted(Path(p) for p in glob.glob(full, recursive=True) if Path(p).is_file())
        assert walk_glob(full) == want, pattern


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_device_is_not_a_regular_file(tmp_path: Path, tok: PreTrainedTokenizerFast, kind: str) -> None:
    """It used to be reported as "does not exist"; it must never be opened (opening a FIFO blocks)."""
    import os

    if kind == "fifo":
        path = tmp_path / "pipe.jsonl"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    message = rf"^Data file {path} is not a regular file \(a FIFO, device or socket\)"
    with pytest.raises(ToolkitError, match=message):
        _within(20, lambda: _samples([path], tok))
    if kind == "fifo":  # inside a folder or a glob it is refused too, not skipped
        _jsonl(tmp_path / "a.jsonl", ROWS)
        for entry in [tmp_path, str(tmp_path / "*.jsonl")]:
            with pytest.raises(ToolkitError, match=message):
                _within(20, lambda e=entry: _samples([e], tok))


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_hash_record_planted_in_the_cache_is_refused(tmp_path: Path, planted: str) -> None:
    """`hashes/<sha of the path>.json` has a predictable name in a shared cache: a link there is never read through
    (nor written through), a FIFO never blocks the launch (issue 39)."""
    import hashlib
    import os

    from toolkit.data.sources import content_digest

    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "x"}\n')
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    record = tmp_path / "cache" / "hashes" / f"{hashlib.sha256(str(data.resolve()).encode()).hexdigest()}.json"
    record.parent.mkdir(parents=True)
    record.symlink_to(victim) if planted == "symlink" else os.mkfifo(record)
    with pytest.raises(ToolkitError, match="symbolic link" if planted == "symlink" else "not a regular file") as e:
        content_digest(data, tmp_path / "cache")
    assert str(record) in str(e.value) and "\n" not in str(e.value)
    assert victim.read_text() == "the user's own file\n"


def test_json_lines_read_as_json_reads_them(tmp_path: Path) -> None:
    """The fast parser (orjson) gives every line the object json gives: integers beyond 64 bits stay whole, NaN and
    1e400 read as json reads them, unicode escapes and surrogate pairs decode alike, a line of non-ASCII spaces is
    blank; and a malformed line is json's error."""
    from toolkit.data.sources import _fast_loads, iter_jsonl

    assert _fast_loads is not None  # a dependency: the test would prove nothing without it
    lines = ['{"a": 12345678901234567890123}', '{"a": -9223372036854775809}', '{"a": 18446744073709551616}',
             '{"a": NaN, "b": 1e400, "c": -0.0}', '{"t": "\\u00e9\\ud83d\\ude00 数学", "k": 1, "k": 2}',
             '\u00a0\u2028', '{"d": {"e": [1.5, null, true]}}']
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    got = list(iter_jsonl(path))
    want = [(n, json.loads(line)) for n, line in enumerate(lines, 1) if not line.isspace()]
    assert repr(got) == repr(want)  # repr: types (int against float) and NaN compared too
    path.write_text('{"a": 1}\n{"a": 1,}\n', encoding="utf-8")
    with pytest.raises(ToolkitError, match=r"rows.jsonl:2: not valid JSON \(Expecting property name"):
        list(iter_jsonl(path))


def test_the_row_byte_cap_holds_for_json_arrays_one_object_files_and_csv_lines(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48: only JSON Lines had the byte cap. A .json file over the cap's floor is read element by element:
    a row over the cap stands unread as an Oversize (what data.overlength drop drops, and error refuses), the rest
    parse as they would whole, escaped quotes and brackets inside strings and all; a one-object file over it is one
    Oversize; a CSV line over it is refused in one line naming it before pandas parses the file."""
    import toolkit.data.sources as sources

    monkeypatch.setattr(sources, "ROW_BYTES_FLOOR", 2000)
    small = [{"instruction": f'say "{i}" [x] {{y}} \\\\', "input": "", "output": "ok"} for i in range(40)]
    big = {"instruction": "long", "input": "", "output": "z" * 5000}
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([*small[:20], big, *small[20:]], indent=1))
    source = sources.resolve_source(Entry(str(array)), tmp_path)
    sources.open_source(source)
    (rows,) = source.arrays
    assert isinstance(rows[20], sources.Oversize) and rows[20].size == len(json.dumps(big, indent=1).replace(
        "\n", "\n ").encode()) and rows[20].cap == 2000
    assert rows[:20] + rows[21:] == small
    one = tmp_path / "one.json"
    one.write_text(json.dumps(big, indent=1))  # over several lines: one object, not JSON Lines
    source = sources.resolve_source(Entry(str(one)), tmp_path)
    sources.open_source(source)
    assert source.fmt == "json" and source.arrays == [[sources.Oversize(len(json.dumps(big, indent=1)), 2000)]]
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(small * 2)[:-1])
    with pytest.raises(ToolkitError, match=r"cut.json: not valid JSON \(the array is not closed"):
        sources.open_source(sources.resolve_source(Entry(str(cut)), tmp_path))

    table = tmp_path / "rows.csv"
    table.write_text("instruction,output\nhi,there\n" + "long," + "z" * 3000 + "\nbye,now\n")
    with pytest.raises(ToolkitError, match=r"rows.csv:3: the line is over the 2,000-byte cap on one row"):
        sources.open_source(sources.resolve_source(Entry(str(table)), tmp_path))


def test_the_row_byte_cap_holds_for_parquet_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48: a table's rows were materialised whole (`to_pylist`), however large. A piece whose Arrow bytes
    are over the cap's floor is read row by row: a row over the cap (its Arrow bytes) stands unread as an Oversize,
    what data.overlength drop drops and error refuses; the others read as they would."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import toolkit.data.sources as sources

    monkeypatch.setattr(sources, "ROW_BYTES_FLOOR", 2000)
    rows = [{"instruction": f"say {i}", "output": "ok"} for i in range(4)]
    rows.insert(2, {"instruction": "long", "output": "z" * 5000})
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    source = sources.resolve_source(Entry(str(path)), tmp_path)
    sources.open_source(source)
    got = [row for piece in sources.pieces(source) for row in sources.raw_rows(source, piece, lambda: 200)]
    assert [n for n, _ in got] == [1, 2, 3, 4, 5]
    assert isinstance(got[2][1], sources.Oversize) and got[2][1].cap == 2400 and got[2][1].size > 5000
    assert [r for _, r in got[:2] + got[3:]] == rows[:2] + rows[3:]
    assert [r for piece in sources.pieces(source) for _, r in sources.raw_rows(source, piece)] == rows
