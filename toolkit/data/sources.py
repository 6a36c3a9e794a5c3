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
| `{dataset: NAME, dataset_dir: DIR}` | entry NAME of LLaMA-Factory's DIR/dataset_info.json, then its path |

Per entry, `split` picks a split (hub datasets, DatasetDict folders), `columns` maps the toolkit's field names to
the source's (`{messages: dialog}`) and `tags` the keys and role names inside its messages (LLaMA-Factory's
`role_tag`, `content_tag`, `user_tag`, ...). Each row read is handed to `toolkit/data/shapes.py:to_messages`, which
maps every peer's chat shape to a `messages` row; a preference stage's rows go to `toolkit/data/pairs.py:pair_rows`
instead, which makes each pair its chosen and rejected rows.

JSON Lines and JSON arrays are parsed by Python's json, not through `datasets`: Arrow's schema inference unifies the
rows of a file into one type, which turns a tool call's `arguments` into a struct with a null for every key another
row has (rendered into the prompt) and refuses string and list contents in one column (vision rows). The table
formats come typed already and are read through `datasets`, memory-mapped.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import glob
import hashlib
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

from toolkit.atomic import read_own_text, write_atomic
from toolkit.builtin.dummy_data import DUMMY_PREFIX
from toolkit.config.schema import TAG_KEYS
from toolkit.config.schema import DataEntry as Entry
from toolkit.data.encoding import KTO_LABEL, kto_label
from toolkit.data.pairs import pair_rows
from toolkit.data.roles import SAMPLE_ROWS, file_roles, flat_message, is_turns
from toolkit.data.shapes import holds_content, message_trees, threads, to_messages
from toolkit.errors import ToolkitError

FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv",
           ".arrow": "arrow"}
"""Data file suffixes and their formats."""
RACY_WINDOW_NS = 2_000_000_000
"""A file's hash is only remembered against its stat once the file is this old (git's "racy clean" rule)."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
    registry: dict[str, Any] | None = None  # a registry entry's own record (`dataset` entries)
    roles: dict[int, dict[str, str]] = field(default_factory=dict, compare=False, repr=False)  # `file_roles_of`

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
        if len(self.files) == 1 and self.fmt not in ("hub", "disk") and self.registry is None:
            return content_digest(self.files[0], cache_dir)
        parts: list[Any] = [(str(p), content_digest(p, cache_dir)) for p in self.files]
        if self.registry is not None:  # the registry's record decides how the rows read
            parts.append(["registry", self.registry])
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def stat_signature(self) -> list[list[int]]:
        return [file_stat_signature(p) for p in self.files]

    def describe(self) -> dict[str, Any]:
        return {"entry": self.entry.name, "format": self.fmt, "split": self.entry.split,
                "columns": dict(self.entry.columns), "tags": dict(self.entry.tags), "ignore": list(self.entry.ignore),
                "threads": self.entry.threads,
                "files": [str(p) for p in self.files]}


def resolve_source(entry: Entry, dummy_dir: Path) -> Source:
    """The source an entry names, or an error saying what it is not (checked before anything is tokenised). A
    registry entry (`dataset`) is first resolved to the path its registry names (`resolve_registry`)."""
    if entry.path is None:
        resolved, info = resolve_registry(entry)
        source = resolve_source(resolved, dummy_dir)
        source.registry = info
        return source
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
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():  # save_to_disk's own files
            return Source(entry, "disk", sorted(p for p in path.rglob("*") if p.is_file()), text)
        names = registry_names(path / "dataset_info.json")
        if names:
            raise ToolkitError(f"Data entry {text} is a LLaMA-Factory data folder (its dataset_info.json names "
                               f"{_some(names)}); name a dataset of it: {{dataset: {names[0]}, dataset_dir: "
                               f"{text.rstrip('/')}}}.")
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


# --- LLaMA-Factory's registry ---------------------------------------------------------------------------------

REGISTRY_KEYS = ("file_name", "formatting", "columns", "tags", "split", "ranking", "hf_hub_url", "ms_hub_url",
                 "om_hub_url", "script_url", "cloud_file_name", "subset", "folder", "num_samples")
"""The keys of a LLaMA-Factory registry entry (its DatasetAttr)."""
REGISTRY_COLUMNS = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
               "history": "history", "tools": "tools", "images": "images", "videos": "videos", "audios": "audios"},
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools", "images": "images",
                 "videos": "videos", "audios": "audios"},
    "openai": {"messages": "messages", "system": "system", "tools": "tools", "images": "images", "videos": "videos",
               "audios": "audios"},
}
"""A registry entry's `columns` (LLaMA-Factory's names, by formatting) -> the toolkit's row fields."""
RANKING_COLUMNS = {"chosen": "chosen", "rejected": "rejected"}
"""A `ranking: true` entry's pair columns (either formatting): its rows are preference pairs, read by a preference
stage (toolkit/data/pairs.py) and refused, as any pair row, by a stage of rows."""


