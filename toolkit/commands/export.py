"""`toolkit export`: turn a checkpoint (or a finished run) into a model anyone can load with from_pretrained.

LoRA runs export the PEFT adapter (loads with `PeftModel.from_pretrained`); `--merge` folds it into the base
weights and writes a plain safetensors model (loads with `AutoModelForCausalLM.from_pretrained`, or
`AutoModelForImageTextToText` for vision-language models, whose processor is exported too). Full
fine-tuning checkpoints are consolidated from whatever strategy wrote them (DeepSpeed ZeRO partitions, FSDP
shards). Tokenizer and a short model card with the curriculum summary are included.

A run that is still training can be exported: its checkpoint is read under a read lease (toolkit/checkpoint/lease.py)
that the run's rotation respects, and checked against what was committed (every file's size and sha256), so the
export is of one whole committed checkpoint. The base model is found from any working directory: a built-in one
(`builtin:tiny-qwen3`) in the run's own cache beside its output dir, as training built it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from toolkit.atomic import build_dir, not_ours, refuse_not_ours
from toolkit.builtin.models import materialize_builtin
from toolkit.checkpoint.final import FINAL_CHECKSUMS, verify_final
from toolkit.checkpoint.lease import ReadLease
from toolkit.checkpoint.manager import changed_files, read_meta
from toolkit.checkpoint.model_card import MODEL_CARD
from toolkit.checkpoint.portable import portable_lora_file
from toolkit.checkpoint.safe_load import verify_checkpoint_files, weights_only_loads
from toolkit.config.load import load_recipe
from toolkit.config.schema import Recipe
from toolkit.config.stages import resolve_stages
from toolkit.errors import ToolkitError
from toolkit.model.load import check_model_source, is_vision_language, load_processor, setup_lora
from toolkit.runtime.run_dir import COMMIT_MARKER, RunLayout, committed_checkpoints, is_within
from toolkit.strategies.consolidate import consolidate_full_weights


def _resolve(source: Path) -> tuple[Path, RunLayout]:
    """(checkpoint or final dir, the run's layout) for a checkpoint, an output dir, or its final/ dir."""
    if (source / COMMIT_MARKER).is_file():
        return source, RunLayout.of_checkpoint(source)
    parent = RunLayout(source.parent)
    if parent.final == source and parent.recipe.is_file():
        return source, parent
    run = RunLayout(source)
    if run.recipe.is_file():
        if run.final.is_dir():
            return run.final, run
        found = committed_checkpoints(run.checkpoints)
        if found:
            return found[-1], run
    raise ToolkitError(f"{source} is neither a committed checkpoint nor a run output dir with final/ or checkpoints/. "
                       "Pass <output_dir>, <output_dir>/checkpoints/step-N or <output_dir>/final.")


def _base_model(name: str, recorded: str, run: RunLayout) -> str:
    """The base model the run trained from. A built-in name (the recipe's `model.name_or_path`) is the folder
    training built in the run's own cache (built again if it was deleted), found from wherever the run folder is
    now; otherwise the path or hub id recorded with the checkpoint or adapter."""
    if name.startswith("builtin:"):
        return str(Path(materialize_builtin(name, run.cache)).resolve())
    try:
        check_model_source(recorded)
    except ToolkitError as e:
        raise ToolkitError(f"The base model of {run.root} cannot be loaded: {e} A relative path is read from the "
                           "folder export runs in: run it where the run was launched.") from None
    # A local folder is written into the export's adapter_config.json as an absolute path: usable from anywhere.
    return str(Path(recorded).resolve()) if Path(recorded).is_dir() else recorded


def _no_empty(path: Path) -> None:
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            empty = [k for k in f.keys() if f.get_slice(k).get_shape() in ([0], [])]  # noqa: SIM118
        if empty:
            raise ToolkitError(f"Export wrote empty tensors to {file}: {empty[:3]}")


def _model_card(run: RunLayout, meta: dict[str, Any] | None, merged: bool) -> str:
    info = json.loads(run.run_json.read_text()) if run.run_json.is_file() else {}
    recipe = yaml.safe_load(run.recipe.read_text())
    kind = "full fine-tuning"
    if recipe["lora"]["enabled"]:
        kind = "LoRA merged into the weights" if merged else "LoRA adapter"
    lines = [f"# {info.get('run_name', run.root.name)}", "",
             f"Fine-tuned from `{recipe['model']['name_or_path']}` with curriculum-toolkit ({kind}).",
             "", f"Strategy: {info.get('strategy', '?')} x {info.get('num_processes', '?')}, effective batch "
             f"{info.get('effective_batch', '?')}." + (f" Exported at step {meta['step']}." if meta else ""),
             "", "| stage | steps | samples | peak lr |", "|---|---|---|---|"]
    for st in info.get("stages", []):
        lines.append(f"| {st['name']} | {st['steps']} | {st['num_samples']} | {st['lr']:.3g} |")
    return "\n".join(lines) + "\n"


def _lora_from_portable_state(model: Any, recipe: Recipe, src: Path, run: Path) -> Any:
    """The run's LoRA model rebuilt as training built it (modules that stages' `trainable` patterns name are
    modules_to_save too) and filled from the checkpoint's portable state; every stored parameter must land."""
    lora, stages = recipe.lora, resolve_stages(recipe)
    model = setup_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules,
                       modules_to_save=lora.modules_to_save, exclude_modules=lora.exclude_modules,
                       stage_trainable=[s.trainable for s in stages], trainable_keys=[s.trainable_key for s in stages])
    state = portable_lora_file(src)
    if not state.is_file():
        raise ToolkitError(f"{src} has no portable LoRA state (checkpoint.portable was off); export "
                           f"{RunLayout(run).final} instead.")
    params = dict(model.named_parameters())
    with safe_open(str(state), framework="pt") as f, torch.no_grad():
        stored = [k.removeprefix("param/") for k in f.keys() if k.startswith("param/")]  # noqa: SIM118
        unplaced = [n for n in stored if n not in params]
        if unplaced:
            raise ToolkitError(f"{src}: trained parameters {unplaced[:3]} have no place in the rebuilt model: the "
                               "recipe.yaml next to the checkpoint does not match it.")
        for name in stored:
            params[name].copy_(f.get_tensor(f"param/{name}"))
    return model


