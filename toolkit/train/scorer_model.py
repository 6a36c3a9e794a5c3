"""A separate scorer model (`difficulty.model: <folder or hub id>`): a small model whose scores order or filter a
stage for a bigger one (Superfiltering, Li et al. 2024).

Checked before anything heavy (`check_scorers`, with the run's tokenizer, before the data work and the policy):
the scorer resolves to a local folder (a hub id through the local Hugging Face cache; offline and not there, it
is refused), its config reads, and its tokenizer (with the run's `data.chat_template` override, as the run's) has
the run's tokenizer's fingerprint (`toolkit.data.store.tokenizer_fingerprint`: vocabulary, added and special
tokens, chat template): the rows are tokenised once, by the run, so a scorer of another vocabulary would score
other tokens. Each refusal is one line naming the stage, the scorer and what differs.

Its identity (`weights_identity`) is the sha256 of each weights file (`*.safetensors`, `*.bin`, streamed) and of
its config, with the dtype it runs in: part of the scores' key, so a changed scorer rescores and nothing else does.

Its own Python code (a config with `auto_map`) runs only with its own consent, `difficulty.trust_remote_code` of
its stage: `model.trust_remote_code` covers the run's model only. A scorer that needs code and lacks it is refused
in one line naming it, as is one whose pickled `.bin` weights do not load weights-only.

Loaded (`load_scorer`) only when scores are missing: with `from_pretrained`, whole on every process (never
sharded, not under ZeRO-3's `zero.Init` nor FSDP's rank-0-only loading: a scorer is small by design), in the run's
dtype, on the process's device, in eval mode, with the policy's attention kernel and the run's loss head (so
`row_sums` gets per-row sums without full logits; `model.loss_head: standard` takes the full-logits path), then
freed: `del`, `gc.collect()` and, on CUDA, `torch.cuda.empty_cache()`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from toolkit.builtin.models import materialize_builtin
from toolkit.config.schema import MODEL_MEASURES, SCORERS, Recipe
from toolkit.config.stages import ResolvedStage
from toolkit.data.store import tokenizer_fingerprint
from toolkit.errors import ToolkitError
from toolkit.model.attention import check_packing_support
from toolkit.model.load import load_model, load_tokenizer, resolve_dtype
from toolkit.model.loss_head import install_loss_head
from toolkit.runtime.run_dir import RunLayout
from toolkit.strategies.deepspeed import without_zero3_init

log = logging.getLogger("toolkit")

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def separate_scorer(stage: ResolvedStage) -> str | None:
    """The stage's separate scorer (`difficulty.model` other than base / current), else None."""
    how = stage.difficulty
    if how is None or how.by not in MODEL_MEASURES or how.model is None or how.model in SCORERS:
        return None
    return how.model


