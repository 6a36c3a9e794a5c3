"""Loading what a checkpoint holds without running its code: pickles read weights-only (metadata by an allow-list), DCP
folders checked, before any resume or export reads them.

A check before a load leaves a window: a process that can write the checkpoint folder may swap a file between the
two. So a checkpoint is also *loaded* weights-only (`weights_only_loads`: torch's own switch forces it on every
`torch.load`, accelerate's and DeepSpeed's included, which pass weights_only=False for some files), and the small
custom states (the LR scheduler's `custom_checkpoint_*.pkl`) are read once, checked against their commit-time
sha256 and loaded from those very bytes (`load_checked`). DCP's `.metadata` is read by DCP with plain pickle, which
no switch reaches: it is checked here, and an FSDP checkpoint folder must not be writable by others.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import re
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from toolkit.atomic import open_own
from toolkit.errors import ToolkitError
from toolkit.strategies import consolidate


class _MetadataUnpickler(pickle.Unpickler):
    """For torch.distributed.checkpoint `.metadata` files: DCP's own metadata classes and torch basics only."""

    def find_class(self, module: str, name: str) -> Any:
        if "." in name:  # protocol 4 resolves dotted names attribute by attribute: 'os.system' via any module
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        if module.startswith(("torch.distributed.checkpoint.", "torch.distributed._shard.")):
            found = super().find_class(module, name)
            if isinstance(found, type):  # metadata dataclasses and enums, never functions
                return found
        elif (module in ("torch", "collections", "builtins") and name in _DCP_BASICS) or (
                (module, name) in {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


_DCP_BASICS = {"Size", "float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "int8", "bool",
               "strided", "contiguous_format", "device", "OrderedDict", "dtype", "layout", "memory_format",
               "set", "frozenset", "slice", "complex"}


def _load_weights_only(source: Any, *, mmap: bool = False) -> Any:
    with torch.serialization.safe_globals(consolidate.checkpoint_safe_globals()):
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


@contextlib.contextmanager
def weights_only_loads(ckpt: Path) -> Iterator[None]:
    """Inside, every torch.load of this process is weights-only with the types our checkpoints hold allowed,
    whatever its caller passes: accelerate's custom states and DeepSpeed's files are read with weights_only=False
    otherwise. torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD is the documented switch for it (torch.load reads it at each
    call); it is put back as it was on the way out. A refused pickle (a file of `ckpt` swapped after its check)
    ends in one line."""
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(consolidate.checkpoint_safe_globals()):
            yield
    except pickle.UnpicklingError as e:
        raise ToolkitError(f"Refusing to load checkpoint {ckpt}: one of its files changed after it was checked, into "
                           f"pickled objects that are not plain tensors or known-safe types ({not_allowed(e)[:200]})."
                           " Only load checkpoints you wrote yourself, from a folder no one else can write.") from None
    finally:
        if before is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def not_allowed(e: BaseException) -> str:
    """What an unpickler refused, in a few words: the global it met or the opcode, never torch's advice to load
    with weights_only=False (a checkpoint that needs it runs code)."""
    text = str(e).replace(torch.serialization.UNSAFE_MESSAGE, "")
    where = m[0] if (m := re.match(r"in \S+, entry \S+: ", text)) else ""  # a .distcp entry (_verify_dcp_dir)
    if m := re.search(r"GLOBAL (\S+)", text):
        return f"{where}global {m[1]} is not allowed"
    if m := re.search(r"Unsupported operand (\d+)", text):
        return f"{where}pickle opcode {m[1]} (an object built by a call) is not allowed"
    lines = [line.strip() for line in text.splitlines() if "global" in line or ".distcp" in line]
    said = " ".join(lines) or f"{where}objects of other types"
    return said if "weights_only" not in said else f"{where}objects of other types"


def load_checked(path: Path, sha256: str | None) -> Any:
    """The object pickled in `path`, a regular file of the checkpoint (never a link, never blocking on a FIFO),
    read once: its bytes are checked against `sha256` (what was committed; None for checkpoints of earlier
    versions) and unpickled weights-only from those same bytes, so a file swapped after any check is never what
    is loaded. Raises ToolkitError."""
    ckpt = path.parent
    try:
        with os.fdopen(open_own(path, os.O_RDONLY), "rb") as f:
            data = f.read()
    except OSError as e:
        raise ToolkitError(f"Checkpoint {ckpt}: {path.name} cannot be read ({e.strerror}). Resume from another "
                           "checkpoint (checkpoint.resume=<path>).") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ToolkitError(f"Checkpoint {ckpt} does not hold what was committed: {path.name} is not the file "
                           "committed with it (its sha256 differs). Resume from another checkpoint "
                           "(checkpoint.resume=<path>) or restore the original files.")
    try:
        return _load_weights_only(io.BytesIO(data))
    except pickle.UnpicklingError as e:
        raise ToolkitError(f"Refusing to load checkpoint {ckpt}: {path.name} contains pickled objects that are not "
                           f"plain tensors or known-safe types ({not_allowed(e)}). Only load checkpoints you wrote "
                           "yourself.") from None


def _verify_dcp_dir(metadata_file: Path) -> None:
    """A DCP directory: the pickled metadata, then every non-tensor entry of its .distcp files, which DCP's
    loader would otherwise unpickle with weights_only=False (optimizer param_groups, for example)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with metadata_file.open("rb") as f:
        metadata = _MetadataUnpickler(f).load()
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = metadata.storage_data[MetadataIndex(fqn)]
        if getattr(info, "transform_descriptors", None):
            raise pickle.UnpicklingError(f"entry {fqn} is stored transformed and cannot be checked")
        with (metadata_file.parent / info.relative_path).open("rb") as f:
            f.seek(info.offset)
            try:
                _load_weights_only(io.BytesIO(f.read(info.length)))
            except pickle.UnpicklingError as e:
                raise pickle.UnpicklingError(f"in {info.relative_path}, entry {fqn}: {e}") from None


def verify_checkpoint_files(ckpt: Path) -> None:
    """Raise ToolkitError if any file could execute code when unpickled, or is truncated/corrupt."""
    from safetensors import safe_open

    for path in sorted(ckpt.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):  # a FIFO would block the load for ever; a link leads out of the checkpoint
            raise ToolkitError(f"Checkpoint {ckpt}: {path.relative_to(ckpt)} is not a regular file (a link, FIFO, "
                               "socket or device; a checkpoint holds only files). Resume from another checkpoint "
                               "(checkpoint.resume=<path>).")
        try:
            if path.suffix in (".bin", ".pt", ".pkl", ".pth"):
                is_zip = zipfile.is_zipfile(path)
                with path.open("rb") as f:
                    head = f.read(4)
                    if not head or (not is_zip and head == b"PK\x03\x04"):
                        raise ValueError("empty or truncated (a zip archive without its directory)")
                _load_weights_only(path, mmap=is_zip)  # mmap: tensor data is not read
            elif path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                        f.get_slice(key)
            elif path.name == ".metadata":
                _verify_dcp_dir(path)
        except pickle.UnpicklingError as e:
            raise ToolkitError(f"Refusing to load checkpoint {ckpt}: {path.name} contains pickled objects that are "
                               f"not plain tensors or known-safe types ({not_allowed(e)[:300]}). Only "
                               "load checkpoints you wrote yourself.") from None
        except Exception as e:
            raise ToolkitError(f"Checkpoint {ckpt} is damaged: {path.relative_to(ckpt)} cannot be read "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Resume from an earlier "
                               "checkpoint (checkpoint.resume=<path>).") from None