EXPORT_MARKER = ".toolkit-export.json"
"""Written into every export: a folder holding it may be replaced by a later export to the same --out."""


def _check_replaceable(folder: Path, out: Path, *, overwrite: bool) -> None:
    """Refuse to replace `folder` (at --out, or just swapped out of it) unless it is empty, an earlier export
    (it holds EXPORT_MARKER) or --overwrite was given."""
    if not overwrite:
        refuse_not_ours(out, not_ours(folder, marker=EXPORT_MARKER), label="--out", what="an earlier export",
                        then="it would be replaced", fix="Choose a new folder, or pass --overwrite to replace it.")


def check_out(out: Path, src: Path, run: RunLayout, *, overwrite: bool) -> None:
    """Refuse an --out whose replacement would lose anything: the source or a folder holding it (never), or a
    non-empty folder that is not an earlier export (unless --overwrite). Folders are compared by identity, not
    spelling (`is_within`): a symlink or bind mount leading to the run is the run."""
    for protected in (src, run.root):
        if is_within(protected, out):
            raise ToolkitError(f"--out {out} contains what is being exported ({protected}): choose another folder.")
    if is_within(out, src):
        raise ToolkitError(f"--out {out} is inside what is being exported ({src}): choose another folder.")
    if out.exists() and not out.is_dir():
        raise ToolkitError(f"--out {out} is a file; name a folder.")
    if out.is_dir():
        _check_replaceable(out, out, overwrite=overwrite)


_READ_TRIES = 5
"""Times an export of a live run looks again for a checkpoint that rotation removed (or a re-save replaced)."""