def registry_names(path: Path) -> list[str]:
    """The dataset names of a LLaMA-Factory registry at `path`; [] when it is none (missing, or a `datasets`
    `dataset_info.json`, which describes features, not datasets)."""
    try:
        tree = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(tree, dict) or not tree or not all(isinstance(v, dict) for v in tree.values()):
        return []
    sources = ("file_name", "hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
    return list(tree) if any(k in v for v in tree.values() for k in sources) else []


def _some(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def resolve_registry(entry: Entry) -> tuple[Entry, dict[str, Any]]:
    """A `{dataset: NAME, dataset_dir: DIR}` entry read as LLaMA-Factory reads entry NAME of DIR/dataset_info.json:
    the path it names (`file_name` in DIR, or an `hf_hub_url` from the local cache), its `columns` as the toolkit's
    fields (by `formatting`), its `tags`. What the toolkit cannot train as LLaMA-Factory would is refused here; the
    other entries of the registry are not looked at. Returns the entry with that path, and the registry's record."""
    folder = Path(entry.dataset_dir or "data")
    registry = folder / "dataset_info.json"
    name = entry.dataset
    if not registry.is_file():
        raise ToolkitError(f"Data entry {{dataset: {name}}}: no registry {registry} (dataset_dir, default data, is "
                           "relative to the working directory).")
    try:
        tree = json.loads(registry.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolkitError(f"{registry}: not valid JSON ({e}).") from None
    if not isinstance(tree, dict):
        raise ToolkitError(f"{registry}: a registry must be a JSON object of dataset names to entries.")
    if name not in tree:
        close = difflib.get_close_matches(str(name), list(tree), n=5, cutoff=0.5)
        raise ToolkitError(f"{registry} has no dataset '{name}'; " + (f"close names: {', '.join(close)}." if close
                           else f"its datasets are {_some(list(tree))}."))
    info = tree[name]
    here = f"{registry} entry '{name}'"
    if not isinstance(info, dict):
        raise ToolkitError(f"{here} must be an object (file_name, formatting, columns, ...).")
    unknown = sorted(set(info) - set(REGISTRY_KEYS))
    if unknown:
        raise ToolkitError(f"{here} has {', '.join(unknown)}, which LLaMA-Factory's registry does not define; the "
                           f"keys are {', '.join(REGISTRY_KEYS)}.")
    columns, tags = info.get("columns") or {}, info.get("tags") or {}
    if not isinstance(columns, dict) or not isinstance(tags, dict):
        raise ToolkitError(f"{here}: columns and tags must be objects.")
    if "kto_tag" in columns or "kto_tag" in tags:
        raise ToolkitError(f"{here} is a KTO dataset (kto_tag), which is not supported: LLaMA-Factory's KTO "
                           "entries are not read (rows would train supervised, learning the undesirable answers); "
                           "give the file as TRL's unpaired rows (prompt, completion, a true/false label) to a stage "
                           "with objective: kto, or use an SFT dataset.")
    if info.get("num_samples") is not None:
        raise ToolkitError(f"{here} has num_samples, which is not supported (it samples the dataset); cut the file "
                           "to the rows to train.")
    formatting = info.get("formatting", "alpaca")
    if formatting not in REGISTRY_COLUMNS:
        raise ToolkitError(f"{here} has formatting '{formatting}'; it must be alpaca, sharegpt or openai.")
    fields = {**REGISTRY_COLUMNS[formatting], **RANKING_COLUMNS}
    if info.get("ranking"):  # LLaMA-Factory names its pairs' columns; a ranking entry without them reads these
        columns = {**{k: k for k in RANKING_COLUMNS}, **columns}
    bad = sorted(set(columns) - set(fields))
    if bad:
        raise ToolkitError(f"{here}: columns {', '.join(bad)} are not {formatting} columns; those are "
                           f"{', '.join(fields)}.")
    bad = sorted(set(tags) - set(TAG_KEYS))
    if bad:
        raise ToolkitError(f"{here}: tags {', '.join(bad)} are not tags; those are {', '.join(TAG_KEYS)}.")
    for key in ("ms_hub_url", "om_hub_url", "script_url", "cloud_file_name"):
        if info.get(key) and not info.get("hf_hub_url"):
            raise ToolkitError(f"{here} has {key} {info[key]!r} and no file_name or hf_hub_url, which this toolkit "
                               "does not read (it never downloads or runs loading scripts); save the dataset to a "
                               "file in the registry's folder and give its file_name.")
    if info.get("hf_hub_url"):
        for key in ("subset", "folder"):
            if info.get(key):
                raise ToolkitError(f"{here} has {key} {info[key]!r}; a subset or folder of a hub dataset is not "
                                   "read: save it to a file in the registry's folder and give its file_name.")
        path = str(info["hf_hub_url"])
    elif info.get("file_name"):
        name_in_dir = PurePath(str(info["file_name"]))
        if name_in_dir.is_absolute() or ".." in name_in_dir.parts:
            raise ToolkitError(f"{here} has file_name {str(info['file_name'])!r}, which leaves {folder}: a registry "
                               "names files in its own folder; to train on another file, name it in the recipe "
                               "(path: ...).")
        path = str(folder / name_in_dir)
    else:
        raise ToolkitError(f"{here} has no file_name (or hf_hub_url) to read.")
    mapped = {fields[k]: str(v) for k, v in columns.items()}
    mapped.update(dict(entry.columns))  # the recipe's own mapping wins
    merged_tags = {**{k: str(v) for k, v in tags.items()}, **dict(entry.tags)}
    split = entry.split or (str(info["split"]) if info.get("split") and info.get("hf_hub_url") else None)
    resolved = replace(entry, path=path, split=split, columns=tuple(sorted(mapped.items())),
                       tags=tuple(sorted(merged_tags.items())))
    return resolved, {"name": name, **info}


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
    if fmt == "json":  # a JSON array of rows, one JSON object, or JSON Lines under a .json name
        with path.open("rb") as f:
            head = f.read(4096).lstrip()
            if head[:1] == b"[":
                return "json"
            f.seek(0)
            first = f.readline()
        try:
            json.loads(first)
        except (UnicodeDecodeError, json.JSONDecodeError):  # not one object per line: one pretty-printed object?
            with contextlib.suppress(UnicodeDecodeError, json.JSONDecodeError, OSError):
                if isinstance(json.loads(path.read_bytes().decode("utf-8")), dict):
                    return "json"
        return "jsonl"
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
    whole: bool = False  # the whole file, a flat message export: its rows are grouped into trees (`read_piece`)


def open_source(source: Source) -> None:
    """Load what reading the source needs in this process: JSON arrays parsed, tables opened (memory-mapped) with
    `datasets`, a hub dataset found in the local cache. JSON Lines need nothing."""
    if source.fmt == "json" and not source.arrays:
        source.arrays = [_load_json_array(p) for p in source.files]
    elif source.fmt in ("parquet", "csv", "tsv", "arrow", "disk", "hub") and not source.tables:
        source.tables = _open_tables(source)


def pieces(source: Source, target_rows: int = 1000) -> Iterator[Piece]:
    """The source cut into pieces of about `target_rows` rows (JSON Lines: of about that many bytes' worth of
    lines, cut at line ends), in order. A file whose first row is one message of a flat message export
    (`roles.flat_message`) is one piece, read whole, so its messages can be grouped into trees (`read_piece`): the
    smallest place where all of a file's rows meet. Its rows are held in memory together, each within the row byte
    cap as any row is, and so is each rebuilt tree; a .json array is held whole the same way."""
    for i, path in enumerate(source.files if source.fmt == "jsonl" else []):
        if _flat_jsonl(path):
            yield from (replace(p, whole=True) for p in _jsonl_pieces(i, path, 1 << 62))
        else:
            yield from _jsonl_pieces(i, path, target_rows)
    if source.fmt == "json":
        for i, rows in enumerate(source.arrays):
            flat = len(rows) > 0 and flat_message(rows[0]) is not None
            step = len(rows) if flat else target_rows
            yield from (Piece(i, a, min(a + step, len(rows)), rows=min(step, len(rows) - a), whole=flat)
                        for a in range(0, len(rows), step))
    for i, table in enumerate(source.tables):
        flat = len(table) > 0 and flat_message(table[0]) is not None
        step = len(table) if flat else target_rows
        yield from (Piece(i, a, min(a + step, len(table)), rows=min(step, len(table) - a), whole=flat)
                    for a in range(0, len(table), step))


def _flat_jsonl(path: Path) -> bool:
    """Whether a JSON Lines file's first row is one message of a flat message export (a first line over
    ROW_BYTES_FLOOR is not read whole: such a file is read in pieces, and its rows refused as messages)."""
    check_regular(path)
    with path.open("rb") as f:
        for line in iter(lambda: f.readline(ROW_BYTES_FLOOR + 1), b""):
            if line.strip():
                try:
                    return flat_message(json.loads(line)) is not None
                except ValueError:
                    return False
    return False


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


def kto_row(row: dict[str, Any], source: Source, where: str) -> list[dict[str, Any]]:
    """A kto stage's row (TRL's `prompt`, `completion`, `label`; standard or conversational) as one row of the
    toolkit's shapes, its label kept under KTO_LABEL (a missing or non-boolean label refused in one line)."""
    desirable = kto_label(row, where)
    got = threads(to_messages({k: v for k, v in row.items() if k != "label"}, source, where))
    if len(got) != 1:
        raise ToolkitError(f"{where}: a kto stage's row must be one completion; this row holds {len(got)} threads.")
    return [{**got[0], KTO_LABEL: desirable}]


def read_piece(source: Source, piece: Piece, max_chars: Callable[[], int] | None = None, *, pairs: bool = False,
               kto: bool = False) -> tuple[list[dict[str, Any] | Oversize], list[int]]:
    """The rows of a piece, mapped to the toolkit's shapes (`to_messages`), and their numbers (JSON Lines: line
    numbers; else 1-based row numbers in the file). A malformed row is an error naming it. `max_chars` (the size
    guard's limit, asked only of a line over ROW_BYTES_FLOOR) caps a JSON Lines row's (a table row's) bytes: a row over
    `row_byte_cap` comes as an `Oversize`, unread. With `pairs` (a preference stage) each row is a pair and comes
    as two rows, its chosen and its rejected one (`toolkit.data.pairs.pair_rows`), both with the row's number (an
    Oversize twice). With `kto` (a kto stage) each row carries a true/false `label`, read apart (`kto_row`)."""
    rows: list[dict[str, Any] | Oversize] = []
    numbers = []
    raw = raw_rows(source, piece, max_chars)
    if piece.whole and not pairs:  # a flat message export: its messages as trees, each capped as a row is
        raw = message_trees(raw, lambda n: source.where(piece.file_index, n))
        if max_chars is not None:
            cap = row_byte_cap(max_chars())
            sized = [(n, r, len(json.dumps(r, ensure_ascii=False).encode()) if isinstance(r, dict) else 0)
                     for n, r in raw]
            raw = [(n, Oversize(size, cap) if size > cap else r) for n, r, size in sized]
    roles = None if piece.whole and not pairs else file_roles_of(source, piece.file_index)
    for number, row in raw:
        where = source.where(piece.file_index, number)
        if isinstance(row, Oversize):
            got: list[dict[str, Any] | Oversize] = [row, row] if pairs else [row]
        elif not isinstance(row, dict) and not is_turns(row):
            raise ToolkitError(f"{where}: each {'line' if source.fmt == 'jsonl' else 'row'} must be a JSON object, "
                               f"got {type(row).__name__}.")
        else:
            if not isinstance(row, dict):  # a bare list of turns is the row's chat (toolkit/data/roles.py)
                row = {"messages": row}
            got = (list(pair_rows(row, source, where, roles)) if pairs else kto_row(row, source, where) if kto
                   else threads(to_messages(row, source, where, roles=roles)))
        rows += got
        numbers += [number] * len(got)
    return rows, numbers


SAMPLE_LINE_BYTES = 1 << 20
"""The longest JSON Lines line a file's role sample parses (`sample_rows`)."""


def sample_rows(source: Source, file_index: int, n: int = SAMPLE_ROWS) -> list[Any]:
    """A file's first `n` rows as stored (JSON Lines lines that parse, each under SAMPLE_LINE_BYTES: a longer line is
    skipped unparsed, in pieces of that size, so a huge row costs the sample no memory; array items; table rows), a
    bare list of turns as `{"messages": list}`: the sample its column roles are inferred from."""
    rows: list[Any] = []
    if source.fmt == "jsonl":
        with source.files[file_index].open("rb") as f:
            long = False  # inside a line over SAMPLE_LINE_BYTES
            for line in iter(lambda: f.readline(SAMPLE_LINE_BYTES), b""):
                if len(rows) >= n:
                    break
                whole = line.endswith(b"\n")
                if long or (not whole and len(line) >= SAMPLE_LINE_BYTES):
                    long = not whole
                    continue
                with contextlib.suppress(ValueError):
                    if line.strip():
                        rows.append(json.loads(line))
    else:
        open_source(source)
        size = len(source.arrays[file_index] if source.fmt == "json" else source.tables[file_index])
        rows = [r for _, r in raw_rows(source, Piece(file_index, 0, min(n, size)), lambda: 1 << 20)
                if not isinstance(r, Oversize)]  # a row over the floor's cap is not made Python objects
    return [{"messages": r} if isinstance(r, list) and is_turns(r) else r for r in rows]


def file_roles_of(source: Source, file_index: int) -> dict[str, str]:
    """The roles of a file's columns (toolkit/data/roles.py `file_roles`), inferred once per file from its first
    rows and kept on the source: training's reader, its refusals and `toolkit inspect-data` use the same."""
    if file_index not in source.roles:
        source.roles[file_index] = file_roles(sample_rows(source, file_index), holds_content)
    return source.roles[file_index]


def raw_rows(source: Source, piece: Piece, max_chars: Callable[[], int] | None = None
             ) -> list[tuple[int, Any]]:
    """(number, row as stored) of a piece's rows, unmapped: JSON Lines parsed (an `Oversize` for a row over the
    size guard's cap, `read_piece`), array items, or a table's mapped Arrow rows (with `max_chars`, one over the
    cap in Arrow bytes an `Oversize`, never made Python objects)."""
    if source.fmt == "jsonl":
        return list(_parse_jsonl(source.files[piece.file_index], piece.start, piece.end, piece.first, max_chars))
    if source.fmt == "json":
        array = source.arrays[piece.file_index]
        return [(n + 1, array[n]) for n in range(piece.start, piece.end)]
    table = source.tables[piece.file_index]
    sliced = table.data.slice(piece.start, piece.end - piece.start)
    sliced = getattr(sliced, "table", sliced)  # the pyarrow table of datasets' wrapper
    if max_chars is None or sliced.nbytes <= ROW_BYTES_FLOOR:
        rows: list[Any] = sliced.to_pylist()  # the mapped Arrow rows: none can be over the cap
    else:  # a row's Arrow bytes (its buffers within the slice) capped as a JSON Lines line's bytes: over, unread
        cap = row_byte_cap(max_chars())
        rows = []
        for i in range(len(sliced)):
            one = sliced.slice(i, 1)
            rows.append(Oversize(one.nbytes, cap) if one.nbytes > cap else one.to_pylist()[0])
    return list(zip(range(piece.start + 1, piece.end + 1), rows, strict=True))


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, row) for each non-blank line; a malformed line is an error naming file and line."""
    if path.is_dir():
        raise ToolkitError(f"Data file {path} is a directory; list the JSONL files in it one by one.")
    check_regular(path)
    for lineno, row in _parse_jsonl(path, 0, path.stat().st_size, 1):
        if not isinstance(row, dict):
            raise ToolkitError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}.")
        yield lineno, row


ROW_BYTES_PER_CHAR = 12
"""The most bytes JSON takes for one character of text: an astral character escaped as a surrogate pair
(`\\ud83d\\ude00`, one Python character)."""


def row_byte_cap(max_chars: int) -> int:
    """The most bytes of one JSON Lines row that are parsed, for a size guard limit of `max_chars` characters
    (toolkit/data/encoding.py SizeGuard.limit, at least GUARD_MIN_CHARS, so the cap is at least ROW_BYTES_FLOOR).

    Parsing a row and rendering it through the chat template costs a few tens of times its bytes in memory (a 35 MB
    row of a million short messages: +0.8 GB), before the size guard sees any text; so a line is measured in bytes
    first, and one over the cap is never read whole: its memory is bounded by the cap whatever the row's size. It is
    stored unread (no tokens, listed in the store's meta.json under `oversize`); data.overlength: drop drops it, and
    error and truncate (which would keep its first tokens) refuse it in one line. The cap is not a token count:
    JSON's escapes and structure, whitespace and keys nothing reads make bytes no lower bound on tokens, so such a
    row is not said to be over max_seq_len, only too large to read. It is set where no ordinary row reaches: every
    character of text the guard tokenises (a row with more text is surely over max_seq_len) written in JSON's
    costliest form."""
    return ROW_BYTES_PER_CHAR * max_chars


ROW_BYTES_FLOOR = row_byte_cap(1 << 20)  # = row_byte_cap(GUARD_MIN_CHARS): lines up to it never ask for the limit


@dataclass(frozen=True)
class Oversize:
    """A JSON Lines row over `row_byte_cap`, in place of the row: not read, only measured."""

    size: int  # its bytes
    cap: int


def oversize_message(where: str, size: int, cap: int) -> str:
    """The one line for a row over the row byte cap, under data.overlength error or truncate."""
    return (f"{where}: the line is {size:,} bytes, over the {cap:,}-byte cap on one row ({ROW_BYTES_PER_CHAR} bytes "
            "of JSON, the most one character takes, per character of text the size guard reads for "
            "data.max_seq_len); it is not read, as parsing and rendering it would take tens of times its size in "
            "memory. Split it into smaller rows, remove it, or set data.overlength: drop to drop such rows unread.")


def _read_line(f: Any, budget: int, max_chars: Callable[[], int] | None) -> bytes | Oversize:
    """The next line (at most `budget` bytes); one over the row byte cap is skipped to its end, read in megabytes
    and never held whole, and measured."""
    if max_chars is None:
        return f.readline(budget)
    raw = f.readline(min(budget, ROW_BYTES_FLOOR + 1))
    if len(raw) <= ROW_BYTES_FLOOR or raw.endswith(b"\n"):
        return raw
    cap = row_byte_cap(max_chars())
    raw += f.readline(max(0, min(budget, cap + 1) - len(raw)))
    if len(raw) <= cap or raw.endswith(b"\n"):
        return raw
    size = len(raw)
    del raw
    while size < budget:
        chunk = f.readline(min(1 << 20, budget - size))
        size += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            break
    return Oversize(size, cap)


def _parse_jsonl(path: Path, start: int, end: int, first: int, max_chars: Callable[[], int] | None = None
                 ) -> Iterator[tuple[int, Any]]:
    """Rows of bytes [start, end) of a JSON Lines file, lines numbered from `first`. Read line by line (cut at
    newlines, as pieces count them) and each line's bytes and text let go as soon as they are used, and a blank line
    found without a stripped copy: an enormous line is held at most as its text and its parsed row at once (the size
    guard, toolkit/data/encoding.py SizeGuard, takes it from there). With `max_chars`, a line over `row_byte_cap`
    is not read whole: an `Oversize` stands in its place."""
    with path.open("rb") as f:
        f.seek(start)
        offset, number = start, first
        while offset < end:
            raw = _read_line(f, end - offset, max_chars)
            if isinstance(raw, Oversize):
                offset += raw.size
                yield number, raw
                number += 1
                continue
            if not raw:
                break
            if _fast_loads is not None and not raw.isspace() and _LONG_DIGITS.search(raw) is None:
                try:  # orjson where it parses the line; json (below) for what it refuses: errors as json says them
                    row = _fast_loads(raw)
                except ValueError:
                    pass
                else:
                    offset += len(raw)
                    del raw
                    yield number, row
                    del row
                    number += 1
                    continue
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
                    raise ToolkitError(f"{path}:{number}: not valid JSON ({_json_problem(e)} at {at}). "
                                       "Each line must be one JSON object.") from None
                except RecursionError:  # json's C parser recurses once per level of [ or {
                    raise ToolkitError(f"{path}:{number}: nested too deeply (over Python's recursion limit of "
                                       f"{sys.getrecursionlimit()} levels of lists and objects); no chat row is "
                                       "nested like that: fix or drop the row.") from None
                del line
                yield number, row
                del row
            number += 1


try:
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is a dependency; json parses the same rows, slower
    _fast_loads = None
"""orjson's parser: the rows json parses, to the same objects, 2-6x as fast (docs/benchmarks.md, issue 52). What
it refuses (invalid UTF-8, NaN and Infinity, integers over 64 bits, lone surrogates, nesting over 1024 levels,
malformed JSON) goes to json, which reads it or raises the error users see; so does a line with 19 digits in a
row, as orjson reads an integer outside 64 bits as a float where json keeps it whole."""
_LONG_DIGITS = re.compile(rb"\d{19}")


def _json_problem(e: json.JSONDecodeError) -> str:
    """json's message without its trailing "at" ("Unterminated string starting at"): the caller says where."""
    return e.msg.removesuffix(" at")


_JSON_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]')
"""A JSON string (skipped whole, escapes and all) or one of the structure characters a row boundary is found by."""


def _json_elements(path: Path, data: bytes, cap: int) -> list[Any]:
    """The rows of a .json file over the row byte cap as a whole: each element of its array (or the one object)
    parsed alone, and one over `cap` bytes not parsed at all but measured (an `Oversize`), as a JSON Lines line
    over the cap is. The boundaries are found by a scan of strings and brackets (the regular expression engine
    skips each string whole), never by parsing the file: a 35 MB one-row file would cost +275 MB parsed whole."""
    start = len(data) - len(data.lstrip())
    if data[start:start + 1] == b"{":
        return [Oversize(len(data.strip()), cap)] if len(data.strip()) > cap else \
            _json_rows(path, json_loads_bytes(path, data))
    if data[start:start + 1] != b"[":
        raise ToolkitError(f"{path}: a .json data file must hold an array of row objects (or one object per line).")
    rows: list[Any] = []
    depth, begin = 0, start + 1
    for match in _JSON_TOKENS.finditer(data, start):
        token = match.group()
        if token[:1] == b'"':
            continue
        if token in (b"[", b"{"):
            depth += 1
            continue
        if token in (b"]", b"}"):
            depth -= 1
        if (depth == 1 and token == b",") or (depth == 0 and token == b"]"):
            element = data[begin:match.start()].strip()
            begin = match.end()
            if element:
                n = len(rows) + 1
                rows.append(Oversize(len(element), cap) if len(element) > cap else
                            json_loads_bytes(path, element, f"row {n}"))
            elif token == b",":
                raise ToolkitError(f"{path}: not valid JSON (an empty element before row {len(rows) + 1}).")
            if depth == 0:
                if data[match.end():].strip():
                    raise ToolkitError(f"{path}: not valid JSON (extra data after the array).")
                return rows
    raise ToolkitError(f"{path}: not valid JSON (the array is not closed: the file was cut short).")


def json_loads_bytes(path: Path, data: bytes, where: str | None = None) -> Any:
    """`data` (UTF-8 JSON) parsed; each failure one line naming `path` (and `where` in it)."""
    at = f"{path}" + (f": {where}" if where else "")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ToolkitError(f"{at}: byte {e.start} is not UTF-8. Data files must be UTF-8 text.") from None
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{at}: not valid JSON ({_json_problem(e)} at line {e.lineno}, column {e.colno}).") \
            from None
    except RecursionError:
        raise ToolkitError(f"{at}: nested too deeply (over Python's recursion limit of {sys.getrecursionlimit()} "
                           "levels of lists and objects); no chat row is nested like that: fix or drop the row.") \
            from None


def _json_rows(path: Path, rows: Any) -> list[Any]:
    if isinstance(rows, dict):  # one object: one row, when it is one
        if set(rows) & set(ROW_KEYS):
            return [rows]
        raise ToolkitError(f"{path}: the file holds one object, not an array, and it is not a row (its keys are "
                           f"{sorted(rows)[:12]}; a row has one of {', '.join(ROW_KEYS)}); a .json data file holds an "
                           "array of row objects, one object per line, or one row.")
    if not isinstance(rows, list):
        raise ToolkitError(f"{path}: a .json data file must hold an array of row objects (or one object per line).")
    return rows


def _load_json_array(path: Path) -> list[Any]:
    """The rows of a .json file: parsed whole when the file is within the row byte cap's floor (no row of it can
    be over), else element by element (`_json_elements`), a row over the cap standing unread as an `Oversize`."""
    check_regular(path)
    if path.stat().st_size > ROW_BYTES_FLOOR:
        return _json_elements(path, path.read_bytes(), ROW_BYTES_FLOOR)
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ToolkitError(f"{path}: byte offset {e.start} of the file is not UTF-8. Data files must be UTF-8 "
                           "text.") from None
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{path}: not valid JSON ({_json_problem(e)} at line {e.lineno}, column {e.colno}).") \
            from None
    except RecursionError:
        raise ToolkitError(f"{path}: nested too deeply (over Python's recursion limit of {sys.getrecursionlimit()} "
                           "levels of lists and objects); no chat row is nested like that: fix or drop the row.") \
            from None
    return _json_rows(path, rows)


ROW_KEYS = ("messages", "conversations", "conversation", "instruction", "prompt", "completion", "text", "query")
"""Keys that make an object a row (a JSON file holding one object is one row when it has one)."""


def _open_tables(source: Source) -> list[Any]:
    """The source's rows as memory-mapped `datasets.Dataset`s: one per file, or the one dataset of a hub id or a
    save_to_disk folder (whose `files` become its Arrow files, for the content digest)."""
    import datasets  # only sources in table formats need it (2 s to import)

    split = source.entry.split
    try:
        if source.fmt == "hub":
            try:
                ds = _hub_dataset(source.name, split)
            except ToolkitError as e:
                if source.registry is None:
                    raise
                entry = source.entry
                raise ToolkitError(f"{entry.dataset_dir}/dataset_info.json entry '{entry.dataset}' has hf_hub_url "
                                   f"{source.name}: {e}") from None
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
        kwargs: dict[str, Any] = {"sep": "\t"} if source.fmt == "tsv" else {}
        tables = []
        for path in source.files:
            if source.fmt in ("csv", "tsv"):
                _check_csv_lines(path)
            if source.fmt in ("csv", "tsv"):  # every cell is text, as ms-swift reads its own files: `00000` stays
                kwargs.update(keep_default_na=False, features=datasets.Features(
                    {name: datasets.Value("string") for name in _header(path, kwargs.get("sep", ","))}))
            tables.append(datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs))
        return tables
    except ToolkitError:
        raise
    except Exception as e:  # a file that is not what its suffix says; a hub id that is not cached
        raise ToolkitError(f"Data entry {source.name} could not be read as {source.fmt} "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:300]}).") from None


