"""Sources and formats: a stage's data entry resolved to what it reads, its rows read in parallel-friendly pieces,
named for errors, and mapped to the toolkit's row shapes.

An entry (`stages[].data`, `eval.data`) is a path from the working directory, or a hub dataset id:

| entry | read as |
|---|---|
| `data.jsonl` (or a `.json` file whose first character is not `[`) | JSON Lines, one row per line (`file:line`) |
| `data.json` holding a JSON array of row objects | one row per element (`file row N`) |
| `data.parquet`, `.csv`, `.tsv`, `.arrow` (IPC stream or file) | one row per table row, through `datasets` |
| a folder written by `Dataset.save_to_disk` | the dataset (a DatasetDict: `split`, default `train`) |
| a folder of data files, or a glob (`data/*.parquet`, `shards/**/*.jsonl`) | its files in name order, one format |
| `owner/name` that is not a local path | a hub dataset from the local Hugging Face cache, never downloaded |

Per entry, `split` picks a split (hub datasets, DatasetDict folders) and `columns` maps the toolkit's field names to
the source's (`{messages: dialog}`). Rows with ShareGPT's `conversations` (`from`/`value` turns, per-turn `weight`,
row `system` and `tools`) or Alpaca's `instruction`/`input`/`output` (`system`, `history`) become `messages` rows
(`to_messages`); a row missing a field gets an error naming the file, the row and the field. Table cells that hold
structure as JSON text (CSV, LLaMA-Factory's `tools`) are decoded.

JSON Lines and JSON arrays are parsed by Python's json, not through `datasets`: Arrow's schema inference unifies the
rows of a file into one type, which turns a tool call's `arguments` into a struct with a null for every key another
row has (rendered into the prompt) and refuses string and list contents in one column (vision rows). The table
formats come typed already and are read through `datasets`, memory-mapped.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.atomic import write_atomic
from toolkit.config import DataEntry as Entry
from toolkit.errors import ToolkitError

DUMMY_PREFIX = "dummy:"
FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv",
           ".arrow": "arrow"}
"""Data file suffixes and their formats."""
RACY_WINDOW_NS = 2_000_000_000
"""A file's hash is only remembered against its stat once the file is this old (git's "racy clean" rule)."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
STRUCTURED = ("messages", "conversations", "tools", "images", "history")
"""Fields that hold lists or objects; in a CSV/TSV cell (or LLaMA-Factory's `tools` string) they are JSON text."""


def resolve_data_paths(entries: list[str], dummy_dir: Path) -> list[Path]:
    """Stage data entries to paths: `dummy:NAME` is generated dummy data, anything else a path from the cwd."""
    return [dummy_dir / f"{e.removeprefix(DUMMY_PREFIX)}.jsonl" if e.startswith(DUMMY_PREFIX) else Path(e)
            for e in entries]


@dataclass
class Source:
    """A data entry resolved: its format, the files it reads (for a hub or save_to_disk dataset, its Arrow files)
    and how its rows are named in errors. `open()` loads what the table formats need (in the preparing process)."""

    entry: Entry
    fmt: str  # jsonl | json | parquet | csv | tsv | arrow | disk | hub
    files: list[Path]
    name: str  # how errors and logs name it: the path, or the hub id
    tables: list[Any] = field(default_factory=list)  # opened datasets.Dataset per file (table formats)
    arrays: list[list[Any]] = field(default_factory=list)  # parsed JSON arrays (format json)

    def where(self, file_index: int, number: int) -> str:
        """How an error names row `number` of file `file_index`: `file:line` for JSON Lines, `file row N` else."""
        if self.fmt == "jsonl":
            return f"{self.files[file_index]}:{number}"
        if self.fmt in ("hub", "disk"):
            return f"{self.name}{f' ({self.entry.split})' if self.entry.split else ''} row {number}"
        return f"{self.files[file_index]} row {number}"

    def digest(self, cache_dir: Path | None) -> str:
        """sha256 of what the source reads: a single file's own sha256 (what checkpoints record), else of every
        file's name and sha256."""
        if len(self.files) == 1 and self.fmt not in ("hub", "disk"):
            return content_digest(self.files[0], cache_dir)
        parts = [(str(p), content_digest(p, cache_dir)) for p in self.files]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def stat_signature(self) -> list[list[int]]:
        return [_stat_sig(p) for p in self.files]

    def describe(self) -> dict[str, Any]:
        return {"entry": self.entry.path, "format": self.fmt, "split": self.entry.split,
                "columns": dict(self.entry.columns), "files": [str(p) for p in self.files]}