def export(source: str | Path, out: str | Path, *, merge: bool = False, overwrite: bool = False,
           trust_remote_code: bool = False) -> Path:
    """Write an exported model to `out` (see module docstring). Returns `out`.

    `out` is written under a temporary name beside it and swapped in when complete (toolkit/atomic.py): on Linux
    filesystems with renameat2(RENAME_EXCHANGE) in one atomic step, so `out` holds the earlier export or the new
    one at every moment; elsewhere the earlier one is moved aside first, and a crash between the two renames leaves
    it beside `out` as `.<name>.old-*`. The folder swapped out is checked again (an earlier export, empty, or
    --overwrite) before it is deleted, else put back. A failure leaves `out` as it was and no temporary folder.
    """
    src, run = _resolve(Path(source).resolve())  # a symlink to a run's final/ is that run's final/
    out = Path(out)
    check_out(out, src, run, overwrite=overwrite)
    if not run.recipe.is_file():  # a checkpoint whose run folder lost it (load_recipe would advise --config)
        raise ToolkitError(f"{src} has no recipe beside it: export reads the run's {run.recipe} (written when the "
                           "run started) for its base model and settings. Put it back: the recipe the run trained "
                           "with, its command-line overrides applied.")
    typed = load_recipe(run.recipe)
    trust = typed.model.trust_remote_code
    if trust and not trust_remote_code:
        raise ToolkitError(f"The run's recipe sets model.trust_remote_code: exporting it runs Python code from "
                           f"{typed.model.name_or_path}. Pass --trust-remote-code to allow that.")
    if src != run.final:  # a checkpoint (even one that rotation removed since it was chosen)
        src, meta, base, vision, model = _read_checkpoint(src, run, typed, merge=merge,
                                                          from_run=src.resolve() != Path(source).resolve())
    else:  # final/: written once, at the end of the run
        meta = None
        verify_final(src)  # before anything reads it: a file cut short or corrupted is refused in one line
        recorded = (json.loads((src / "adapter_config.json").read_text())["base_model_name_or_path"]
                    if (src / "adapter_config.json").is_file() else typed.model.name_or_path)
        base = _base_model(typed.model.name_or_path, recorded, run)
        vision, model = _load_model(src, None, base, typed, run, merge=merge)

    tokenizer_src = str(run.final) if (run.final / "tokenizer_config.json").is_file() else base
    if src != run.final and tokenizer_src == str(run.final):
        verify_final(run.final, weights=False)  # its tokenizer goes into the export of a checkpoint

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        if vision:  # the processor (image processor + tokenizer + chat template) makes the export usable as it is
            load_processor(tokenizer_src, trust_remote_code=trust, chat_template=None).save_pretrained(tmp)
        else:
            AutoTokenizer.from_pretrained(tokenizer_src).save_pretrained(tmp)
        (tmp / "README.md").write_text(_model_card(run, meta, merge and typed.lora.enabled))
        _no_empty(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"source": str(src.resolve()), "merged": merge}))

    # Into the folder --out leads to: a symlink --out stays, and the earlier export it points at is replaced.
    build_dir(out.resolve(), write, check_replaced=lambda old: _check_replaceable(old, out, overwrite=overwrite))
    return out


def _open_regular(folder: Path, rel: str) -> Any:
    """`folder/rel` opened for reading without following a link at its last component (O_NOFOLLOW), and checked
    to be a regular file: what is hashed and sent is that file's own bytes, never a link's target."""
    import os
    import stat

    try:
        fd = os.open(folder / rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ToolkitError(f"{folder / rel} cannot be read for upload ({e.strerror}): it is a link, or gone. "
                           "Push uploads only the files training saved, never through a link.") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ToolkitError(f"{folder / rel} is not a regular file: push uploads only files.")
    return os.fdopen(fd, "rb")


def publishable_files(folder: Path, *, recorded: dict[str, Any] | None, extra: list[str]) -> list[str]:
    """The files of `folder` to publish, by path relative to it, after the rule of a run folder's record: exactly
    the files `recorded` (final/checksums.json's "files") names, the checksums file and the model card, plus the
    `extra` files the user named (--push-extra); `recorded` None: every file (an export this command just built).
    Anything else in the folder (a stray `.env`, an editor's `README.md~`) and any link, anywhere in it, is refused
    in one line naming it, before anything is sent. The walk never follows a link."""
    import os

    for name in extra:
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts:
            raise ToolkitError(f"--push-extra {name!r}: name a file inside {folder} by its path relative to it.")
    allowed = (None if recorded is None
               else set(recorded) | {FINAL_CHECKSUMS, MODEL_CARD} | {Path(n).as_posix() for n in extra})
    found: list[str] = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs) + sorted(files):
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                raise ToolkitError(f"{path} is a link (to {os.readlink(path)}): push never uploads through a link. "
                                   f"Remove it from {folder}, or put the file itself there.")
            if name in files and rel != EXPORT_MARKER:
                found.append(rel)
    if allowed is not None:
        stray = sorted(set(found) - allowed)
        if stray:
            raise ToolkitError(f"{folder / stray[0]} is not a file training saved (not in {FINAL_CHECKSUMS})"
                               + (f", nor are {len(stray) - 1} more: {stray[1:4]}" if len(stray) > 1 else "")
                               + f": push uploads only those and the model card. Remove it, or pass --push-extra "
                               f"{stray[0]} to publish it too.")
        missing = sorted(allowed - set(found) - {MODEL_CARD})
        if missing:
            raise ToolkitError(f"{folder / missing[0]} is missing: " + ("it was named by --push-extra."
                               if missing[0] not in recorded and missing[0] != FINAL_CHECKSUMS else
                               f"{FINAL_CHECKSUMS} records it. Restore it, or export a checkpoint of the run."))
    return sorted(found)


