"""Loading what a checkpoint holds without running its code: pickles read weights-only (metadata by an allow-list), DCP
folders checked, before any resume or export reads them."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

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


def _load_weights_only(source: Any, *, mmap: bool = False) -> None:
    with torch.serialization.safe_globals(consolidate.checkpoint_safe_globals()):
        torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


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
        if not path.is_file():
            continue
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
            lines = str(e).splitlines()
            culprit = " ".join(line.strip() for line in lines if "GLOBAL" in line or "global" in line or
                               ".distcp" in line) or lines[0]
            raise ToolkitError(f"Refusing to load checkpoint {ckpt}: {path.name} contains pickled objects that are "
                               f"not plain tensors or known-safe types ({culprit[:300]}). Only "
                               "load checkpoints you wrote yourself.") from None
        except Exception as e:
            raise ToolkitError(f"Checkpoint {ckpt} is damaged: {path.relative_to(ckpt)} cannot be read "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Resume from an earlier "
                               "checkpoint (checkpoint.resume=<path>).") from None
