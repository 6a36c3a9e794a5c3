"""Tests for the tokenisation cache of toolkit/data.py: hits skip tokenisation, every key part invalidates, entries
are pickle-free, damaged entries are rebuilt, and concurrent writers leave one valid entry."""

from __future__ import annotations

import copy
import json
import multiprocessing
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

import toolkit.data as data_mod
from toolkit.data import EncodedRows, encode_files, load_training_set
from toolkit.errors import ToolkitError
from toolkit.tiny import build_tokenizer

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
          overlength: str = "truncate", train_on: str = "assistant", thinking: str = "auto"
          ) -> tuple[EncodedRows, int]:
    """The loaded data and how many rows were tokenised to get it."""
    before = data_mod.ENCODE_CALLS
    data = encode_files([path], tok, max_seq_len=max_seq_len, overlength=overlength, train_on=train_on,
                           thinking=thinking, cache_dir=cache)
    return data, data_mod.ENCODE_CALLS - before


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.npz"))


def test_hit_skips_tokenisation_and_matches(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    uncached, n0 = _load(path, tok, None)
    first, n1 = _load(path, tok, cache)
    second, n2 = _load(path, tok, cache)
    assert (n0, n1, n2) == (len(ROWS), len(ROWS), 0)
    assert uncached.stats.truncated == 1
    for got in (first, second):
        assert got.samples == uncached.samples
        assert got.extras == uncached.extras
        assert got.stats == uncached.stats
    assert len(_entries(cache)) == 1


def test_sources_pass_cache_through(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    b = _write_jsonl(tmp_path / "b.jsonl", ROWS[:2])
    kw: dict[str, Any] = {"max_seq_len": 40, "overlength": "drop", "train_on": "assistant", "packing": False,
                          "needs_difficulty": False}
    plain = load_training_set([a, b], tok, **kw)
    load_training_set([a, b], tok, **kw, cache_dir=tmp_path / "c")
    before = data_mod.ENCODE_CALLS
    cached = load_training_set([a, b], tok, **kw, cache_dir=tmp_path / "c")
    assert data_mod.ENCODE_CALLS - before == 0
    assert (cached.samples, cached.sizes, cached.stats) == (plain.samples, plain.sizes, plain.stats)


def _other_template(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("'\\n' }}{%- else %}", "'\\n\\n' }}{%- else %}")
    assert other.chat_template != tok.chat_template
    return other


def _extra_special(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    other = copy.deepcopy(tok)
    other.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    return other


@pytest.mark.parametrize("change", ["chat_template", "special_token", "max_seq_len", "overlength", "train_on",
                                    "content_same_size", "content_appended"])
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
    elif change == "max_seq_len":
        kw["max_seq_len"] = 50
    elif change == "overlength":
        kw["overlength"] = "drop"
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
    assert (got.samples, got.extras, got.stats) == (expected.samples, expected.extras, expected.stats)
    assert len(_entries(cache)) == 2
    assert _load(path, new_tok, cache, **kw)[1] == 0  # and the new key is cached in turn


def test_overlength_error_raises_and_is_not_cached(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    for _ in range(2):
        with pytest.raises(ToolkitError, match=r"a\.jsonl:2: \d+ tokens, over data.max_seq_len=40"):
            _load(path, tok, cache, overlength="error")
    assert _entries(cache) == []
    _, n = _load(path, tok, cache, max_seq_len=512, overlength="error")
    assert n == len(ROWS)


def test_missing_file_is_the_usual_error(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ToolkitError, match="does not exist"):
        _load(tmp_path / "nope.jsonl", tok, tmp_path / "cache")


def test_entries_hold_no_pickle(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    data, _ = _load(path, tok, cache)
    (entry,) = _entries(cache)
    with np.load(entry, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    assert set(arrays) == {"input_ids", "labels", "offsets", "meta"}
    assert all(a.dtype.kind in "iu" for a in arrays.values())
    meta = json.loads(arrays["meta"].tobytes())
    assert meta["extras"] == data.extras
    assert meta["stats"]["kept"] == len(data.samples) == len(arrays["offsets"]) - 1
    assert {p.suffix for p in cache.rglob("*") if p.is_file()} <= {".npz", ".json"}


def _truncate(entry: Path) -> None:
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])


def _garbage(entry: Path) -> None:
    entry.write_bytes(b"not a cache entry")


def _flip_a_byte(entry: Path) -> None:
    with zipfile.ZipFile(entry) as z:
        info = z.getinfo("input_ids.npy")
    raw = bytearray(entry.read_bytes())
    raw[info.header_offset + 200] ^= 0xFF  # inside the array data, past the local header and the .npy header
    entry.write_bytes(bytes(raw))


def _wrong_meta(entry: Path) -> None:
    with np.load(entry, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    meta["stats"]["kept"] += 1
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(entry, **arrays)


@pytest.mark.parametrize("damage", [_truncate, _garbage, _flip_a_byte, _wrong_meta])
def test_damaged_entry_is_rebuilt(tmp_path: Path, tok: PreTrainedTokenizerFast, damage: Any) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    good, _ = _load(path, tok, cache)
    (entry,) = _entries(cache)
    damage(entry)
    rebuilt, n = _load(path, tok, cache)
    assert n == len(ROWS)
    assert (rebuilt.samples, rebuilt.extras, rebuilt.stats) == (good.samples, good.extras, good.stats)
    assert _load(path, tok, cache)[1] == 0


def test_remembered_hash_is_reused_until_the_file_changes(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_mod, "RACY_WINDOW_NS", -10**18)  # remember hashes even of files written just now
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    cache = tmp_path / "cache"
    _load(path, tok, cache)
    assert len(list((cache / "hashes").glob("*.json"))) == 1
    real_open = Path.open

    def no_reading_data(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        assert not (self == path and "b" in mode), "rehashed an unchanged file"
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", no_reading_data)
    assert _load(path, tok, cache)[1] == 0
    monkeypatch.undo()
    _write_jsonl(path, ROWS[:2])
    got, n = _load(path, tok, cache)
    assert n == 2 and got.stats.rows == 2


def _worker(path: str, cache: str, barrier: Any, out: str) -> None:
    tok = build_tokenizer()
    barrier.wait()
    data = encode_files([Path(path)], tok, max_seq_len=40, overlength="truncate", train_on="assistant",
                           cache_dir=Path(cache))
    Path(out).write_text(json.dumps({"samples": data.samples, "extras": data.extras}))


def test_concurrent_writers_leave_one_valid_entry(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS * 50)
    cache = tmp_path / "cache"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    procs = [ctx.Process(target=_worker, args=(str(path), str(cache), barrier, str(o))) for o in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    (entry,) = _entries(cache)
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]
    with np.load(entry, allow_pickle=False) as z:
        assert len(z["offsets"]) == len(ROWS) * 50 + 1
    got, n = _load(path, tok, cache)
    assert n == 0  # the fingerprint and key agree across processes
    expected, _ = _load(path, tok, None)
    assert (got.samples, got.extras, got.stats) == (expected.samples, expected.extras, expected.stats)
    for o in outs:
        assert json.loads(o.read_text()) == {"samples": expected.samples, "extras": expected.extras}


def test_thinking_mode_changes_cached_tokens(tmp_path: Path, qwen_tokenizer: Any) -> None:
    """With Qwen3's stock template, data.thinking changes the tokens, and the cache serves each mode its own."""
    from tests.conftest import stock_template

    tok = copy.copy(qwen_tokenizer)
    tok.chat_template = stock_template("qwen3")
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    cache = tmp_path / "cache"
    auto, n_auto = _load(path, tok, cache, max_seq_len=512)
    none, n_none = _load(path, tok, cache, max_seq_len=512, thinking="none")
    assert n_auto == n_none == 1 and len(_entries(cache)) == 2
    assert len(auto.samples[0]["input_ids"]) == len(none.samples[0]["input_ids"]) + 4  # <think>\n\n</think>\n\n
    assert _load(path, tok, cache, max_seq_len=512)[0].samples == auto.samples
    assert _load(path, tok, cache, max_seq_len=512, thinking="none") == (none, 0)