def resolve_source(entry: Entry, dummy_dir: Path) -> Source:
    """The source an entry names, or an error saying what it is not (checked before anything is tokenised)."""
    text = entry.path
    if text.startswith(DUMMY_PREFIX):
        return Source(entry, "jsonl", [dummy_dir / f"{text.removeprefix(DUMMY_PREFIX)}.jsonl"], text)
    path = Path(text)
    if glob.has_magic(text):
        files = walk_glob(text)
        if not files:
            raise ToolkitError(f"Data entry {text} matches no file (globs are relative to the working directory).")
        return _files_source(entry, files, text)
    kind = _kind(path)
    if kind == "dir":
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return Source(entry, "disk", sorted(p for p in path.rglob("*") if p.is_file()), text)
        files = _unique([p for p in sorted(path.iterdir()) if p.suffix in FORMATS and _data_file(p)])
        if not files:
            raise ToolkitError(f"Data file {path} is a directory with no data files in it (.jsonl, .json, .parquet, "
                               ".csv, .tsv, .arrow) and is no save_to_disk folder; name the files, or a glob.")
        return _files_source(entry, files, text)
    if kind == "file":
        return _files_source(entry, [path], text)
    if kind == "other":
        raise ToolkitError(not_regular_message(path))
    if path.suffix in FORMATS or not HUB_ID.match(text):
        raise ToolkitError(f"Data file {path} does not exist (paths are relative to the working directory).")
    return Source(entry, "hub", [], text)


