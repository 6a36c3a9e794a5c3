"""The token store: each source tokenised once per machine into one memory-mapped, columnar file that every rank
maps read-only.

A store holds, per row of the source: `input_ids` (int32) and `mask` (uint8, 1 where the token carries loss),
`length`, `label_tokens`, the row's `number` and `file` in its source (for errors), `difficulty`, a kto store's
`desirable` (each row's true/false `label`), and for vision-
language rows the image paths, their grids and how many leading tokens may not be cut. It is the full encoding,
before any length policy: `max_seq_len`, `overlength`, packing and ordering are index arrays computed from its
columns (toolkit/data/plan.py), so stages with other lengths share it. Ranks share its pages; what a rank keeps
privately grows with the number of rows (the per-row columns, offsets, packing plan), never with tokens. A
preference stage's pair store (its encoder's `pairs` option, in the key) holds each source row, a pair, as two rows:
2k its chosen side and 2k + 1 its rejected side, both with the row's number (toolkit/data/pairs.py `pair_rows`).

Format: datasets' own cache-file format, an Arrow IPC stream (`datasets.Dataset.from_file` opens it), written and
memory-mapped with pyarrow, the library under datasets. Not through datasets' API: importing datasets costs ~2 s in
every process of every launch, and `Dataset.map(num_proc=N)` reports a worker's error only once every worker has
finished its shard (`datasets.utils.py_utils.iflatmap_unordered`), so a bad first row of a million-row file would
fail the launch only after the whole preparation. Here the pieces are encoded by a process pool in order and the
first bad row stops everything at once.

Layout under `data.cache_dir` (default `<output_dir>/../.toolkit-cache/tokenized`):
  stores/<key>/data.arrow, meta.json   a complete store; it exists only once complete (built in a temporary folder
                                        and renamed into place), so a killed preparation leaves nothing a later
                                        launch reads as complete. meta.json records data.arrow's sha256, hashed
                                        as it was written
  stores/<key>/verified.json            data.arrow's stat when its content was last found to match that sha256
  stores/.<key>.<host>.<pid>.tmp/       a preparation in progress (cleared by the next one on that host)
  stores/<key>.lock                     flock held while preparing; its text names the holder (host, pid)
  stores/<key>.failed                   the one-line error of a failed preparation, for the ranks waiting on it
  hashes/                               data files' sha256, remembered against their stat (toolkit/data/sources.py)
key = sha256 of {STORE_VERSION, the source's content digest, format, split, column mapping, tags, the tokenizer's
fingerprint (chat template included), the encoder's options (train_on, thinking, image settings)}.
meta.json's `capped` (only when the size guard cut a row: {cap, rows: {row: characters}}) names the rows stored as
their first cap + 1 tokens (toolkit/data/encoding.py SizeGuard); it is not in the key, so ordinary stores keep
theirs, and a store cut below what a later run needs is prepared again. `oversize` ({cap, max_tokens, rows: {row:
bytes}}, only when a JSON Lines row was over the row byte cap, toolkit/data/sources.py row_byte_cap) names the rows
stored unread, with no tokens; a later run with a longer max_tokens prepares the store again.

No collective wait: a rank that finds no store takes the store's lock and prepares it on every core
(`data.num_proc`); the other ranks, and other launches sharing the cache dir, poll the store folder (and the
failure marker) without any collective, so `distributed.timeout_minutes` does not bound a preparation. A holder
that dies releases its lock (the kernel drops it) and the next poller prepares instead.

A store is trained on only once its content is shown to be what was prepared: a same-size overwrite passes every
size and row check. The first process to open it (holding its lock, so one process per store reads it, not every
rank) hashes data.arrow through a read-only mapping, about 1.5 GB/s, and records the file's stat in verified.json;
later opens compare the stat only, as data files' hashes are remembered (toolkit/data/sources.py): a rewrite changes
mtime and ctime. A store that does not match is prepared again (a warning says it was damaged), or refused in one
line where the cache cannot be written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tokenizers
import transformers
from tqdm.auto import tqdm

from toolkit.atomic import build_dir, fsync_dir, open_own, read_own_text, refuse_link, write_atomic
from toolkit.data.encoding import IGNORE_INDEX, EncodedBatch, SizeGuard, row_notes, unread_message_keys
from toolkit.data.sources import (
    RACY_WINDOW_NS,
    Oversize,
    Piece,
    Source,
    file_stat_signature,
    open_source,
    pieces,
    read_piece,
)
from toolkit.errors import ToolkitError
from toolkit.runtime.process import process_gone
from toolkit.runtime.signals import Stopped, signal_when_parent_dies

log = logging.getLogger(__name__)

STORE_VERSION = 3  # 3: rows' notes (keys without content, shapes chosen, empty answers) counted
"""Bump whenever the encoding or the store's columns change what a source prepares to, so old stores miss."""
PIECE_ROWS = 1000
"""Rows per piece of work (and per record batch): small enough that the first bad row stops the pool in about a
second, large enough to amortise the tokenizer's batch call."""
ROWS_PER_PROCESS = 2000
"""A preparation uses one process per this many rows, up to data.num_proc: small files stay in-process."""
BAR_MIN_ROWS, BAR_DELAY_S = 5000, 2.0
"""Preparations of fewer rows show no progress bar; others show it once they took this long."""
POLL_S = (0.1, 1.0)
"""Waiting ranks poll the store every 0.1 s at first, then at most every second."""
HASH_PIECE_BYTES = 1 << 24
"""How much of a store's file its checksum reads at a time (`file_sha256`)."""
VERIFIED_FILE = "verified.json"
"""In a store's folder: data.arrow's stat signature when its content last matched the sha256 in meta.json."""
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of everything the encoding depends on besides the row: the tokenizer (its full serialisation when
    fast, else its vocab), special and added tokens, BOS/EOS settings, the chat template, library versions."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "class": type(tokenizer).__name__,
        "core": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "special": tokenizer.special_tokens_map,
        "all_special": tokenizer.all_special_tokens,
        "added": {str(i): str(t) for i, t in tokenizer.added_tokens_decoder.items()},
        "eos_token_id": tokenizer.eos_token_id,
        "flags": [getattr(tokenizer, name, None) for name in ("add_bos_token", "add_eos_token")],
        "chat_template": tokenizer.chat_template,
        "versions": [transformers.__version__, tokenizers.__version__],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def store_key(source: Source, digest: str, encoder: Any) -> dict[str, Any]:
    """Everything a store's content depends on (its sha256 names the store), as JSON gives it back."""
    fingerprint = getattr(encoder, "fingerprint", None)
    if fingerprint is None:  # serialising a 150k-token vocabulary takes about a second: once per encoder
        fingerprint = encoder.fingerprint = tokenizer_fingerprint(encoder.tokenizer)
    key = {"store": STORE_VERSION, "content": digest, "format": source.fmt, "split": source.entry.split,
           "columns": sorted(source.entry.columns), "tokenizer": fingerprint, "encoding": encoder.options()}
    if source.entry.tags:  # only when set, so stores of entries without tags keep their names
        key["tags"] = sorted(source.entry.tags)
    if source.entry.ignore:
        key["ignore"] = sorted(source.entry.ignore)
    if source.entry.threads:  # a message tree read along every thread: more rows
        key["threads"] = source.entry.threads
    return json.loads(json.dumps(key))


