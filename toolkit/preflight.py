"""`toolkit preflight`: will this recipe fit, with which strategy, and what does its data look like?

Builds the model skeleton on the meta device from its config (shipped configs of the flagship models, a local
directory, or the built-in tiny model: no weights are read or downloaded), estimates per-GPU memory for every
strategy (toolkit.memory), marks the one the accelerate config selects, recommends the cheapest that fits,
and scans each stage's data: rows, token-length percentiles, rows over max_seq_len and rows without loss.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from toolkit.config import TINY_MODEL, TINY_QWEN3_VL_MODEL, TINY_VL_MODEL, Recipe
from toolkit.data import encode_row, iter_jsonl, resolve_data_paths
from toolkit.labels import IGNORE_INDEX
from toolkit.memory import estimate_all, format_table, load_model_config
from toolkit.run_dir import RunLayout
from toolkit.strategies import strategy_of_config


def _model_config(name_or_path: str) -> Any:
    if name_or_path in (TINY_MODEL, TINY_VL_MODEL, TINY_QWEN3_VL_MODEL):
        from toolkit.model import materialize_builtin

        with tempfile.TemporaryDirectory() as tmp:
            return load_model_config(materialize_builtin(name_or_path, Path(tmp)))
    return load_model_config(name_or_path)


def scan_stage(files: list[Path], tokenizer: Any, *, max_seq_len: int, train_on: str,
               thinking: str = "auto") -> dict[str, Any]:
    """Length statistics of a stage's rows, before any over-length policy."""
    lengths, no_loss = [], 0
    for path in files:
        for lineno, row in iter_jsonl(path):
            ids, labels = encode_row(row, tokenizer, train_on, f"{path}:{lineno}", thinking)
            lengths.append(len(ids))
            no_loss += all(label == IGNORE_INDEX for label in labels)
    arr = np.array(lengths or [0])
    return {"rows": len(lengths), "p50": int(np.percentile(arr, 50)), "p90": int(np.percentile(arr, 90)),
            "p99": int(np.percentile(arr, 99)), "max": int(arr.max()),
            "over_max_seq_len": int((arr > max_seq_len).sum()), "no_trainable_tokens": no_loss}


def preflight(recipe: Recipe, accelerate_config: Path, *, num_gpus: int | None, gpu_memory_gb: float,
              scan_data: bool = True) -> str:
    """The preflight report as text."""
    chosen, procs = strategy_of_config(accelerate_config)
    gpus = num_gpus or procs
    config = _model_config(recipe.model.name_or_path)
    mixed = yaml.safe_load(accelerate_config.read_text()).get("mixed_precision", "no")
    lora = recipe.lora.enabled
    # LoRA keeps the frozen base in 16-bit; full fine-tuning keeps fp32 weights (mixed precision computes in 16).
    param_bytes = 2 if (lora and mixed in ("bf16", "fp16")) or recipe.model.dtype in ("bfloat16", "float16") else 4
    rows = estimate_all(config, num_gpus=gpus, lora_r=recipe.lora.r if lora else None, param_bytes=param_bytes,
                        micro_batch=recipe.train.micro_batch_size, seq_len=recipe.data.max_seq_len,
                        grad_ckpt=recipe.model.gradient_checkpointing,
                        lora_targets=recipe.lora.target_modules, loss_head=recipe.model.loss_head,
                        loss_chunk_size=recipe.model.loss_chunk_size)
    lines = [f"model {recipe.model.name_or_path}: {'LoRA r=' + str(recipe.lora.r) if lora else 'full fine-tuning'}"
             f", {param_bytes * 8}-bit weights, micro batch {recipe.train.micro_batch_size} x "
             f"{recipe.data.max_seq_len} tokens, gradient checkpointing "
             f"{'on' if recipe.model.gradient_checkpointing else 'off'}, loss head {recipe.model.loss_head}, "
             f"{gpus} GPU(s) of {gpu_memory_gb:g} GiB",
             f"selected by {accelerate_config}: {chosen}", "",
             format_table(rows, gpu_memory_gb=gpu_memory_gb)]
    if scan_data and getattr(config, "vision_config", None) is not None:
        lines += ["", "data scan skipped: image-text rows are not scanned by preflight (training reports each "
                  "stage's kept, dropped and truncated rows at its start)."]
    elif scan_data:
        from toolkit.model import load_tokenizer, materialize_builtin

        with tempfile.TemporaryDirectory() as tmp:
            try:
                tokenizer = load_tokenizer(materialize_builtin(recipe.model.name_or_path, Path(tmp)),
                                           trust_remote_code=recipe.model.trust_remote_code,
                                           chat_template=recipe.data.chat_template, local_files_only=True)
            except OSError:  # preflight never downloads: a hub id must be in the local cache
                return "\n".join([*lines, "", f"data scan skipped: the tokenizer of {recipe.model.name_or_path} "
                                   "is not in the local Hugging Face cache (preflight does not download)."])
            lines += ["", "stage data (tokens per row):"]
            for stage in recipe.stages:
                files = resolve_data_paths(stage.paths, RunLayout(recipe.output_dir).dummy_data)
                if not all(f.is_file() for f in files):
                    lines.append(f"  {stage.name}: data not found ({', '.join(map(str, files))})")
                    continue
                st = scan_stage(files, tokenizer, max_seq_len=stage.max_seq_len or recipe.data.max_seq_len,
                                train_on=recipe.data.train_on, thinking=recipe.data.thinking)
                lines.append(f"  {stage.name}: {st['rows']} rows, p50 {st['p50']} p90 {st['p90']} p99 {st['p99']} "
                             f"max {st['max']}; {st['over_max_seq_len']} over max_seq_len, "
                             f"{st['no_trainable_tokens']} without trainable tokens")
    return "\n".join(lines)