def _commit_operations(folder: Path, files: list[str], recorded: dict[str, Any] | None) -> list[Any]:
    """One upload per file, each from its own file opened without following links; a file `recorded` names is
    checked against its size and sha256 as the uploader itself hashed it (the digest of the bytes it sends)."""
    from huggingface_hub import CommitOperationAdd

    ops = []
    for rel in files:
        op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=_open_regular(folder, rel))
        want = (recorded or {}).get(rel)
        if want is not None and (op.upload_info.size != want["bytes"]
                                 or op.upload_info.sha256.hex() != want["sha256"]):
            raise ToolkitError(f"{folder} does not hold what training saved: {rel} is not the file recorded in "
                               f"{FINAL_CHECKSUMS} (size or sha256 differs). Export a checkpoint of the run instead "
                               "(toolkit export <output_dir>/checkpoints/step-N), or restore the original files.")
        ops.append(op)
    return ops


def _recorded(final: Path) -> dict[str, Any]:
    """final/checksums.json's record of the files training saved ({path: {bytes, sha256}}), or one line saying why
    it is no record."""
    path = final / FINAL_CHECKSUMS
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["files"]
        if not isinstance(recorded, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                and isinstance(k, str) and k and ".." not in Path(k).parts and not Path(k).is_absolute()
                for k, v in recorded.items()):
            raise TypeError("files is not a record of relative paths with bytes and sha256")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ToolkitError(f"{path} cannot be read ({type(e).__name__}: {e}): {final} cannot be verified, so "
                           "nothing is pushed. Export a checkpoint of the run and push that, or restore the "
                           "original files.") from None
    return recorded


def push_to_hub(source: str | Path, repo_id: str, *, out: str | Path | None = None, merge: bool = False,
                private: bool = False, overwrite: bool = False, trust_remote_code: bool = False,
                extra: list[str] | None = None) -> str:
    """Upload a run's model to the Hugging Face Hub repo `repo_id` (created if missing, `private` if new) through
    huggingface_hub (create_repo + create_commit; its login: `hf auth login` or HF_TOKEN, its HF_ENDPOINT).

    A run's final/ is published through its own record: exactly the files final/checksums.json records, each
    verified against its size and sha256, plus checksums.json and the model card, and the `extra` files the user
    named (--push-extra). Anything else there and any link is refused in one line before anything is sent
    (publishable_files). With --merge, a checkpoint as the source, or `out`, the export is written first (to `out`,
    else a temporary folder) and its files are uploaded, all but its export marker. Returns the commit's URL."""
    import tempfile

    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    src, run = _resolve(Path(source).resolve())
    extra = list(extra or [])
    with tempfile.TemporaryDirectory(prefix="toolkit-push-") as scratch:
        if src == run.final and not merge and out is None:
            if src.is_symlink():
                raise ToolkitError(f"{src} is a link (to {src.readlink()}): push never uploads through a link. "
                                   "Push the run whose final/ it is.")
            if not (src / FINAL_CHECKSUMS).is_file() or (src / FINAL_CHECKSUMS).is_symlink():
                raise ToolkitError(f"{src} has no {FINAL_CHECKSUMS} (written by an earlier version, or removed): "
                                   "push publishes only what it records. Export it first (toolkit export "
                                   f"{run.root} --out DIR), then push that: --out DIR --push-to-hub {repo_id}.")
            recorded = _recorded(src)
            folder = src
        else:
            if extra:
                raise ToolkitError("--push-extra adds files of a run's final/ to its upload; an export (--merge, "
                                   "--out, a checkpoint) uploads what it wrote. Copy the file into --out instead.")
            recorded = None
            folder = export(source, Path(out) if out is not None else Path(scratch) / "export", merge=merge,
                            overwrite=overwrite, trust_remote_code=trust_remote_code)
        files = publishable_files(folder, recorded=recorded, extra=extra)
        ops = _commit_operations(folder, files, recorded)
        api = HfApi()
        try:
            api.create_repo(repo_id, private=private or None, exist_ok=True)  # not --private: the Hub's default
            commit = api.create_commit(repo_id=repo_id, operations=ops,
                                       commit_message=f"Upload {run.root.name} ({'merged' if merge else src.name})")
        except (HfHubHTTPError, OSError, ValueError) as e:
            raise ToolkitError(f"Uploading {folder} to {repo_id} on {api.endpoint} failed: "
                               f"{' '.join(str(e).split())[:300]} (log in with `hf auth login` or set HF_TOKEN; a "
                               "repo id is <user or organization>/<name>).") from None
        finally:
            for op in ops:
                op.path_or_fileobj.close()
    return commit.commit_url