# --- reading a store --------------------------------------------------------------------------------------------

class Store:
    """A prepared source, memory-mapped read-only. Per-row columns are numpy arrays (rows-proportional private
    memory); tokens are read from the mapped file per row (`tokens`, `sample`)."""

    def __init__(self, table: pa.Table, meta: dict[str, Any], source: Source, path: Path | None) -> None:
        self.meta, self.source, self.path = meta, source, path
        batches = table.to_batches()
        self.starts = np.cumsum([0, *(b.num_rows for b in batches)]).astype(np.int64)
        self._ids = [(_view(b.column("input_ids").offsets), _view(b.column("input_ids").values)) for b in batches]
        self._mask = [_view(b.column("mask").values) for b in batches]

        def col(name: str, dtype: Any) -> np.ndarray:
            if not batches:
                return np.zeros(0, dtype)
            return np.concatenate([_view(b.column(name)) for b in batches]).astype(dtype)

        self.lengths = col("length", np.int64)
        self.label_tokens = col("label_tokens", np.int64)
        self.numbers = col("number", np.int64)
        self.files = col("file", np.int32)
        self.difficulty = col("difficulty", np.float64)  # NaN where absent (or not a number: see bad_difficulty)
        self.bad_difficulty = {int(self.starts[k]) + j: value for k, b in enumerate(batches)
                               for j, value in _non_null(b.column("bad_difficulty"))}
        self.has_difficulty = bool(batches) and any(b.column("difficulty").null_count < b.num_rows for b in batches)
        # a kto store's (toolkit/data/encoding.py `kto_label`): 1 desirable, 0 undesirable, -1 unread; else None
        self.desirable = col("desirable", np.int8) if "desirable" in table.column_names else None
        self.vision = bool(batches) and "images" in table.column_names
        if self.vision:
            self.uncuttable = col("uncuttable", np.int64)
            self._images = [(b.column("images"), b.column("image_grid_thw")) for b in batches]
        # Video rows (toolkit/data/vision.py VIDEO_REF entries among the media): their runs feed every batch a video.
        self.videos = self.vision and any(
            pc.any(pc.starts_with(pc.list_flatten(images), "video:")).as_py() for images, _ in self._images)
        self._video_counts: tuple[np.ndarray, np.ndarray] | None = None  # video_counts, read once
        # Rows the size guard cut (toolkit/data/encoding.py SizeGuard): row -> its characters; their length is a
        # lower bound, over every max_seq_len the store was prepared for.
        self.capped = {int(k): int(v) for k, v in (meta.get("capped") or {}).get("rows", {}).items()}
        # Rows over the row byte cap (toolkit/data/sources.py row_byte_cap), stored unread with no tokens: row ->
        # its bytes; the cap is oversize_cap.
        self.oversize = {int(k): int(v) for k, v in (meta.get("oversize") or {}).get("rows", {}).items()}
        self.oversize_cap = int((meta.get("oversize") or {}).get("cap", 0))
        self.table = table  # keeps the mapping alive
        self.unread_keys: dict[str, int] = meta.get("unread_keys") or {}  # message key -> rows carrying it
        self.notes: dict[str, int] = meta.get("notes") or {}  # what the stage's log says about rows -> rows

    def __len__(self) -> int:
        return len(self.lengths)

    def where(self, i: int) -> str:
        """How errors name row i: `file:line` or `file row N`."""
        return self.source.where(int(self.files[i]), int(self.numbers[i]))

    def _locate(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return k, i - int(self.starts[k])

    def tokens(self, i: int, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Row i's token ids and loss mask (views of the mapped file), cut to `limit` tokens."""
        k, j = self._locate(i)
        offsets, values = self._ids[k]
        a, b = int(offsets[j]), int(offsets[j + 1])
        if limit is not None:
            b = min(b, a + limit)
        return values[a:b], self._mask[k][a:b]

    def sample(self, i: int, limit: int | None = None) -> dict[str, Any]:
        """Row i as a training sample: `input_ids`, `labels` (IGNORE_INDEX where no loss), and for an image row its
        `images` and `image_grid_thw`."""
        ids, mask = self.tokens(i, limit)
        out: dict[str, Any] = {"input_ids": ids.tolist(), "labels": np.where(mask != 0, ids, IGNORE_INDEX).tolist()}
        if self.vision:
            k, j = self._locate(i)
            images, grids = self._images[k]
            paths = images[j].as_py()
            if paths:
                flat = grids[j].as_py()
                out["images"] = paths
                out["image_grid_thw"] = [flat[n:n + 3] for n in range(0, len(flat), 3)]
        return out

    @property
    def video_merge(self) -> int:
        """Patches per video token of the encoder that stored the rows (merge_size squared)."""
        return int(self.meta.get("key", {}).get("encoding", {}).get("merge", 2)) ** 2

    def video_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row, (video tokens, sampled video frames) over all its videos (0 for a row without one): each stored
        video's grid t x h x w over the merge of the encoder that stored it, frames 2 per temporal patch. Read from
        the mapped columns once per store (by arrow's list kernels, not a row loop: a stage's data line and
        `difficulty: {by: frames}` read it for every row)."""
        if getattr(self, "_video_counts", None) is None:
            tokens, frames = np.zeros(len(self), np.int64), np.zeros(len(self), np.int64)
            if getattr(self, "videos", False):
                merge = self.video_merge
                for k, (images, grids) in enumerate(self._images):
                    rows = _view(pc.list_parent_indices(images)).astype(np.int64) + int(self.starts[k])
                    video = _view(pc.cast(pc.starts_with(pc.list_flatten(images), "video:"), pa.int8())) != 0
                    thw = _view(pc.list_flatten(grids)).astype(np.int64).reshape(-1, 3)[video]
                    np.add.at(tokens, rows[video], thw.prod(axis=1) // merge)
                    np.add.at(frames, rows[video], 2 * thw[:, 0])
            self._video_counts = tokens, frames
        return self._video_counts

    def video_grids(self, i: int) -> list[list[int]]:
        """Row i's videos' grids (t, h, w), in text order."""
        if not getattr(self, "videos", False):
            return []
        k, j = self._locate(i)
        images, grids = self._images[k]
        flat = grids[j].as_py() or []
        return [flat[3 * n:3 * n + 3] for n, ref in enumerate(images[j].as_py() or []) if ref.startswith("video:")]

    def video_tokens(self, rows: np.ndarray) -> tuple[int, int]:
        """(video tokens, video frames) of `rows` (row indices), summed (`video_counts`)."""
        tokens, frames = self.video_counts()
        return int(tokens[rows].sum()), int(frames[rows].sum())

    def labels_within(self, i: int, limit: int) -> int:
        """Trained tokens among row i's first `limit` tokens."""
        return int(np.count_nonzero(self.tokens(i, limit)[1]))


def _view(column: pa.Array) -> np.ndarray:
    """A fixed-width column as numpy, zero-copy over the mapped file (nulls as NaN in a float column). Read from
    its buffers because pyarrow's `to_numpy` imports pandas on first use, about a second of a warm launch's data
    time; any other column goes through `to_numpy`."""
    kind = column.type
    if not pa.types.is_primitive(kind) or pa.types.is_boolean(kind) or (
            column.null_count and not pa.types.is_floating(kind)):
        return column.to_numpy(zero_copy_only=False)
    dtype = np.dtype(kind.to_pandas_dtype())
    validity, data = column.buffers()[:2]
    if data is None:  # no values at all (an empty or all-null column may have no data buffer)
        return np.full(len(column), np.nan if column.null_count else 0, dtype)
    values = np.frombuffer(data, dtype, count=len(column), offset=column.offset * dtype.itemsize)
    if column.null_count:
        present = np.unpackbits(np.frombuffer(validity, np.uint8), count=column.offset + len(column),
                                bitorder="little")[column.offset:].astype(bool)
        values = np.where(present, values, np.nan).astype(dtype)
    return values


def _non_null(column: pa.Array) -> Iterator[tuple[int, Any]]:
    if column.null_count == len(column):
        return iter(())
    return ((j, v) for j, v in enumerate(column.to_pylist()) if v is not None)


def _read_table(path: Path) -> pa.Table:
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 16 MB pieces into one reused buffer. Not through a read-only mapping: every
    page of a mapping the hashing rank touches counts as its own private memory (USS) while no other process has
    it mapped, which made a 1M-row store's check +1.2 GB on one rank (docs/benchmarks.md, issue 52); read into a
    buffer, the file stays in the page cache and the rank holds 16 MB."""
    h = hashlib.sha256()
    buffer = memoryview(bytearray(HASH_PIECE_BYTES))
    with path.open("rb", buffering=0) as f:
        while read := f.readinto(buffer):  # hashlib releases the GIL on each piece
            h.update(buffer[:read])
    return h.hexdigest()


class _Unverified(Exception):
    """A complete store whose content was not yet checked against its checksum on this stat signature."""


def _verified(folder: Path, meta: dict[str, Any], data: Path) -> bool:
    """Whether verified.json says data.arrow, as it is now (stat), matched meta.json's sha256."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        record = json.loads(read_own_text(folder / VERIFIED_FILE))
        return bool(record["sha256"] == meta["sha256"] and record["stat"] == file_stat_signature(data))
    return False


def _verify(folder: Path, meta: dict[str, Any], data: Path, *, remember: bool) -> None:
    """Hash data.arrow against meta.json's sha256 (ValueError when it differs); remembered in verified.json
    against the file's stat when `remember` (the cache is writable) and the file was last changed over
    RACY_WINDOW_NS before: a same-size rewrite in the same timestamp tick cannot hide behind the remembered stat
    (a store that young is hashed again by the next opener)."""
    sig, started = file_stat_signature(data), time.time_ns()
    digest = file_sha256(data)
    if digest != meta["sha256"]:
        raise ValueError(f"data.arrow's sha256 is {digest[:12]}..., {meta['sha256'][:12]}... when it "
                         "was prepared")
    if remember and started - max(sig[1], sig[2]) > RACY_WINDOW_NS and file_stat_signature(data) == sig:
        record = json.dumps({"stat": sig, "sha256": digest, "host": socket.gethostname(), "time": time.time()})
        with contextlib.suppress(OSError):
            write_atomic(folder / VERIFIED_FILE, lambda f: f.write(record.encode()))


def _open_ready(folder: Path, key: dict[str, Any], source: Source, *, max_tokens: int | None,
                verify: Literal["no", "remembered", "yes", "yes-read-only"]) -> Store | None:
    """The complete store in `folder`, or None when there is none; a store that is damaged (unreadable, cut
    short, for another key, or its content not the one prepared) counts as none, with a warning, and so does one
    whose size guard cut rows shorter than `max_tokens` (None: uncut) needs.

    `verify`: "no" (the caller just wrote it and hashed it), "remembered" (only a verified.json that matches
    counts: _Unverified is raised otherwise), "yes" (hash it unless remembered, and remember; a store without a
    checksum counts as damaged), "yes-read-only" (hash it unless remembered; the cache cannot be written, so a
    store without a checksum is used, with a warning, and a damaged one refused)."""
    meta_path = folder / "meta.json"
    for path, what in ((folder, "a token store"), (meta_path, "a store's record"), (folder / "data.arrow",
                       "a store's tokens"), (folder / VERIFIED_FILE, "a store's record")):
        refuse_link(path, what)  # in a shared cache: never a link to somebody's (or something else's) files
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        cap = (meta.get("capped") or {}).get("cap")
        if cap is not None and (max_tokens is None or cap < max_tokens):
            log.info("data: %s cut %d over-long row(s) at %d tokens and this run needs %s; preparing it again",
                     folder, len(meta["capped"]["rows"]), cap + 1, max_tokens or "them whole")
            return None
        unread = meta.get("oversize") or {}
        if unread and (max_tokens is None or unread["max_tokens"] < max_tokens):  # its byte cap may be higher now
            log.info("data: %s left %d row(s) over %d bytes unread and this run's data.max_seq_len (%s) may read "
                     "them; preparing it again", folder, len(unread["rows"]), unread["cap"], max_tokens or "none")
            return None
        data = folder / "data.arrow"
        if meta["key"] != key or data.stat().st_size != meta["bytes"]:
            raise ValueError("does not match its meta.json")
        if not isinstance(meta.get("sha256"), str):  # prepared by an earlier version
            if verify == "remembered":
                raise _Unverified
            if verify != "yes-read-only":
                raise ValueError("has no checksum: an earlier version prepared it")
            log.warning("token store %s has no checksum (an earlier version prepared it) and its cache folder is "
                        "not writable: using it unverified", folder)
        elif verify != "no" and not _verified(folder, meta, data):
            if verify == "remembered":
                raise _Unverified
            _verify(folder, meta, data, remember=verify == "yes")
        table = _read_table(data)
        if table.num_rows != meta["rows"]:
            raise ValueError("row count differs from its meta.json")
        return Store(table, meta, source, folder)
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
        if verify == "yes-read-only":
            raise ToolkitError(f"The token store {folder} cannot be used ({e}) and cannot be prepared again: its "
                               "cache folder is not writable. Set data.cache_dir to a writable folder, or delete "
                               "the store from a process that may.") from None
        log.warning("token store %s is damaged (%s); preparing it again", folder, e)
        return None


# --- preparing a store ------------------------------------------------------------------------------------------

_WORK: tuple[Source, Any, int | None] | None = None  # (source, encoder, max_tokens) this worker process serves


def _init_worker(source: Source, encoder: Any, max_tokens: int | None) -> None:
    """A pool worker: dies with its parent (Linux), leaves signals to the parent, tokenises single-threaded."""
    global _WORK
    _WORK = (source, encoder, max_tokens)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal_when_parent_dies(signal.SIGKILL)


Encoded = tuple[pa.RecordBatch, dict[str, int], dict[int, int], dict[str, int], dict[int, tuple[int, int]]]


def _encode_piece(piece: Piece) -> Encoded:
    """The piece's record batch, how many of its rows carry each message key that nothing reads, the rows of it
    the size guard cut (row in the piece -> characters), how many rows carry each note (`row_notes`), and the rows
    over the row byte cap, stored unread with no tokens (row in the piece -> (bytes, cap))."""
    assert _WORK is not None
    source, encoder, max_tokens = _WORK
    guard = SizeGuard(encoder, max_tokens)  # its limit also caps a JSON Lines row's bytes (sources.row_byte_cap)
    pairs = bool(getattr(encoder, "pairs", False))  # two rows per source row: its chosen and rejected sides
    got, numbers = read_piece(source, piece, None if max_tokens is None else lambda: guard.limit or 0, pairs=pairs,
                              kto=bool(getattr(encoder, "kto", False)))
    kw = {} if max_tokens is None else {"max_tokens": max_tokens}

    def encode(rows: list[dict[str, Any]], numbers: list[int]) -> EncodedBatch:
        return encoder.encode(rows, numbers, lambda n: source.where(piece.file_index, n),
                              base_dir=source.files[piece.file_index].parent if source.files else Path(), **kw)

    oversize = {r: (row.size, row.cap) for r, row in enumerate(got) if isinstance(row, Oversize)}
    rows = [row for row in got if not isinstance(row, Oversize)]
    if not oversize:
        batch = encode(rows, numbers)
    else:  # the runs of rows between unread ones, encoded, and an empty row for each unread one
        vision = encoder.options()["kind"] == "vision"
        parts, run = [], 0
        for r in [*sorted(oversize), len(got)]:
            if r > run:
                parts.append(encode(got[run:r], numbers[run:r]))  # type: ignore[arg-type]
            if r < len(got):
                parts.append(EncodedBatch(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64),
                                          np.array([numbers[r]], np.int64), [None],
                                          *((np.zeros(1, np.int64), [[]], [[]]) if vision else ())))
            run = r + 1
        batch = EncodedBatch.join(parts)
    if getattr(encoder, "kto", False) and batch.desirable is None:  # every row unread: the column all the same
        batch.desirable = [None] * len(batch.lengths)
    counted = rows[::2] if pairs else rows  # a pair's notes once, from its chosen side
    unread = dict(Counter(k for row in counted for k in unread_message_keys(row)))
    notes = dict(Counter(n for row in counted for n in row_notes(row, encoder.empty_answers)))
    return record_batch(batch, piece.file_index), unread, batch.capped, notes, oversize


def record_batch(batch: EncodedBatch, file_index: int) -> pa.RecordBatch:
    """The store's columns for encoded rows (see the module docstring)."""
    offsets = np.concatenate([[0], np.cumsum(batch.lengths)]).astype(np.int32)
    trained = np.concatenate([[0], np.cumsum(batch.mask, dtype=np.int64)])
    label_tokens = trained[offsets[1:]] - trained[offsets[:-1]]
    difficulty, bad = [], []
    for value in batch.difficulty:
        number = value is not None and not isinstance(value, bool) and isinstance(value, int | float) \
            and math.isfinite(value)
        difficulty.append(float(value) if number else None)
        bad.append(None if value is None or number else repr(value))
    columns = {
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(batch.ids, pa.int32())),
        "mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(batch.mask, pa.uint8())),
        "length": pa.array(batch.lengths.astype(np.int32)),
        "label_tokens": pa.array(label_tokens.astype(np.int32)),
        "number": pa.array(batch.rows.astype(np.int64)),
        "file": pa.array(np.full(len(batch.lengths), file_index, np.int32)),
        "difficulty": pa.array(difficulty, pa.float64()),
        "bad_difficulty": pa.array(bad, pa.string()),
    }
    if batch.desirable is not None:  # a kto store's labels: 1 desirable, 0 undesirable, -1 unread (over the cap)
        columns["desirable"] = pa.array(np.array([-1 if d is None else int(d) for d in batch.desirable], np.int8))
    if batch.images is not None:
        columns["uncuttable"] = pa.array(np.asarray(batch.uncuttable, np.int32))
        columns["images"] = pa.array(batch.images, pa.list_(pa.string()))
        columns["image_grid_thw"] = pa.array([[n for grid in grids for n in grid] for grids in batch.grids or []],
                                             pa.list_(pa.int32()))
    return pa.RecordBatch.from_pydict(columns)