def _kind(path: Path) -> str | None:
    """'file' (regular), 'dir', 'other' (a FIFO, device or socket: never opened, as opening a FIFO blocks) or None
    (nothing there, a dangling link included), following links. One stat."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # a link loop, a permission problem: said as it is
        raise ToolkitError(f"Data file {path} cannot be read ({e.strerror}).") from None
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"


def not_regular_message(path: Path) -> str:
    return (f"Data file {path} is not a regular file (a FIFO, device or socket); data is read from regular files: "
            "save the data to a file and name that.")


def check_regular(path: Path) -> None:
    """The error for a data file that is not there, or is not a regular file."""
    kind = _kind(path)
    if kind is None:
        raise ToolkitError(f"Data file {path} does not exist (paths are relative to the working directory).")
    if kind != "file":
        raise ToolkitError(not_regular_message(path) if kind == "other" else
                           f"Data file {path} is a directory; name the data files in it, or a glob.")


def _data_file(path: Path) -> bool:
    """Whether a file a folder or glob lists is data to read: a regular file (a dangling link is not); a FIFO or
    device is refused rather than skipped, as its rows would be silently missing."""
    kind = _kind(path)
    if kind == "other":
        raise ToolkitError(not_regular_message(path))
    return kind == "file"


def _unique(files: list[Path]) -> list[Path]:
    """Files in the order given, each real file once (links to a file already listed are left out)."""
    seen: set[str] = set()
    out = []
    for p in files:
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            out.append(p)
    return out


def walk_glob(pattern: str) -> list[Path]:
    """The regular files a glob matches (`*`, `?`, `[...]` within a name, `**` across folders, hidden names only
    when the pattern names them, as `glob.glob(recursive=True)`), in name order, each real file once.

    Written here rather than through `glob.glob` because that follows directory links without end: a folder
    holding `sub/up -> ..` listed one file 41 times, and two such links never finished. Here each (folder, rest of
    the pattern) is visited once, folders keyed by their (st_dev, st_ino), so a link to a folder already walked is
    followed at most once and a loop ends. (glob.translate, which would give the pattern as a regex, is 3.13+.)"""
    parts = list(Path(pattern).parts)
    first = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    root = Path(*parts[:first]) if first else Path()
    found: list[Path] = []
    _walk(root, tuple(parts[first:]), set(), found)
    return _unique(sorted(found))


def _walk(folder: Path, pats: tuple[str, ...], seen: set[tuple[int, int, int]], found: list[Path]) -> None:
    try:
        st = folder.stat()
        key = (st.st_dev, st.st_ino, len(pats))
        if key in seen or not stat.S_ISDIR(st.st_mode):
            return
        seen.add(key)
        names = sorted(os.listdir(folder))
    except OSError:  # unreadable, gone, or a link loop: nothing there, as glob has it
        return
    pat, rest = pats[0], pats[1:]
    if pat == "**":
        if rest:
            _walk(folder, rest, seen, found)  # ** as no folder at all
        for name in names:
            if name.startswith("."):
                continue
            path = folder / name
            if not rest and _data_file(path):
                found.append(path)
            _walk(path, pats, seen, found)
        return
    if glob.has_magic(pat):
        hidden = pat.startswith(".")
        matches = [n for n in fnmatch.filter(names, pat) if hidden or not n.startswith(".")]
    else:
        matches = [pat] if pat in names else []
    for name in matches:
        path = folder / name
        if rest:
            _walk(path, rest, seen, found)
        elif _data_file(path):
            found.append(path)


def _files_source(entry: Entry, files: list[Path], name: str) -> Source:
    formats = {_file_format(p) for p in files}
    if len(formats) > 1:
        raise ToolkitError(f"Data entry {name} holds files of several formats ({', '.join(sorted(formats))}); "
                           "give one entry per format.")
    return Source(entry, formats.pop(), files, name)


def _file_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix)
    if fmt is None:
        raise ToolkitError(f"Data file {path}: unknown format '{path.suffix}'; use .jsonl, .json, .parquet, .csv, "
                           ".tsv or .arrow.")
    if fmt == "json":  # a JSON array of rows, or JSON Lines under a .json name
        with path.open("rb") as f:
            head = f.read(4096).lstrip()
        return "json" if head[:1] == b"[" else "jsonl"
    return fmt


# --- reading rows ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """A contiguous run of rows of one file: bytes [start, end) of a JSON Lines file whose first line is
    `first`, or rows [start, end) of a table or array."""

    file_index: int
    start: int
    end: int
    first: int = 1
    rows: int = 0  # rows (lines, for JSON Lines) it holds, for progress


def open_source(source: Source) -> None:
    """Load what reading the source needs in this process: JSON arrays parsed, tables opened (memory-mapped) with
    `datasets`, a hub dataset found in the local cache. JSON Lines need nothing."""
    if source.fmt == "json" and not source.arrays:
        source.arrays = [_load_json_array(p) for p in source.files]
    elif source.fmt in ("parquet", "csv", "tsv", "arrow", "disk", "hub") and not source.tables:
        source.tables = _open_tables(source)


def pieces(source: Source, target_rows: int = 1000) -> Iterator[Piece]:
    """The source cut into pieces of about `target_rows` rows (JSON Lines: of about that many bytes' worth of
    lines, cut at line ends), in order."""
    for i, path in enumerate(source.files if source.fmt == "jsonl" else []):
        yield from _jsonl_pieces(i, path, target_rows)
    if source.fmt == "json":
        for i, rows in enumerate(source.arrays):
            yield from (Piece(i, a, min(a + target_rows, len(rows)), rows=min(target_rows, len(rows) - a))
                        for a in range(0, len(rows), target_rows))
    for i, table in enumerate(source.tables):
        yield from (Piece(i, a, min(a + target_rows, len(table)), rows=min(target_rows, len(table) - a))
                    for a in range(0, len(table), target_rows))


def _jsonl_pieces(index: int, path: Path, target_rows: int) -> Iterator[Piece]:
    """Pieces of a JSON Lines file cut at line ends, each starting with its absolute line number: one pass that
    counts newlines (bytes.count, not a parse)."""
    check_regular(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        sample = f.read(1 << 20)
        per_row = max(1, len(sample) // max(1, sample.count(b"\n"))) if sample else 1
        step = _jsonl_piece_bytes(per_row, target_rows)
        start, line = 0, 1
        while start < size:
            f.seek(min(start + step, size))
            if start + step < size:
                f.readline()  # to the end of the line the cut falls in
            end = min(f.tell(), size)
            f.seek(start)
            lines, last = 0, b""
            for _ in range(start, end, 1 << 20):  # in megabytes: a piece may be one enormous line
                chunk = f.read(min(1 << 20, end - f.tell()))
                lines, last = lines + chunk.count(b"\n"), chunk[-1:]
            lines += 0 if last == b"\n" else 1
            yield Piece(index, start, end, line, lines)
            start, line = end, line + lines


def _jsonl_piece_bytes(per_row: int, target_rows: int) -> int:
    """Bytes per piece of a JSON Lines file: about `target_rows` rows of the file's first megabyte's size."""
    return max(1 << 16, per_row * target_rows)


def read_piece(source: Source, piece: Piece) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows of a piece, mapped to the toolkit's shapes (`to_messages`), and their numbers (JSON Lines: line
    numbers; else 1-based row numbers in the file). A malformed row is an error naming it."""
    raw: list[tuple[int, Any]]
    if source.fmt == "jsonl":
        raw = list(_parse_jsonl(source.files[piece.file_index], piece.start, piece.end, piece.first))
    elif source.fmt == "json":
        array = source.arrays[piece.file_index]
        raw = [(n + 1, array[n]) for n in range(piece.start, piece.end)]
    else:
        table = source.tables[piece.file_index]
        rows = table.data.slice(piece.start, piece.end - piece.start).to_pylist()  # the mapped Arrow rows
        raw = list(zip(range(piece.start + 1, piece.end + 1), rows, strict=True))
    rows, numbers = [], []
    for number, row in raw:
        where = source.where(piece.file_index, number)
        if not isinstance(row, dict):
            raise ToolkitError(f"{where}: each {'line' if source.fmt == 'jsonl' else 'row'} must be a JSON object, "
                               f"got {type(row).__name__}.")
        rows.append(to_messages(row, source, where))
        numbers.append(number)
    return rows, numbers


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, row) for each non-blank line; a malformed line is an error naming file and line."""
    if path.is_dir():
        raise ToolkitError(f"Data file {path} is a directory; list the JSONL files in it one by one.")
    check_regular(path)
    for lineno, row in _parse_jsonl(path, 0, path.stat().st_size, 1):
        if not isinstance(row, dict):
            raise ToolkitError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}.")
        yield lineno, row


def _parse_jsonl(path: Path, start: int, end: int, first: int) -> Iterator[tuple[int, Any]]:
    """Rows of bytes [start, end) of a JSON Lines file, lines numbered from `first`. Read line by line (cut at
    newlines, as pieces count them) and each line's bytes and text let go as soon as they are used, and a blank line
    found without a stripped copy: an enormous line is held at most as its text and its parsed row at once (the size
    guard, toolkit/data/encoding.py SizeGuard, takes it from there)."""
    with path.open("rb") as f:
        f.seek(start)
        offset, number = start, first
        while offset < end:
            raw = f.readline(end - offset)
            if not raw:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ToolkitError(f"{path}:{number}: byte 0x{raw[e.start]:02x} at byte offset {offset + e.start} "
                                   "of the file is not UTF-8. Data files must be UTF-8 text: re-encode the file (for "
                                   "example iconv -f latin1 -t utf-8).") from None
            offset += len(raw)
            del raw
            if line and not line.isspace():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    # e.colno counts from the last newline json saw, the line's own one included: say it by
                    # position.
                    at = "the end of the line" if e.pos >= len(line.rstrip("\r\n")) else f"column {e.pos + 1}"
                    raise ToolkitError(f"{path}:{number}: not valid JSON ({e.msg} at {at}). "
                                       "Each line must be one JSON object.") from None
                del line
                yield number, row
                del row
            number += 1


def _load_json_array(path: Path) -> list[Any]:
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ToolkitError(f"{path}: byte offset {e.start} of the file is not UTF-8. Data files must be UTF-8 "
                           "text.") from None
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).") from None
    if not isinstance(rows, list):
        raise ToolkitError(f"{path}: a .json data file must hold an array of row objects (or one object per line).")
    return rows


def _open_tables(source: Source) -> list[Any]:
    """The source's rows as memory-mapped `datasets.Dataset`s: one per file, or the one dataset of a hub id or a
    save_to_disk folder (whose `files` become its Arrow files, for the content digest)."""
    import datasets  # only sources in table formats need it (2 s to import)

    split = source.entry.split
    try:
        if source.fmt == "hub":
            ds = _hub_dataset(source.name, split)
            source.files = sorted({Path(f["filename"]) for f in ds.cache_files})
            return [ds]
        if source.fmt == "disk":
            ds = datasets.load_from_disk(source.name)
            if isinstance(ds, datasets.DatasetDict):
                ds = _pick_split(ds, split, source.name)
            return [ds]
        if source.fmt == "arrow":
            return [_open_arrow(path) for path in source.files]
        builder = {"tsv": "csv"}.get(source.fmt, source.fmt)
        kwargs = {"sep": "\t"} if source.fmt == "tsv" else {}
        return [datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
                for path in source.files]
    except ToolkitError:
        raise
    except Exception as e:  # a file that is not what its suffix says; a hub id that is not cached
        raise ToolkitError(f"Data entry {source.name} could not be read as {source.fmt} "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:300]}).") from None


def _pick_split(dd: Any, split: str | None, name: str) -> Any:
    split = split or "train"
    if split not in dd:
        raise ToolkitError(f"Data entry {name} has no split '{split}'; its splits are {sorted(dd)} (set the "
                           "entry's split).")
    return dd[split]


def _hub_dataset(repo: str, split: str | None) -> Any:
    """A hub dataset from the local Hugging Face cache only: the latest version `datasets` prepared there (its
    offline lookup), never a download."""
    import datasets
    from datasets.packaged_modules.cache.cache import Cache

    home = os.environ.get("HF_HOME")
    cache = os.environ.get("HF_DATASETS_CACHE") or (str(Path(home) / "datasets") if home else
                                                    datasets.config.HF_DATASETS_CACHE)
    try:
        builder = Cache(dataset_name=repo.split("/")[-1], repo_id=repo, cache_dir=cache, version="auto", hash="auto")
    except ValueError:
        raise ToolkitError(f"Data entry {repo} is not a local path, and no hub dataset '{repo}' is in the local "
                           f"Hugging Face cache ({cache}); datasets are never downloaded here: load it once with "
                           "datasets.load_dataset, or give a file.") from None
    dd = builder.as_dataset()
    return _pick_split(dd, split, repo)


def _open_arrow(path: Path) -> Any:
    """An Arrow file, memory-mapped: an IPC stream (datasets' own cache files) or an IPC file (Feather v2)."""
    import datasets
    import pyarrow as pa

    try:
        return datasets.Dataset.from_file(str(path))
    except pa.ArrowInvalid:
        return datasets.Dataset(pa.ipc.open_file(pa.memory_map(str(path))).read_all())


# --- mapping rows to the toolkit's shapes ------------------------------------------------------------------------

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system", "observation": "tool", "tool": "tool", "function": "tool",
                  "function_response": "tool", "function_call": "assistant"}