def _read_checkpoint(chosen: Path, run: RunLayout, typed: Recipe, *, merge: bool, from_run: bool
                     ) -> tuple[Path, dict[str, Any], str, bool, Any]:
    """(checkpoint, its meta, base model, vision, the model to export) read from one whole committed checkpoint.

    The checkpoint is read under a read lease, so a live run's rotation leaves it in place until the export has
    read it; its files are checked against the sizes and sha256 committed with it. Should it be gone before the
    lease is held (rotated away), an export of a run folder takes the run's newest checkpoint instead; should it
    change while being read (the same step saved again, or rotated on a filesystem that cannot lock folders), it is
    read again."""
    for _ in range(_READ_TRIES):
        lease = ReadLease.acquire(chosen)
        if lease is None or not (chosen / COMMIT_MARKER).is_file():
            if lease is not None:
                lease.release()
            if not from_run:
                raise ToolkitError(f"{chosen} was deleted (its run's checkpoint rotation keeps the last "
                                   f"checkpoint.keep_last) before it could be read. Export {run.root} for its newest "
                                   "checkpoint, or name a later one.")
            found = committed_checkpoints(run.checkpoints)
            if not found:
                raise ToolkitError(f"{run.root} has no committed checkpoint left to export.")
            chosen = found[-1]
            continue
        with lease:
            try:
                meta = read_meta(chosen)
                problem = changed_files(chosen, meta)
                if problem is not None:
                    raise ToolkitError(f"Checkpoint {chosen} does not hold what was committed: {problem}. Export "
                                       "another checkpoint, or restore the original files.")
                verify_checkpoint_files(chosen)
                base = _base_model(typed.model.name_or_path, meta["base_model"], run)
                with weights_only_loads(chosen):  # a file swapped after the check cannot run code
                    vision, model = _load_model(chosen, meta, base, typed, run, merge=merge)
            except (ToolkitError, OSError):
                if lease.still_held():
                    raise
                continue  # the folder went or changed while it was read: look again
            if lease.still_held():
                return chosen, meta, base, vision, model
    raise ToolkitError(f"Could not read a checkpoint of {run.root} whole in {_READ_TRIES} tries: the run replaced "
                       "each one while it was read. Export a checkpoint folder of a finished run, or try again.")


def _load_model(src: Path, meta: dict[str, Any] | None, base: str, typed: Recipe, run: RunLayout, *,
                merge: bool) -> tuple[bool, Any]:
    """(vision, model): the base model with the run's training in it, from a checkpoint (`meta`) or final/."""
    trust = typed.model.trust_remote_code
    vision = is_vision_language(base, trust_remote_code=trust)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(base, dtype=torch.float32, trust_remote_code=trust)
    if typed.lora.enabled:
        if meta is None:
            model = PeftModel.from_pretrained(model, src)
            for config in model.peft_config.values():  # final/ recorded the base as training's folder named it
                config.base_model_name_or_path = base
        else:
            model = _lora_from_portable_state(model, typed, src, run.root)
        if merge:
            model = model.merge_and_unload()
    elif meta is not None:
        weights = consolidate_full_weights(src, meta["strategy"])
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if [k for k in missing if "lm_head" not in k or not model.config.tie_word_embeddings] or unexpected:
            raise ToolkitError(f"{src}: consolidated weights do not match {base} (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}).")
    return vision, model