def _pool_context() -> multiprocessing.context.BaseContext:
    """fork where there is one (workers start at once and inherit the tokenizer); spawn elsewhere."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def encode_source(source: Source, encoder: Any, *, num_proc: int, write: Callable[[pa.RecordBatch], None],
                  label: str, max_tokens: int | None = None) -> dict[str, Any]:
    """Encode every row of `source` (in order) and hand each piece's record batch to `write`; returns counts (and
    under `capped` the rows the size guard cut at `max_tokens` + 1 tokens, when any). Uses up to `num_proc` worker
    processes; the first bad row, in file order, raises its one-line error at once."""
    open_source(source)
    work = list(pieces(source, PIECE_ROWS))
    total = sum(p.rows for p in work)
    processes = max(1, min(num_proc, math.ceil(total / ROWS_PER_PROCESS), len(work)))
    if hasattr(encoder, "prepare_for"):  # before the workers fork: they inherit what it builds
        encoder.prepare_for(total)
    counts: dict[str, Any] = {"rows": 0, "tokens": 0, "label_tokens": 0}
    unread: Counter[str] = Counter()
    notes: Counter[str] = Counter()
    capped: dict[str, int] = {}
    oversize: dict[str, int] = {}
    cap = 0
    bar = tqdm(total=total, unit="rows", desc=f"tokenising {label}", delay=BAR_DELAY_S, dynamic_ncols=True,
               disable=total < BAR_MIN_ROWS or os.environ.get("TQDM_DISABLE") == "1")

    def take(result: Encoded, piece: Piece) -> None:
        nonlocal cap
        batch, keys, cut, said, unread_rows = result
        unread.update(keys)
        notes.update(said)
        capped.update({str(counts["rows"] + r): c for r, c in cut.items()})
        oversize.update({str(counts["rows"] + r): size for r, (size, _) in unread_rows.items()})
        cap = max([cap, *(c for _, c in unread_rows.values())])
        write(batch)
        counts["rows"] += batch.num_rows
        counts["tokens"] += int(pc.sum(batch.column("length")).as_py() or 0)
        counts["label_tokens"] += int(pc.sum(batch.column("label_tokens")).as_py() or 0)
        bar.update(piece.rows)

    try:
        if processes == 1:
            _init_state(source, encoder, max_tokens)
            for piece in work:
                take(_encode_piece(piece), piece)
        else:
            with _pool_context().Pool(processes, initializer=_init_worker,
                                      initargs=(source, encoder, max_tokens)) as pool:
                for piece, batch in zip(work, pool.imap(_encode_piece, work, chunksize=1), strict=True):
                    take(batch, piece)
    finally:
        bar.close()
    counts["processes"] = processes
    counts["unread_keys"] = dict(sorted(unread.items()))
    counts["notes"] = dict(sorted(notes.items()))
    if capped:
        counts["capped"] = {"cap": max_tokens, "rows": capped}
    if oversize:
        counts["oversize"] = {"cap": cap, "max_tokens": max_tokens, "rows": oversize}
    return counts


def _init_state(source: Source, encoder: Any, max_tokens: int | None) -> None:
    global _WORK
    _WORK = (source, encoder, max_tokens)


@dataclass
class _Lock:
    """An exclusive flock on `path` (released by the kernel however the holder ends); its text names the holder."""

    path: Path
    fd: int | None = None
    unsupported: bool = False

    def try_acquire(self, what: str) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_own(self.path, os.O_RDWR | os.O_CREAT)  # never through a link planted in the shared cache
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            # A filesystem without flock (some network filesystems): prepare anyway; the store is renamed into
            # place whole, so concurrent preparers only repeat work.
            self.unsupported = True
            log.warning("cannot lock %s (%s); preparing without a lock", self.path, os.strerror(e.errno))
            return True
        self.fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                                 "what": what}).encode())
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(read_own_text(self.path))
            return f"{info['host']} pid {info['pid']}"
        return "another process"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _process_start() -> float:
    """When this process started (a failure written after it belongs to a preparation this launch waits on)."""
    with contextlib.suppress(Exception):
        import psutil

        return float(psutil.Process().create_time())
    return 0.0


def open_store(source: Source, encoder: Any, cache: Path | None, *, num_proc: int,
               max_tokens: int | None = None) -> Store:
    """The source's store: opened when prepared already, else prepared by this process (holding the store's lock)
    or by whoever holds it, waiting by polling. With `cache` None every process encodes into its own memory.

    `max_tokens` (the longest max_seq_len that will read the store) arms the size guard: a row far longer is
    measured in characters and stored cut (toolkit/data/encoding.py SizeGuard), recorded under `capped` in the
    store's meta.json; a store that cut rows for a smaller `max_tokens` is prepared again (one that cut none, the
    usual case, never is, and the key does not depend on it)."""
    digest = _digest(source, cache)
    key = store_key(source, digest, encoder)
    if cache is None:
        return _prepare_in_memory(source, encoder, key, num_proc=num_proc, max_tokens=max_tokens)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    root = cache / "stores"
    final, lock, failed = root / name, _Lock(root / f"{name}.lock"), root / f"{name}.failed"
    started = _process_start()
    try:
        return _await_store(source, encoder, key, final, lock, failed, started, num_proc=num_proc,
                            max_tokens=max_tokens)
    except Stopped:
        # Once one rank's preparation fails and it exits, the launcher stops the others (SIGTERM), maybe while
        # they sleep between polls: a rank that waited on that preparation ends with its error, the cause.
        if (message := _failure(failed, started)) is not None:
            raise ToolkitError(message) from None
        raise


def _await_store(source: Source, encoder: Any, key: dict[str, Any], final: Path, lock: _Lock, failed: Path,
                 started: float, *, num_proc: int, max_tokens: int | None) -> Store:
    """open_store's loop: open the store once ready, prepare it holding the lock, or poll for whoever holds it."""
    root, waiting_since, delay = final.parent, None, POLL_S[0]
    while True:
        try:
            store = _open_ready(final, key, source, max_tokens=max_tokens, verify="remembered")
        except _Unverified:  # complete, its content not yet checked: by the lock's holder, once
            store = None
        if store is not None:
            if waiting_since is not None:
                log.info("data: %s ready after waiting %.0f s", source.name, time.monotonic() - waiting_since)
            return store
        message = _failure(failed, started)
        if message is not None:
            raise ToolkitError(message)
        try:
            acquired = lock.try_acquire(source.name)
        except OSError as e:
            if e.errno not in _READ_ONLY:
                raise
            # A cache this process cannot write: a complete store is checked here; none can be prepared.
            store = _open_ready(final, key, source, max_tokens=max_tokens, verify="yes-read-only")
            if store is None:
                raise ToolkitError(f"The token store of {source.name} is not prepared in {root}, and this process "
                                   f"cannot write there ({os.strerror(e.errno)}): set data.cache_dir to a "
                                   "writable folder.") from None
            return store
        if acquired:
            try:
                store = _open_ready(final, key, source, max_tokens=max_tokens, verify="yes")
                if store is None:
                    return _prepare(source, encoder, key, final, failed, num_proc=num_proc, max_tokens=max_tokens)
            finally:
                lock.release()
            if waiting_since is not None:  # another process prepared it; this one checked it
                log.info("data: %s ready after waiting %.0f s", source.name, time.monotonic() - waiting_since)
            return store
        if waiting_since is None:
            waiting_since = time.monotonic()
            log.info("data: waiting for %s to prepare or check %s (%s)", lock.holder(), source.name, final)
        time.sleep(delay)
        delay = min(POLL_S[1], delay * 1.5)