def to_messages(row: dict[str, Any], source: Source, where: str) -> dict[str, Any]:
    """The row with the entry's column mapping applied, JSON text decoded where structure is expected, and a
    ShareGPT or Alpaca row turned into a `messages` row; any other row as it is."""
    if source.entry.columns:
        row = dict(row)
        taken = {}
        for ours, theirs in source.entry.columns:
            if theirs not in row:
                raise ToolkitError(f"{where}: no field '{theirs}' (columns.{ours} of data entry {source.name}); the "
                                   f"row has {sorted(row)}.")
            taken[ours] = row.pop(theirs)
        row.update(taken)
    if source.fmt in ("csv", "tsv") or isinstance(row.get("tools"), str):
        row = {k: _json_cell(v, k, where) if k in STRUCTURED and isinstance(v, str) else v for k, v in row.items()}
    if row.get("conversations") is not None:
        return _from_sharegpt(row, where)
    if row.get("instruction") is not None:
        return _from_alpaca(row, where)
    return row


def _json_cell(value: str, key: str, where: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{where}: field '{key}' is text that is not valid JSON ({e.msg}); it must hold a JSON "
                           "list or object.") from None


def _from_sharegpt(row: dict[str, Any], where: str) -> dict[str, Any]:
    """ShareGPT: `conversations` of {from, value} turns (human/gpt/system/function_call/observation, per-turn
    `weight` / `training` kept), optional row `system` and `tools`."""
    if row.get("messages") is not None:
        raise ToolkitError(f"{where}: the row has both 'messages' and 'conversations'; keep one.")
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ToolkitError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} turns.")
    messages = []
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise ToolkitError(f"{where}: 'system' must be a string.")
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ToolkitError(f"{where}: conversations[{i}] must be an object with 'from' and 'value'.")
        for key in ("from", "value"):
            if turn.get(key) is None:
                raise ToolkitError(f"{where}: conversations[{i}] has no '{key}'.")
        speaker = turn["from"]
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise ToolkitError(f"{where}: conversations[{i}].from is {speaker!r}; known speakers are "
                               f"{sorted(SHAREGPT_ROLES)}.")
        message: dict[str, Any] = {"role": role, "content": turn["value"]}
        if speaker == "function_call":
            message = {"role": "assistant", "content": "", "tool_calls": _tool_calls(turn["value"], i, where)}
        message.update({k: v for k, v in turn.items() if k not in ("from", "value") and v is not None})
        messages.append(message)
    out = {k: v for k, v in row.items() if k not in ("conversations", "system")}
    out["messages"] = messages
    return out


