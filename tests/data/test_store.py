"""The token store (toolkit/data/store.py) and the row plan over it (toolkit/data/plan.py): one preparation per
key, every key part invalidates, length policies are views, damaged or half-written stores are never read as
complete, concurrent and waiting processes prepare once, a failed preparation reaches its waiters in one line."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

import toolkit.data.encoding as encoding_mod
import toolkit.data.sources as sources_mod
import toolkit.data.store as store_mod
from toolkit.builtin.text_model import build_tokenizer
from toolkit.data.encoding import TextEncoder, encode_row
from toolkit.data.plan import encode_files, load_training_set, select_rows
from toolkit.data.sources import Entry, resolve_source
from toolkit.data.store import open_store
from toolkit.errors import ToolkitError
from toolkit.templates import stock_template

CHAT = [
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "17 + 25 = 42."},
]
ROWS: list[dict[str, Any]] = [
    {"messages": CHAT, "difficulty": 2},
    {"text": "the quick brown fox jumps over the lazy dog " * 6, "id": "long", "score": 0.25},
    {"prompt": "What is 2 + 3?", "completion": " 5.", "tags": ["math", None]},
    {"text": "the cat"},
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(path: Path, tok: PreTrainedTokenizerFast, cache: Path | None, *, max_seq_len: int = 40,
          overlength: str = "truncate", train_on: str = "assistant", thinking: str = "auto", num_proc: int = 1
          ) -> tuple[Any, int]:
    """The loaded rows and how many rows this process tokenised to get them."""
    before = encoding_mod.ENCODE_CALLS
    data = encode_files([path], tok, max_seq_len=max_seq_len, overlength=overlength, train_on=train_on,
                        thinking=thinking, cache_dir=cache, num_proc=num_proc)
    return data, encoding_mod.ENCODE_CALLS - before


def _stores(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "stores").iterdir() if p.is_dir() and not p.name.startswith("."))


def _expected(rows: list[dict[str, Any]], tok: PreTrainedTokenizerFast, max_seq_len: int = 40) -> list[dict]:
    """What encoding each row alone and cutting it gives (truncate policy)."""
    out = []
    for row in rows:
        ids, labels = encode_row(row, tok, "assistant", "f")
        if any(label != -100 for label in labels[:max_seq_len]):
            out.append({"input_ids": ids[:max_seq_len], "labels": labels[:max_seq_len]})
    return out


def test_prepared_once_then_mapped(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    in_memory, n0 = _load(path, tok, None)
    first, n1 = _load(path, tok, cache)
    second, n2 = _load(path, tok, cache)
    assert (n0, n1, n2) == (len(ROWS), len(ROWS), 0)
    assert in_memory.stats.truncated == 1
    for got in (first, second):
        assert got.samples == in_memory.samples == _expected(ROWS, tok)
        assert got.stats == in_memory.stats
        assert got.difficulty == [2.0, None, None, None]
    (store,) = _stores(cache)
    # verified.json too, once the store is older than the racy window when it is checked
    assert sorted(p.name for p in store.iterdir() if p.name != "verified.json") == ["data.arrow", "meta.json"]


def test_store_is_a_datasets_arrow_file(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """The store is datasets' own cache-file format: `datasets.Dataset.from_file` maps it, columns and all."""
    import datasets

    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    _load(path, tok, tmp_path / "cache")
    (store,) = _stores(tmp_path / "cache")
    ds = datasets.Dataset.from_file(str(store / "data.arrow"))
    assert len(ds) == len(ROWS) and ds.column_names[:4] == ["input_ids", "mask", "length", "label_tokens"]
    ids, labels = encode_row(ROWS[0], tok, "assistant", "f")
    assert ds[0]["input_ids"] == ids and [t if m else -100 for t, m in zip(ids, ds[0]["mask"], strict=True)] == labels
    assert ds[2]["number"] == 3 and json.loads((store / "meta.json").read_text())["rows"] == len(ROWS)