def _digest(source: Source, cache: Path | None) -> str:
    if source.fmt in ("hub", "disk"):
        open_source(source)  # a hub dataset's files are known once found in the cache
    return source.digest(cache)


def _failure(path: Path, since: float) -> str | None:
    """The one-line error of a preparation that failed after `since` (one this launch was waiting on)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        info = json.loads(read_own_text(path))
        if info["time"] >= since:
            return str(info["message"])
    return None


def _prepare(source: Source, encoder: Any, key: dict[str, Any], final: Path, failed: Path, *,
             num_proc: int, max_tokens: int | None = None) -> Store:
    """Prepare the store into a temporary folder and rename it into place (holding the lock). A failure is
    written to `failed` for the waiting ranks, then raised."""
    host = socket.gethostname()
    _clear_dead_temporaries(final, host)
    tmp = final.parent / f".{final.name}.{host}.{os.getpid()}.tmp"
    signature = source.stat_signature()
    start = time.monotonic()
    info: dict[str, Any] = {}

    def build(folder: Path) -> None:
        path = folder / "data.arrow"
        with path.open("wb") as file:
            hashing = _HashingFile(file)  # the checksum of what is written, without reading the file again
            sink = pa.PythonFile(hashing, mode="w")
            writer: list[pa.RecordBatchStreamWriter] = []

            def write(batch: pa.RecordBatch) -> None:
                if not writer:
                    writer.append(pa.ipc.new_stream(sink, batch.schema))
                writer[0].write_batch(batch)

            info.update(encode_source(source, encoder, num_proc=num_proc, write=write, label=source.name,
                                      max_tokens=max_tokens))
            if not writer:  # no rows at all: an empty stream of the text schema
                writer.append(pa.ipc.new_stream(sink, record_batch(_empty_batch(), 0).schema))
            writer[0].close()
            file.flush()
            os.fsync(file.fileno())
        if source.stat_signature() != signature:
            raise ToolkitError(f"Data entry {source.name} changed while it was being prepared; start again.")
        meta = {"key": key, "source": source.describe(), "rows": info["rows"], "tokens": info["tokens"],
                "label_tokens": info["label_tokens"], "unread_keys": info["unread_keys"], "notes": info["notes"],
                "bytes": path.stat().st_size, "sha256": hashing.hexdigest(),
                "prepared": {"host": host, "pid": os.getpid(), "time": time.time(),
                             "seconds": round(time.monotonic() - start, 2), "processes": info["processes"]}}
        for name in ("capped", "oversize"):
            if name in info:
                meta[name] = info[name]
        write_atomic(folder / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))

    try:
        # A damaged store in the way is replaced (we hold the lock); else the first complete store wins.
        build_dir(final, build, replace=final.exists(), tmp=tmp)
        failed.unlink(missing_ok=True)
    except ToolkitError as e:
        _write_failure(failed, str(e))
        raise
    except Exception as e:
        _write_failure(failed, f"preparing {source.name} failed on {host} ({type(e).__name__}: {e}); see that "
                               "process's log.")
        raise
    store = _open_ready(final, key, source, max_tokens=max_tokens, verify="no")  # hashed as it was written
    if store is None:
        raise ToolkitError(f"The token store {final} could not be read back after preparing it.")
    seconds = time.monotonic() - start
    log.info("data: prepared %s: %d rows, %d tokens (%d trained) in %.1f s (%.0f rows/s, %d processes) on %s -> %s",
             source.name, info["rows"], info["tokens"], info["label_tokens"], seconds,
             info["rows"] / max(seconds, 1e-9), info["processes"], host, final)
    return store


class _HashingFile:
    """A binary file that hashes what is written to it (pyarrow writes through its `write`)."""

    def __init__(self, file: Any) -> None:
        self.file, self.hash, self.closed = file, hashlib.sha256(), False

    def write(self, data: Any) -> int:
        self.hash.update(data)
        return int(self.file.write(data))

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:  # the `with` that opened the file closes it
        self.closed = True

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def _empty_batch() -> EncodedBatch:
    return EncodedBatch(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64))


def _write_failure(path: Path, message: str) -> None:
    payload = json.dumps({"message": message, "time": time.time(), "host": socket.gethostname(),
                          "pid": os.getpid()}).encode()
    with contextlib.suppress(OSError):
        write_atomic(path, lambda f: f.write(payload))


def _clear_dead_temporaries(final: Path, host: str) -> None:
    """Temporary folders of earlier preparations of this store on this host whose process is gone (killed)."""
    import shutil

    for tmp in final.parent.glob(f".{final.name}.{host}.*.tmp"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(tmp.name.split(".")[-2])
            if pid != os.getpid() and process_gone(pid):
                shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(final.parent)




def _prepare_in_memory(source: Source, encoder: Any, key: dict[str, Any], *, num_proc: int,
                       max_tokens: int | None = None) -> Store:
    """data.cache_dir: none: the store built in this process's memory (not shared, not kept)."""
    batches: list[pa.RecordBatch] = []
    info = encode_source(source, encoder, num_proc=num_proc, write=batches.append, label=source.name,
                         max_tokens=max_tokens)
    table = pa.Table.from_batches(batches) if batches else pa.Table.from_batches(
        [record_batch(_empty_batch(), 0)])
    meta = {"key": key, "source": source.describe(), **info}
    return Store(table, meta, source, None)