def _tool_calls(value: Any, i: int, where: str) -> list[dict[str, Any]]:
    """A function_call turn's value (JSON text of {name, arguments}, or a list of them) as `tool_calls`."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{where}: conversations[{i}] is a function_call whose value is not JSON ({e.msg}).") \
            from None
    calls = calls if isinstance(calls, list) else [calls]
    return [{"type": "function", "function": c} for c in calls]


def _from_alpaca(row: dict[str, Any], where: str) -> dict[str, Any]:
    """Alpaca: `instruction` (+ `input`, joined with a newline) -> `output`, optional `system` and `history`
    ([[instruction, output], ...] of earlier turns, which train like the last one)."""
    for key in ("messages", "conversations", "prompt", "text"):
        if row.get(key) is not None:
            raise ToolkitError(f"{where}: the row has both 'instruction' and '{key}'; keep one row shape.")
    if row.get("output") is None:
        raise ToolkitError(f"{where}: the row has 'instruction' but no 'output' (Alpaca rows need both).")
    for key in ("instruction", "input", "output", "system"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise ToolkitError(f"{where}: '{key}' must be a string.")
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") is not None else []
    history = row.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
        raise ToolkitError(f"{where}: 'history' must be a list of [instruction, output] pairs.")
    for query, answer in history:
        messages += [{"role": "user", "content": query}, {"role": "assistant", "content": answer}]
    prompt = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    out = {k: v for k, v in row.items() if k not in ("instruction", "input", "output", "system", "history")}
    out["messages"] = messages
    return out


# --- content digests -------------------------------------------------------------------------------------------

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stat_sig(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def content_digest(path: Path, cache_dir: Path | None) -> str:
    """sha256 of a data file's bytes; with a cache dir, remembered there (`hashes/`) while size, mtime, ctime and
    inode are unchanged, so a run hashes each file once. A hash is only remembered for a file last changed over
    RACY_WINDOW_NS before hashing: a same-size rewrite within the filesystem's timestamp granularity cannot hide
    behind an unchanged stat."""
    check_regular(path)
    if cache_dir is None:
        return _stream_sha256(path)
    sig = _stat_sig(path)
    record = cache_dir / "hashes" / f"{_sha256(str(path.resolve()).encode())}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(record.read_text())
        if saved["stat"] == sig and isinstance(saved["sha256"], str):
            return saved["sha256"]
    started = time.time_ns()
    digest = _stream_sha256(path)
    if started - max(sig[1], sig[2]) > RACY_WINDOW_NS and _stat_sig(path) == sig:
        payload = json.dumps({"path": str(path), "stat": sig, "sha256": digest}).encode()
        with contextlib.suppress(OSError):
            write_atomic(record, lambda f: f.write(payload))
    return digest


def _stream_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