def resolve_scorer(name: str, output_dir: str | Path) -> Path:
    """The scorer's local folder: a built-in model built in the run's cache, a folder as it is, a hub id's snapshot
    in the local Hugging Face cache (fetched only when the hub may be reached)."""
    if name.startswith("builtin:"):
        return Path(materialize_builtin(name, RunLayout(output_dir).cache))
    path = Path(name).expanduser()
    if name.startswith((".", "/", "~")) or path.exists():
        if not (path / "config.json").is_file():
            raise ToolkitError(f"difficulty.model '{name}' is not a model folder (no config.json): give a folder "
                               "saved with save_pretrained, or a hub id.")
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not in the cache (or not a valid id): said below
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ToolkitError(f"difficulty.model '{name}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                           f"set: download it where there is network (hf download {name}), or give a local folder.")
    try:  # the config, tokenizer and weights; not other formats' copies of them
        return Path(snapshot_download(name, ignore_patterns=["*.onnx", "*.gguf", "*.h5", "*.msgpack", "*.ot",
                                                             "*.pt", "*.pth", "original/*", "onnx/*"]))
    except Exception as e:  # network and hub errors come from several libraries; the message is what matters
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ToolkitError(f"difficulty.model '{name}' is not in the local Hugging Face cache and the hub cannot "
                           f"provide it ({reason}): download it first, or give a local folder.") from None


def _tokenizer_difference(ours: Any, theirs: Any) -> str:
    """What differs between two tokenizers, in a few words."""
    said = []
    if ours.get_vocab() != theirs.get_vocab():
        said.append(f"vocabulary ({len(ours)} vs {len(theirs)} tokens)")
    if {str(t) for t in ours.added_tokens_decoder.values()} != {str(t) for t in theirs.added_tokens_decoder.values()}:
        said.append("added tokens")
    if ours.special_tokens_map != theirs.special_tokens_map:
        said.append("special tokens")
    if ours.chat_template != theirs.chat_template:
        said.append("chat template (set data.chat_template to render both alike)")
    return ", ".join(said) or "tokenizer settings (normaliser, pre-tokeniser or flags)"


def check_scorers(recipe: Recipe, resolved: list[ResolvedStage], tokenizer: Any, *, vision: bool) -> None:
    """Refuse, in one line and before the policy loads, a stage's separate scorer that cannot score the run's rows:
    not found, a config that does not read, a vision-language run (a scorer scores text rows), or a tokenizer
    other than the run's."""
    from transformers import AutoConfig

    ours = None
    for stage in resolved:
        name = separate_scorer(stage)
        if name is None:
            continue
        where = f"stage '{stage.name}': difficulty.model '{name}'"
        if vision:
            raise ToolkitError(f"{where}: a separate scorer scores text rows, and this run's model is "
                               "vision-language; use base or current.")
        path = resolve_scorer(name, recipe.output_dir)
        assert stage.difficulty is not None
        trust = stage.difficulty.trust_remote_code  # the scorer's own consent, never the policy's
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        except Exception as e:  # a broken or foreign config: transformers raises several kinds
            if "trust_remote_code" in str(e):
                raise ToolkitError(f"{where} needs its own Python code (auto_map in its config.json) and has not "
                                   "been allowed to run it: read that code, then set difficulty.trust_remote_code: "
                                   f"true on stage '{stage.name}' (model.trust_remote_code covers the run's own "
                                   "model only).") from None
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ToolkitError(f"{where}: its config cannot be read ({reason}).") from None
        if trust and getattr(config, "auto_map", None):
            log.warning("%s: difficulty.trust_remote_code is on: Python code from %s runs in this process (%s).",
                        where, path, ", ".join(sorted(config.auto_map)))
        _check_weights_load(path, where)
        try:
            theirs = load_tokenizer(str(path), trust_remote_code=trust, chat_template=recipe.data.chat_template)
        except Exception as e:
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ToolkitError(f"{where}: its tokenizer cannot be loaded ({reason}); a scorer needs the run's "
                               "tokenizer saved beside it.") from None
        ours = ours or tokenizer_fingerprint(tokenizer)
        if tokenizer_fingerprint(theirs) != ours:
            raise ToolkitError(f"{where} has another tokenizer than the run's model ({recipe.model.name_or_path}): "
                               f"its {_tokenizer_difference(tokenizer, theirs)} differ; a scorer must share the "
                               "run's tokenizer (a smaller model of the same family), or use base.")
        log.info("%s: a separate scorer (%s), the run's tokenizer", where, path)


def _check_weights_load(path: Path, where: str) -> None:
    """Refuse, before the policy loads, a scorer whose only weights are pickled `.bin` files that do not load
    weights-only (as transformers loads them): they would fail only after the policy loaded, with torch's advice
    to allow code execution. Read memory-mapped: the tensors' data are not read."""
    if any(p.suffix == ".safetensors" for p in path.iterdir()):
        return  # transformers loads these, never the .bin
    for file in sorted(p for p in path.iterdir() if p.suffix == ".bin" and p.is_file()):
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # UnpicklingError, or a file that is no torch archive at all
            said = " ".join(str(e).split())
            reason = said.split("WeightsUnpickler error:")[-1].strip().split(". Check the")[0][:160] or \
                type(e).__name__
            raise ToolkitError(f"{where}: its weights file {file.name} is a pickle that does not load as plain "
                               f"tensors ({reason}); loading it would run code from it. Save the scorer as "
                               "safetensors (save_pretrained(..., safe_serialization=True)).") from None


_HASHED: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    """sha256 of a file, streamed; kept per (path, size, mtime) for this process (two stages, two launches)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHED:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _HASHED[key] = digest.hexdigest()
    return _HASHED[key]


def weights_identity(path: Path, recipe: Recipe) -> dict[str, Any]:
    """What decides a separate scorer's scores: the sha256 of each of its weights files and of its config, and the
    dtype it runs in (the run's)."""
    weights = {p.name: _file_sha256(p) for p in sorted(path.iterdir())
               if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)}
    if not weights:
        raise ToolkitError(f"difficulty.model '{path}' has no weights files (*.safetensors or *.bin).")
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    dtype = str(resolve_dtype(recipe.model.dtype, lora=recipe.lora.enabled)).removeprefix("torch.")
    return {"scorer": {"weights": weights, "config": config, "dtype": dtype}}  # the dtype load_scorer runs it in


@contextlib.contextmanager
def _whole_on_every_process() -> Iterator[None]:
    """`from_pretrained` of a whole model on this process: neither partitioned by ZeRO-3's `zero.Init` nor left
    empty on the ranks other than 0 by FSDP's rank-0-only loading (fsdp_cpu_ram_efficient_loading)."""
    saved = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    try:
        with without_zero3_init():
            yield
    finally:
        if saved is None:
            os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
        else:
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = saved


def load_scorer(path: Path, recipe: Recipe, device: torch.device, attn_implementation: str, *,
                trust_remote_code: bool) -> torch.nn.Module:
    """The scorer at `path`, whole on this process's `device` in the run's dtype, in eval mode, with the run's loss
    head; its own code runs only with `trust_remote_code`, its stage's difficulty.trust_remote_code. The caller
    drops its reference and calls `free_memory` when the pass ends."""
    dtype = resolve_dtype(recipe.model.dtype, lora=recipe.lora.enabled)
    with _whole_on_every_process():
        model: Any = load_model(str(path), dtype=dtype, attn_implementation=attn_implementation,
                                trust_remote_code=trust_remote_code)
    model.requires_grad_(False)
    model.to(device).eval()
    install_loss_head(model, recipe.model.loss_head, recipe.model.loss_chunk_size)
    if recipe.data.packing:
        check_packing_support(model)
    params = sum(p.numel() for p in model.parameters())
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info("scorer %s: %.1fM parameters, %.2f GiB in %s, loaded whole on each process for its scoring pass "
             "(freed after it)", path, params / 1e6, size / 2**30, str(dtype).removeprefix("torch."))
    return model


def free_memory(device: torch.device) -> None:
    """After a scorer's last reference is dropped: its memory back (host, and the CUDA cache on a GPU)."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