def test_length_policies_are_views_of_one_store(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """max_seq_len and overlength are applied to the store's columns: no new store, no re-tokenising."""
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    _load(path, tok, cache)
    for kw in ({"max_seq_len": 50}, {"overlength": "drop"}, {"max_seq_len": 12, "overlength": "truncate"}):
        got, n = _load(path, tok, cache, **kw)
        expected, _ = _load(path, tok, None, **kw)
        assert n == 0 and (got.samples, got.stats) == (expected.samples, expected.stats)
    assert len(_stores(cache)) == 1
    with pytest.raises(ToolkitError, match=rf"^{path}:2: \d+ tokens, over data.max_seq_len=40"):
        _load(path, tok, cache, overlength="error")
    assert _load(path, tok, cache, max_seq_len=512, overlength="error")[1] == 0


def _other_template(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("'<|im_end|>' + '\\n'", "'<|im_end|>' + '\\n\\n'")
    assert other.chat_template != tok.chat_template
    return other


def _extra_special(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    other = copy.deepcopy(tok)
    other.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    return other


@pytest.mark.parametrize("change", ["chat_template", "special_token", "train_on", "content_same_size",
                                    "content_appended"])
def test_each_key_part_invalidates(tmp_path: Path, tok: PreTrainedTokenizerFast, change: str) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    _load(path, tok, cache)
    kw: dict[str, Any] = {}
    new_tok = tok
    if change == "chat_template":
        new_tok = _other_template(tok)
    elif change == "special_token":
        new_tok = _extra_special(tok)
    elif change == "train_on":
        kw["train_on"] = "all"
    elif change == "content_same_size":  # same size, written at once: only the content hash can tell
        text = path.read_text()
        path.write_text(text.replace("17 + 25 = 42", "17 + 25 = 43"))
        assert len(path.read_text()) == len(text)
    else:
        _write_jsonl(path, [*ROWS, {"text": "one more row"}])
    got, n = _load(path, new_tok, cache, **kw)
    assert n > 0
    expected, _ = _load(path, new_tok, None, **kw)
    assert (got.samples, got.stats) == (expected.samples, expected.stats)
    assert len(_stores(cache)) == 2
    assert _load(path, new_tok, cache, **kw)[1] == 0  # and the new key is prepared in turn


def test_thinking_mode_changes_the_store(tmp_path: Path, qwen_tokenizer: Any) -> None:
    """With Qwen3's stock template, data.thinking changes the tokens, and each mode has its own store."""
    from tests.conftest import stock_template

    tok = copy.copy(qwen_tokenizer)
    tok.chat_template = stock_template("qwen3")
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    cache = tmp_path / "cache"
    auto, n_auto = _load(path, tok, cache, max_seq_len=512)
    none, n_none = _load(path, tok, cache, max_seq_len=512, thinking="none")
    assert n_auto == n_none == 1 and len(_stores(cache)) == 2
    assert len(auto.samples[0]["input_ids"]) == len(none.samples[0]["input_ids"]) + 4  # <think>\n\n</think>\n\n
    assert _load(path, tok, cache, max_seq_len=512)[0].samples == auto.samples
    assert _load(path, tok, cache, max_seq_len=512, thinking="none")[0].samples == none.samples


def test_worker_processes_give_the_same_store(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces encoded by a pool of processes, in order: the same rows as one process; the first bad row in file
    order is the one named even when a later piece fails first."""
    monkeypatch.setattr(store_mod, "PIECE_ROWS", 7)
    monkeypatch.setattr(store_mod, "ROWS_PER_PROCESS", 10)
    monkeypatch.setattr(sources_mod, "_jsonl_piece_bytes", lambda per_row, rows: 64)
    rows = [dict(r, n=i) for i, r in enumerate(ROWS * 15)]
    path = _write_jsonl(tmp_path / "a.jsonl", rows)
    one, _ = _load(path, tok, tmp_path / "one")
    meta_one = json.loads((_stores(tmp_path / "one")[0] / "meta.json").read_text())
    pool, _ = _load(path, tok, tmp_path / "pool", num_proc=2)
    meta_pool = json.loads((_stores(tmp_path / "pool")[0] / "meta.json").read_text())
    assert (meta_one["prepared"]["processes"], meta_pool["prepared"]["processes"]) == (1, 2)
    assert pool.samples == one.samples and pool.stats == one.stats
    bad = [*rows[:40], {"foo": 1}, *rows[40:55], {"messages": []}, *rows[55:]]
    path = _write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(ToolkitError, match=rf"^{path}:41: a row needs"):
        _load(path, tok, tmp_path / "pool", num_proc=2)


def test_progress_bar_and_log_line(tmp_path: Path, tok: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(store_mod, "BAR_MIN_ROWS", 1)
    monkeypatch.setattr(store_mod, "BAR_DELAY_S", 0.0)
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS * 10)
    with caplog.at_level(logging.INFO, logger="toolkit.data"):
        _load(path, tok, tmp_path / "cache")
    err = capsys.readouterr().err
    assert f"tokenising {path}: 100%" in err and "rows/s]" in err and "<00:00" in err  # rate and time left
    (store,) = _stores(tmp_path / "cache")
    line = next(r.getMessage() for r in caplog.records if "prepared" in r.getMessage())
    assert f"prepared {path}: 40 rows, " in line and " tokens (" in line and line.endswith(f"-> {store}")


def test_missing_file_is_the_usual_error(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ToolkitError, match="does not exist"):
        _load(tmp_path / "nope.jsonl", tok, tmp_path / "cache")


def _cut(store: Path) -> None:
    data = store / "data.arrow"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _garbage(store: Path) -> None:
    (store / "data.arrow").write_bytes(b"not a store")


def _wrong_meta(store: Path) -> None:
    meta = json.loads((store / "meta.json").read_text())
    meta["rows"] += 1
    (store / "meta.json").write_text(json.dumps(meta))


def _no_meta(store: Path) -> None:
    (store / "meta.json").unlink()


@pytest.mark.parametrize("damage", [_cut, _garbage, _wrong_meta, _no_meta])
def test_damaged_store_is_prepared_again(tmp_path: Path, tok: PreTrainedTokenizerFast, damage: Any) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    good, _ = _load(path, tok, cache)
    (store,) = _stores(cache)
    damage(store)
    if damage is _no_meta:  # a folder without its meta.json is no store: it is replaced
        import shutil

        shutil.rmtree(store)
    rebuilt, n = _load(path, tok, cache)
    assert n == len(ROWS) and (rebuilt.samples, rebuilt.stats) == (good.samples, good.stats)
    assert _load(path, tok, cache)[1] == 0


def test_remembered_hash_is_reused_until_the_file_changes(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources_mod, "RACY_WINDOW_NS", -10**18)  # remember hashes even of files written just now
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    _load(path, tok, cache)
    assert len(list((cache / "hashes").glob("*.json"))) == 1
    calls = []
    real = sources_mod._stream_sha256
    monkeypatch.setattr(sources_mod, "_stream_sha256", lambda p: calls.append(p) or real(p))
    assert _load(path, tok, cache)[1] == 0 and calls == []
    _write_jsonl(path, ROWS[:2])
    got, n = _load(path, tok, cache)
    assert n == 2 and got.stats.rows == 2 and calls == [path]


def test_packing_plan_and_difficulty_over_the_store(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """Packed rows come from the plan over the kept lengths, as packing the encoded samples does; a packed row's
    difficulty is its hardest sample's."""
    from toolkit.data.packing import pack_samples

    rows = [dict(r, difficulty=i) for i, r in enumerate(ROWS * 3)]
    path = _write_jsonl(tmp_path / "a.jsonl", rows)
    kw: dict[str, Any] = {"max_seq_len": 40, "overlength": "truncate", "train_on": "assistant"}
    plain = encode_files([path], tok, **kw)
    packed = load_training_set([path], tok, **kw, packing=True, needs_difficulty=True, cache_dir=tmp_path / "c")
    assert list(packed.samples) == pack_samples(plain.samples, 40)
    assert packed.lengths.tolist() == [len(r["input_ids"]) for r in packed.samples] and packed.sizes == [
        len(packed.samples)]
    store = open_store(resolve_source(Entry(str(path)), tmp_path), TextEncoder(tok, train_on="assistant"),
                       tmp_path / "c", num_proc=1)
    selection = select_rows(store, max_seq_len=40, overlength="truncate")
    members = packed.samples.parts[0]
    for k in range(len(packed.samples)):
        assert packed.difficulty[k] == max(store.difficulty[selection.index[j]] for j in members.members(k))
    import toolkit.data.plan as plan_mod

    def no_packing(*args: Any) -> None:
        raise AssertionError("packed again")

    with pytest.MonkeyPatch.context() as mp:  # the plan is kept in the store's folder: the next launch reads it
        mp.setattr(plan_mod, "pack_best_fit_decreasing", no_packing)
        again = load_training_set([path], tok, **kw, packing=True, needs_difficulty=True, cache_dir=tmp_path / "c")
    assert list(again.samples) == list(packed.samples)
    with pytest.raises(ToolkitError, match=rf"^{path}:2: difficulty 'hard' is not a number; easy_to_hard"):
        bad = _write_jsonl(path, [rows[0], dict(rows[1], difficulty="hard"), *rows[2:]])
        load_training_set([bad], tok, **kw, packing=False, needs_difficulty=True)


# --- several processes: concurrent preparers, a killed one, a failed one ---------------------------------------------

def _prepare_in_child(path: str, cache: str, out: str, barrier: Any, slow: float) -> None:
    tok = build_tokenizer()
    encoder = SlowEncoder(tok, slow) if slow else TextEncoder(tok, train_on="assistant")
    if barrier is not None:
        barrier.wait()
    try:
        store = open_store(resolve_source(Entry(path), Path()), encoder, Path(cache), num_proc=1)
        result = {"rows": len(store), "here": store.meta["prepared"]["pid"] == os.getpid(),
                  "samples": [store.sample(i) for i in range(len(store))]}
    except ToolkitError as e:
        result = {"error": str(e)}
    Path(out).write_text(json.dumps(result))


class SlowEncoder(TextEncoder):
    """The text encoder, `delay` seconds per piece: a preparation long enough to watch (or kill)."""

    def __init__(self, tokenizer: Any, delay: float) -> None:
        super().__init__(tokenizer, train_on="assistant")
        self.delay = delay

    def encode(self, rows: Any, numbers: Any, address: Any, base_dir: Any = None) -> Any:
        time.sleep(self.delay)
        return super().encode(rows, numbers, address, base_dir)


def _spawn(*args: Any) -> Any:
    proc = multiprocessing.get_context("spawn").Process(target=_prepare_in_child, args=args)
    proc.start()
    return proc


def test_concurrent_launches_prepare_once(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS * 50)
    cache = tmp_path / "cache"
    barrier = multiprocessing.get_context("spawn").Barrier(2)
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    procs = [_spawn(str(path), str(cache), str(o), barrier, 0.0) for o in outs]
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    results = [json.loads(o.read_text()) for o in outs]
    assert sorted(r["here"] for r in results) == [False, True]  # one prepared it, the other waited and mapped it
    assert len(_stores(cache)) == 1 and not list((cache / "stores").glob(".*.tmp"))
    expected = _load(path, tok, None, max_seq_len=10**6)[0].samples
    assert results[0]["samples"] == results[1]["samples"] == expected


def _wait_for(condition: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_killed_preparation_leaves_nothing_complete(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources_mod, "_jsonl_piece_bytes", lambda per_row, rows: 256)
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS * 30)
    cache = tmp_path / "cache"
    proc = _spawn(str(path), str(cache), str(tmp_path / "out.json"), None, 0.5)
    stores = cache / "stores"
    _wait_for(lambda: stores.is_dir() and any(stores.glob(".*.tmp/data.arrow")))
    time.sleep(0.5)  # some pieces written
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert not _stores(cache) and list(stores.glob(".*.tmp"))  # the partial store is no store
    got, n = _load(path, tok, cache, max_seq_len=10**6)
    assert n == len(ROWS) * 30 and got.samples == _load(path, tok, None, max_seq_len=10**6)[0].samples
    assert not list(stores.glob(".*.tmp"))  # the dead preparation's folder is cleared


def test_waiting_process_gets_the_preparers_error(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A process that waits for another's preparation (polling, no collective) raises that preparation's one-line
    error as soon as it is written, however long the rest would have taken."""
    rows = [*ROWS * 20, {"messages": [{"role": "robot", "content": "?"}]}, *ROWS * 200]
    path = _write_jsonl(tmp_path / "a.jsonl", rows)
    cache = tmp_path / "cache"
    proc = _spawn(str(path), str(cache), str(tmp_path / "out.json"), None, 1.0)
    _wait_for(lambda: (cache / "stores").is_dir() and any((cache / "stores").glob(".*.tmp")))
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="toolkit.data"), pytest.raises(ToolkitError) as info:
        open_store(resolve_source(Entry(str(path)), Path()), TextEncoder(tok, train_on="assistant"), cache,
                   num_proc=1)
    proc.join(timeout=60)
    assert str(info.value).startswith(f"{path}:81: messages[0] must have a role")
    assert json.loads((tmp_path / "out.json").read_text())["error"] == str(info.value)
    assert time.monotonic() - start < 30 and "waiting for " in caplog.text


@pytest.mark.parametrize("failed_first", [True, False], ids=["the preparation failed", "no failure"])
def test_a_stop_while_waiting_reports_the_preparations_failure(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              failed_first: bool) -> None:
    """The launcher stops (SIGTERM) the other ranks as soon as the preparing rank exits with its error; a rank asleep
    between two polls then ends with that error, the cause, not with the stop. Without a failure the stop stands."""
    from toolkit.runtime.signals import Stopped

    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    source, encoder = resolve_source(Entry(str(path)), Path()), TextEncoder(tok, train_on="assistant")
    key = store_mod.store_key(source, source.digest(cache), encoder)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    holder = store_mod._Lock(cache / "stores" / f"{name}.lock")
    (cache / "stores").mkdir(parents=True)
    assert holder.try_acquire("the preparing rank")  # another rank prepares: this one polls

    def preparer_fails_then_launcher_stops(seconds: float) -> None:
        if failed_first:
            store_mod._write_failure(holder.path.with_suffix(".failed"), f"{path}:1: the preparing rank's error")
        raise Stopped("SIGTERM")

    monkeypatch.setattr(store_mod.time, "sleep", preparer_fails_then_launcher_stops)
    with pytest.raises(ToolkitError if failed_first else Stopped) as info:
        open_store(source, encoder, cache, num_proc=1)
    if failed_first:
        assert str(info.value) == f"{path}:1: the preparing rank's error"
    holder.release()


# --- real launches: ranks wait for a preparation without a collective, and share its failure -----------------------

def _launch_recipe(tmp_path: Path, models: dict[str, str], data: str, *overrides: str) -> list[str]:
    import yaml

    from tests.conftest import REPO, base_recipe, launch_cmd

    recipe = base_recipe(models["text"], data) | {"output_dir": str(tmp_path / "run")}
    recipe["data"] |= {"num_proc": 1, "max_seq_len": 512}  # one process: a preparation slow enough to wait for
    recipe["distributed"] = {"timeout_minutes": 0.1}  # 6 s
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return [*launch_cmd("ddp", 2), str(REPO / "train_curriculum.py"), "--config", str(tmp_path / "recipe.yaml"),
            *overrides]


def _dummy_rows(n: int) -> list[dict[str, Any]]:
    import tempfile

    from toolkit.builtin.dummy_data import write_dummy_data

    with tempfile.TemporaryDirectory() as tmp:
        path = write_dummy_data(Path(tmp), n, seed=0)["stage2"]
        return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_waiting_rank_outlives_the_collective_timeout(tmp_path: Path, models: dict[str, str]) -> None:
    """DDP x 2 with distributed.timeout_minutes: 0.1 (6 s) on a file that takes longer than that to prepare: one
    rank prepares, the other polls for the store (no collective), and the run trains to its end."""
    from tests.conftest import run_launch

    # ~45 s in one process on a shared 2-core VM; 20,000 rows took under the 6 s timeout on a quiet one
    _write_jsonl(tmp_path / "big.jsonl", _dummy_rows(60000))
    proc = run_launch(_launch_recipe(tmp_path, models, str(tmp_path / "big.jsonl")), timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    prepared = [line for line in output.splitlines() if "data: prepared" in line]
    assert len(prepared) == 1, output[-4000:]  # one rank prepared it
    seconds = float(prepared[0].split(" tokens (")[1].split(" in ")[1].split(" s ")[0])
    assert seconds > 6, f"the preparation took {seconds} s, not longer than the timeout: the test proves nothing"
    assert "data: waiting for " in output and "ready after waiting" in output
    assert (tmp_path / "run" / "final").is_dir()


@pytest.mark.slow
def test_a_failed_preparation_is_one_line_for_the_whole_launch(tmp_path: Path, models: dict[str, str]) -> None:
    """The preparing rank hits a bad row early in a file whose whole preparation would take minutes: both ranks
    end within seconds on the same error naming file and line, said once (rank 0 says it, the other rank stays
    quiet: issue 38), and no traceback of theirs."""
    from tests.conftest import run_launch

    rows = _dummy_rows(200000)  # minutes to prepare in one process
    rows[300] = {"messages": [{"role": "robot", "content": "?"}]}
    _write_jsonl(tmp_path / "bad.jsonl", rows)
    start = time.monotonic()
    proc = run_launch(_launch_recipe(tmp_path, models, str(tmp_path / "bad.jsonl")), timeout=600)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, output[-4000:]
    assert output.count("exitcode  : 2 ") == 2, output[-4000:]  # both ranks stopped on it
    assert errors[0].startswith(f"error: {tmp_path / 'bad.jsonl'}:301: messages[0] must have a role")
    assert not re.search(r'File ".*(/toolkit/|train_curriculum\.py)"', output), output[-4000:]  # the launcher's own
    # traceback (ChildFailedError, ending with the line as its root cause) is accelerate's, not a rank's
    assert elapsed < 60, elapsed  # the whole file would take minutes; the launch ends once its first piece fails
    assert not (tmp_path / "run").exists()


def test_entry_options_and_image_settings_are_in_the_key(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """A column mapping and a split name an other store; so do a vision encoder's pixel bounds and template."""
    from toolkit.builtin.vl_model import build_vl_processor
    from toolkit.data.store import store_key
    from toolkit.data.vision import VLEncoder

    path = _write_jsonl(tmp_path / "a.jsonl", [{"dialog": CHAT, "messages": None}] * 3)
    cache = tmp_path / "cache"
    mapped = encode_files([Entry(str(path), None, (("messages", "dialog"),))], tok, max_seq_len=64,
                          overlength="drop", train_on="assistant", cache_dir=cache)
    assert mapped.stats.kept == 3
    source = resolve_source(Entry(str(path)), tmp_path)
    encoder = TextEncoder(tok, train_on="assistant")
    keys = [store_key(resolve_source(Entry(str(path), split, columns), tmp_path), "d", encoder)
            for split, columns in ((None, ()), ("test", ()), (None, (("messages", "dialog"),)))]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 3
    processor = build_vl_processor(stock_template("qwen2.5-vl"))
    vl = [store_key(source, "d", VLEncoder(processor, train_on="assistant", **kw))
          for kw in ({}, {"max_pixels": 56 * 56}, {"min_pixels": 56 * 56})]
    assert len({json.dumps(k, sort_keys=True) for k in vl}) == 3
    other = copy.deepcopy(processor)
    other.chat_template = processor.chat_template + " "
    assert store_key(source, "d", VLEncoder(other, train_on="assistant")) != vl[0]


def _flip_token_ids(store: Path, tok: PreTrainedTokenizerFast) -> None:
    """Overwrite the first row's token ids in data.arrow in place: same size, the file still reads."""
    import numpy as np

    data = store / "data.arrow"
    ids = np.asarray(encode_row(ROWS[0], tok, "assistant", "f")[0], np.int32)
    at = data.read_bytes().find(ids.tobytes())
    assert at > 0
    size = data.stat().st_size
    with data.open("r+b") as f:
        f.seek(at)
        f.write(((ids + 1) % len(tok)).astype(np.int32).tobytes())
    assert data.stat().st_size == size


def test_a_same_size_overwrite_of_token_ids_is_found_and_prepared_again(
        tmp_path: Path, tok: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 31: 40 token ids overwritten in place (same size) were trained on without a word. The checksum
    recorded at preparation is checked by the next open, which prepares the store again; once checked, later opens
    compare the file's stat only, and a later overwrite changes it."""
    monkeypatch.setattr(store_mod, "RACY_WINDOW_NS", -10**18)  # remember checks even of files written just now
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    good, _ = _load(path, tok, cache)
    (store,) = _stores(cache)
    assert re.fullmatch("[0-9a-f]{64}", json.loads((store / "meta.json").read_text())["sha256"])
    _flip_token_ids(store, tok)  # before any check: the first open finds it
    with caplog.at_level(logging.WARNING, logger="toolkit.data"):
        rebuilt, n = _load(path, tok, cache)
    assert n == len(ROWS) and rebuilt.samples == good.samples
    assert any("is damaged (data.arrow's sha256 is" in r.getMessage() for r in caplog.records)
    hashed: list[Path] = []
    real = store_mod.file_sha256
    monkeypatch.setattr(store_mod, "file_sha256", lambda p: hashed.append(p) or real(p))
    assert _load(path, tok, cache)[1] == 0 and len(hashed) == 1  # checked once, remembered in verified.json
    assert _load(path, tok, cache)[1] == 0 and len(hashed) == 1  # then the stat is enough
    time.sleep(0.02)  # past the filesystem's timestamp tick
    (store,) = _stores(cache)
    _flip_token_ids(store, tok)  # after a check: the changed stat sends it to be checked again
    again, n = _load(path, tok, cache)
    assert n == len(ROWS) and again.samples == good.samples


def test_checking_a_store_holds_the_rank_to_its_read_buffer(tmp_path: Path) -> None:
    """Issue 52's 1M-row launch: hashing the 1.8 GB store through a read-only mapping counted every page it touched
    as the hashing rank's own (+1.2 GB private memory, and again on the next launch). Checked in a fresh process:
    hashing a 192 MB file raises its peak resident memory by no more than a few read buffers, and gives hashlib's
    digest."""
    data = tmp_path / "data.arrow"
    with data.open("wb") as f:
        for k in range(12):
            f.write(bytes([k]) * (16 << 20))
    code = (  # the peak resident set (file pages mapped included), reset just before the hash
        "import json, sys\n"
        "from pathlib import Path\n"
        "from toolkit.data.store import file_sha256\n"
        "def peak():\n"
        "    line = next(x for x in open('/proc/self/status') if x.startswith('VmHWM:'))\n"
        "    return int(line.split()[1]) * 1024\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = peak()\n"
        "digest = file_sha256(Path(sys.argv[1]))\n"
        "print(json.dumps([digest, peak() - before]))\n")
    got = subprocess.run([sys.executable, "-c", code, str(data)], capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "PYTHONPATH": str(Path(store_mod.__file__).parents[2])})
    digest, grown = json.loads(got.stdout.strip().splitlines()[-1])
    assert digest == hashlib.sha256(data.read_bytes()).hexdigest()
    assert grown < 3 * store_mod.HASH_PIECE_BYTES, f"peak resident memory grew {grown / 2**20:.0f} MB"


def test_a_store_without_a_checksum_is_prepared_again(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    """A store an earlier version prepared (no sha256 in its meta.json) cannot be checked: it is prepared again."""
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    _load(path, tok, cache)
    (store,) = _stores(cache)
    meta = json.loads((store / "meta.json").read_text())
    del meta["sha256"]
    (store / "meta.json").write_text(json.dumps(meta))
    assert _load(path, tok, cache)[1] == len(ROWS)
    assert "sha256" in json.loads((_stores(cache)[0] / "meta.json").read_text())


def test_a_damaged_store_in_a_read_only_cache_is_refused_in_one_line(
        tmp_path: Path, tok: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture) -> None:
    """Where the store cannot be prepared again (its cache is read-only), a damaged one is refused in one line
    naming it, never trained on; an intact one is checked and used, one of an earlier version (no checksum) used
    with a warning that it is unverified."""
    from tests.conftest import mounted_tmpfs, remount_read_only

    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    with mounted_tmpfs(tmp_path / "cache", "16m") as cache:
        good, _ = _load(path, tok, cache)
        remount_read_only(cache)
        same, n = _load(path, tok, cache)
        assert n == 0 and same.samples == good.samples
        subprocess.run(["mount", "-o", "remount,rw", str(cache)], check=True)
        (store,) = _stores(cache)
        meta = (store / "meta.json").read_text()
        (store / "meta.json").write_text(json.dumps({k: v for k, v in json.loads(meta).items() if k != "sha256"}))
        remount_read_only(cache)  # a store of an earlier version: used, said to be unverified
        with caplog.at_level(logging.WARNING, logger="toolkit.data"):
            assert _load(path, tok, cache)[1] == 0
        assert "has no checksum (an earlier version prepared it) and its cache folder is not writable" in caplog.text
        subprocess.run(["mount", "-o", "remount,rw", str(cache)], check=True)
        (store / "meta.json").write_text(meta)
        _flip_token_ids(store, tok)
        remount_read_only(cache)
        with pytest.raises(ToolkitError, match=rf"^The token store {store} cannot be used \(data.arrow's sha256 is "
                                               r".* cannot be prepared again: its cache folder is not writable"):
            _load(path, tok, cache)
# --- the size guard: one enormous row neither exhausts memory nor escapes data.overlength -----------------------------

GUARD_SCRIPT = """
import json, resource, sys, tracemalloc
from pathlib import Path
from toolkit.data.encoding import TextEncoder
from toolkit.data.plan import select_rows
from toolkit.data.sources import Entry, resolve_source
from toolkit.data.store import open_store
from toolkit.errors import ToolkitError
from toolkit.builtin.text_model import build_tokenizer

encoder = TextEncoder(build_tokenizer(), train_on="assistant")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[2:] == ["trace"]:  # Python's own allocations (the line's bytes, its text, the parsed row), to the byte
    tracemalloc.start()
store = open_store(resolve_source(Entry(sys.argv[1]), Path()), encoder, None, num_proc=1, max_tokens=128)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
out = {"added_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024, "traced_mb": peak / 2**20,
       "lengths": store.lengths.tolist(), "capped": store.capped, "oversize": store.oversize}
for policy in ("drop", "truncate", "error"):
    try:
        out[policy] = vars(select_rows(store, max_seq_len=128, overlength=policy).stats)
    except ToolkitError as e:
        out[policy] = str(e)
print(json.dumps(out))
"""


def _guard_script(path: Path, *, trace: bool = False) -> dict[str, Any]:
    """GUARD_SCRIPT's findings on `path`, in a fresh process (its peak RSS is the file's alone); `trace`: with
    Python's allocations traced (slower)."""
    import sys

    from tests.conftest import REPO, run_env

    proc = subprocess.run([sys.executable, "-c", GUARD_SCRIPT, str(path), *(["trace"] if trace else [])], cwd=REPO,
                          env=run_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_one_enormous_row_is_measured_before_it_is_tokenised(tmp_path: Path) -> None:
    """A 200 MB row under max_seq_len 128 grew to 20.8 GB and was killed by the OOM killer: it was tokenised whole
    before being dropped. Here a 10 MB chat row (under the row byte cap, so it is read) adds at most a few hundred MB
    (text, parse and rendering), and each policy sees it over-length: dropped, truncated to its first tokens, or
    refused naming its line."""
    small = {"messages": CHAT}
    content = "word " * ((10 << 20) // 5)  # 10 MiB of text
    big = {"messages": [{"role": "user", "content": content}, CHAT[1]]}
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [small, big, small]) + "\n")
    del big
    characters = len(content) + len(CHAT[1]["content"])
    out = _guard_script(path)
    assert out["added_mb"] < 400, out["added_mb"]
    assert out["lengths"][1] == 129 and out["capped"] == {"1": characters} and out["oversize"] == {}
    assert out["drop"]["dropped_overlength"] == 1 and out["drop"]["kept"] == 2
    # Truncated to its first 128 tokens, which are all the user's: nothing to train, so skipped (and counted).
    assert out["truncate"]["truncated"] == 1 and out["truncate"]["no_label_tokens"] == 1
    assert out["error"].startswith(f"{path}:2: at least 129 tokens ({characters} characters), over "
                                   "data.max_seq_len=128")


def test_a_row_over_the_byte_cap_costs_no_more_than_the_cap(tmp_path: Path) -> None:
    """A 35 MB row of a million short messages took +0.8 GB: parsed and rendered whole before the size guard saw
    its text. Its line is now measured in bytes first: over the row byte cap (12 MiB here) it is skipped unread, so
    the process grows by less than half the file (Python's allocations peak under 2.5 times the cap: the line is
    read up to the cap, which readline's joining holds twice, then skipped in megabytes; 24 MiB measured), and it
    is stored with no tokens: dropped under data.overlength: drop, refused in one line naming its line, its size
    and the cap under error and truncate."""
    small = {"messages": CHAT}
    big = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(1_000_000)]}
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [small, big, small]) + "\n")
    size = len(json.dumps(big)) + 1  # its line, newline included
    del big
    assert size > 30_000_000
    out = _guard_script(path, trace=True)
    cap = sources_mod.row_byte_cap(encoding_mod.GUARD_MIN_CHARS)
    assert out["added_mb"] < size / 2 / 2**20, out["added_mb"]
    assert out["traced_mb"] < 2.5 * cap / 2**20, out["traced_mb"]  # the line up to the cap (readline: twice)
    assert out["oversize"] == {"1": size} and out["lengths"][1] == 0 and out["capped"] == {}
    assert out["drop"]["dropped_overlength"] == 1 and out["drop"]["kept"] == 2
    expected = f"{path}:2: the line is {size:,} bytes, over the {cap:,}-byte cap on one row"
    assert out["error"].startswith(expected) and out["truncate"].startswith(expected)
    assert "Split it into smaller rows, remove it, or set data.overlength: drop" in out["error"]


def test_the_row_byte_cap_is_exact_and_follows_max_seq_len(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A line of exactly the cap's bytes (its newline aside) is read, one byte more is not; an earlier ordinary
    over-length row is still the one data.overlength: error names; a store that left a row unread is prepared
    again for a longer max_seq_len, whose cap reads it. (The floors lowered: the same code at small sizes.)"""
    monkeypatch.setattr(encoding_mod, "GUARD_MIN_CHARS", 100)
    monkeypatch.setattr(sources_mod, "ROW_BYTES_FLOOR", 1200)
    encoder = TextEncoder(tok, train_on="assistant")
    cap = sources_mod.row_byte_cap(encoding_mod.SizeGuard(encoder, 64).limit or 0)
    assert cap > 1200

    def text(n: int) -> dict[str, Any]:  # a row whose line is n bytes, newline aside
        return {"text": "w " * ((n - 12) // 2) + "x" * ((n - 12) % 2)}

    path = _write_jsonl(tmp_path / "d.jsonl", [ROWS[3], text(cap + 1), text(cap), ROWS[3]])
    assert [len(line) for line in path.read_bytes().splitlines()][1:3] == [cap + 1, cap]

    def store(max_tokens: int) -> Any:
        return open_store(resolve_source(Entry(str(path)), Path()), encoder, tmp_path / "cache", num_proc=1,
                          max_tokens=max_tokens)

    first = store(64)
    assert first.oversize == {1: cap + 2} and first.lengths[1] == 0 and first.lengths[2] == 65
    stats = select_rows(first, max_seq_len=64, overlength="drop").stats
    assert stats.dropped_overlength == 2 and stats.kept == 2
    with pytest.raises(ToolkitError, match=rf"^{re.escape(str(path))}:2: the line is {cap + 2:,} bytes, over the "
                                           rf"{cap:,}-byte cap on one row"):
        select_rows(first, max_seq_len=64, overlength="truncate")
    path.write_text("".join(json.dumps(r) + "\n" for r in [text(cap), text(cap + 1)]))
    with pytest.raises(ToolkitError, match=rf"^{re.escape(str(path))}:1: at least 65 tokens"):
        select_rows(store(64), max_seq_len=64, overlength="error")
    again = store(300)
    assert again.oversize == {} and again.lengths.tolist()[1] > 65


def test_a_cut_row_keeps_its_first_tokens(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A row the guard cut keeps exactly the tokens and loss mask the whole row starts with (what truncation
    keeps), for text, prompt and completion, and chat rows. (The guard's floor lowered: the same code at a size
    the whole row can be tokenised at, to compare.)"""
    monkeypatch.setattr(encoding_mod, "GUARD_MIN_CHARS", 5000)
    long = " ".join(f"w{i % 97}" for i in range(8000))  # 31k characters: tokenised as a 10k-character prefix
    rows = [{"text": long}, {"prompt": "Q:", "completion": long}, {"prompt": long, "completion": "x"},
            {"messages": [{"role": "user", "content": "Go."}, {"role": "assistant", "content": long}]}]
    for row, others in zip(rows, [0, 2, 1, 3], strict=True):  # the characters of its other texts
        path = _write_jsonl(tmp_path / "one.jsonl", [row])
        ids, labels = encode_row(row, tok, "assistant", "f")
        store = open_store(resolve_source(Entry(str(path)), Path()), TextEncoder(tok, train_on="assistant"), None,
                           num_proc=1, max_tokens=300)
        assert store.capped == {0: len(long) + others}
        assert store.lengths.tolist() == [301] and len(ids) > 2000
        assert store.sample(0, 300) == {"input_ids": ids[:300], "labels": labels[:300]}


def test_a_store_cut_for_a_shorter_max_seq_len_is_prepared_again(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The store is shared by stages and runs of other lengths: one whose guard cut rows below what a later run
    needs is prepared again; a store that cut nothing never is (its key and folder stay as they were)."""
    long = {"text": "word " * (1 << 19)}  # 2.6M characters
    path = _write_jsonl(tmp_path / "d.jsonl", [ROWS[3], long])
    plain = _write_jsonl(tmp_path / "plain.jsonl", ROWS)
    encoder = TextEncoder(tok, train_on="assistant")

    def store(p: Path, max_tokens: int) -> Any:
        return open_store(resolve_source(Entry(str(p)), Path()), encoder, tmp_path / "cache", num_proc=1,
                          max_tokens=max_tokens)

    first = store(path, 64)
    assert first.lengths.tolist()[1] == 65 and json.loads((first.path / "meta.json").read_text())["capped"] == {
        "cap": 64, "rows": {"1": len(long["text"])}}
    before = encoding_mod.ENCODE_CALLS
    assert store(path, 32).lengths.tolist()[1] == 65 and before == encoding_mod.ENCODE_CALLS  # 64 covers 32
    with caplog.at_level(logging.INFO, logger="toolkit.data"):
        again = store(path, 256)
    assert again.path == first.path and again.lengths.tolist()[1] == 257 and "preparing it again" in caplog.text
    assert json.loads((again.path / "meta.json").read_text())["capped"]["cap"] == 256
    ordinary = store(plain, 8)
    assert "capped" not in json.loads((ordinary.path / "meta.json").read_text())
    before = encoding_mod.ENCODE_CALLS
    assert store(plain, 4096).path == ordinary.path and before == encoding_mod.ENCODE_CALLS


# --- a shared cache: nothing at a predictable name is followed (issue 39) -------------------------------------

@pytest.mark.parametrize("planted", ["lock", "store", "failed"])
def test_a_link_planted_in_the_store_cache_is_refused_and_its_target_untouched(
        tmp_path: Path, tok: PreTrainedTokenizerFast, planted: str) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    _load(path, tok, cache)
    (store,) = _stores(cache)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    if planted == "store":  # a store folder of somebody's, under the name this launch looks for
        elsewhere = tmp_path / "elsewhere"
        store.rename(elsewhere)
        store.symlink_to(elsewhere)
        link = store
    else:
        shutil.rmtree(store)  # the next launch prepares it: it takes the lock, or reads the failure
        link = store.with_name(f"{store.name}.{planted}")
        link.unlink(missing_ok=True)
        link.symlink_to(victim)
    with pytest.raises(ToolkitError, match="is a symbolic link") as err:
        _load(path, tok, cache)
    assert str(link) in str(err.value) and "\n" not in str(err.value)
    assert victim.read_text() == "the user's own file\n"


def test_store_columns_read_from_buffers_equal_pyarrows_to_numpy() -> None:
    """A store's fixed-width columns are read from their buffers (store._view: pyarrow's `to_numpy` imports
    pandas, a second of a warm launch): the same values and dtype as `to_numpy`, for sliced arrays (an offset into
    the buffer and the validity bitmap), nulls in a float column (NaN), an all-null column and an empty one."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    for kind in (pa.int32(), pa.int64(), pa.uint8(), pa.float64()):
        for nulls in (False, True):
            if nulls and not pa.types.is_floating(kind):
                continue
            values = [None if nulls and rng.random() < 0.3 else int(rng.integers(0, 200)) for _ in range(37)]
            column = pa.array(values, kind)
            for part in (column, column.slice(3), column.slice(5, 20), column.slice(11, 9), column.slice(37)):
                expected, got = part.to_numpy(zero_copy_only=False), store_mod._view(part)
                assert got.dtype == expected.dtype and np.array_equal(got, expected, equal_nan=True), (kind, part)
    assert np.isnan(store_mod._view(pa.array([None, None], pa.float64()))).all()
    lists = pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int32())).slice(1)
    assert store_mod._view(lists.offsets).tolist() == lists.offsets.to_numpy().tolist() == [2, 3, 6]