def _check_csv_lines(path: Path) -> None:
    """Refuse, in one line naming it, a CSV / TSV line over the row byte cap (`ROW_BYTES_FLOOR`, the least cap of a
    JSON Lines row) before the file is parsed: pandas' reader holds a line whole, and its cells as Python objects
    (a 95 MB line cost +640 MB). Measured in megabytes, never held whole."""
    check_regular(path)
    cap = ROW_BYTES_FLOOR
    with path.open("rb") as f:
        number, length = 1, 0
        while chunk := f.read(1 << 20):
            parts = chunk.split(b"\n")
            for i, part in enumerate(parts):
                length += len(part)
                if length > cap:
                    raise ToolkitError(f"{path}:{number}: the line is over the {cap:,}-byte cap on one row; it is not "
                                       "read, as parsing it would take many times its size in memory. Split it "
                                       "into smaller rows, or remove it.")
                if i < len(parts) - 1:
                    number, length = number + 1, 0


def _header(path: Path, sep: str) -> list[str]:
    """The column names of a CSV / TSV file's first line (Python's csv, as pandas reads a header): Excel's byte
    order mark is not part of the first name, and an unnamed column (pandas' `to_csv` writes its index so) is
    `Unnamed: N`, as pandas names it; its cells hold no content and the log names it."""
    import csv

    with path.open(encoding="utf-8-sig", newline="") as f:
        names = next(csv.reader(f, delimiter=sep), [])
    return [name or f"Unnamed: {i}" for i, name in enumerate(names)]


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


# --- content digests -------------------------------------------------------------------------------------------

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_stat_signature(path: Path) -> list[int]:
    """Size, mtime, ctime and inode: what changes when a file is rewritten (content digests and the token store's
    checksum are remembered against it)."""
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
    sig = file_stat_signature(path)
    record = cache_dir / "hashes" / f"{_sha256(str(path.resolve()).encode())}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(read_own_text(record))  # a shared cache: never through a link, nor blocking on a FIFO
        if saved["stat"] == sig and isinstance(saved["sha256"], str):
            return saved["sha256"]
    started = time.time_ns()
    digest = _stream_sha256(path)
    if started - max(sig[1], sig[2]) > RACY_WINDOW_NS and file_stat_signature(path) == sig:
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
