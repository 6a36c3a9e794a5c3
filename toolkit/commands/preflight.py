"""`toolkit preflight`: will this recipe fit, with which strategy, and what does its data look like?

Builds the model skeleton on the meta device from its config (shipped configs of the flagship models, a local
directory, or the built-in tiny model: no weights are read or downloaded), estimates per-GPU memory for every
strategy (toolkit.model.memory) and every stage (each with its own micro batch x max_seq_len tokens: a packed row is
max_seq_len tokens, and without packing max_seq_len is the worst case), reports each stage's peak and the table of
the worst stage, marks the strategy the accelerate config selects, recommends the cheapest that fits, and scans
each stage's data: rows, token-length percentiles, rows over max_seq_len and rows without loss.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from toolkit.builtin.models import TINY_MODEL, TINY_QWEN3_VL_MODEL, TINY_VL_MODEL
from toolkit.config.schema import MODEL_MEASURES, SCORERS, DataConfig, Recipe
from toolkit.config.stages import ResolvedStage, resolve_stages
from toolkit.data.sources import resolve_data_paths
from toolkit.model.fused_layers import resolve_fused_layers
from toolkit.model.memory import GIB, estimate_all, format_table, kv_cache_bytes, load_model_config
from toolkit.runtime.run_dir import RunLayout
from toolkit.strategies import strategy_of_config


def _model_config(name_or_path: str) -> Any:
    if name_or_path in (TINY_MODEL, TINY_VL_MODEL, TINY_QWEN3_VL_MODEL):
        return copy.deepcopy(_builtin_config(name_or_path))
    return load_model_config(name_or_path)


@functools.lru_cache(maxsize=4)
def _builtin_config(name_or_path: str) -> Any:
    """A built-in tiny model's config, built once per process (a build writes its weights: seconds)."""
    from toolkit.builtin.models import materialize_builtin

    with tempfile.TemporaryDirectory() as tmp:
        return load_model_config(materialize_builtin(name_or_path, Path(tmp)))


def scan_stage(entries: list[Any], tokenizer: Any, dummy_dir: Path, *, max_seq_len: int, train_on: str,
               thinking: str = "auto", chat_template: str | None = None, pairs: bool = False,
               kto: bool = False) -> dict[str, Any]:
    """Length statistics of a stage's rows, before any over-length policy (tokenised in memory, on every core).
    `chat_template`: the recipe's data.chat_template that `tokenizer` carries (named by refusals). `pairs`: a
    preference stage's, whose rows are pairs: each side is a sequence (counted as rows here), and `pairs` counts
    them. `kto`: a kto stage's, whose rows carry a true/false label (each row counted once; its KL side, another
    row's completion after its prompt, is about as long)."""
    from toolkit.data.encoding import TextEncoder
    from toolkit.data.sources import resolve_source
    from toolkit.data.stages import num_proc
    from toolkit.data.store import open_store

    encoder = TextEncoder(tokenizer, train_on=train_on, thinking=thinking, chat_template=chat_template, pairs=pairs,
                          kto=kto)
    processes = num_proc(DataConfig())
    stores = [open_store(resolve_source(e, dummy_dir), encoder, None, num_proc=processes, max_tokens=max_seq_len)
              for e in entries]  # the size guard: a row far over max_seq_len is counted over it, not tokenised whole
    arr = np.concatenate([s.lengths for s in stores] + [np.zeros(0, np.int64)])
    no_loss = int(sum((s.label_tokens == 0).sum() for s in stores))
    rows = len(arr)
    arr = arr if rows else np.zeros(1, np.int64)
    tokens = int(np.minimum(arr, max_seq_len).sum()) if rows else 0
    return {"rows": rows, "tokens": tokens, "p50": int(np.percentile(arr, 50)), "p90": int(np.percentile(arr, 90)),
            "p99": int(np.percentile(arr, 99)), "max": int(arr.max()),
            "over_max_seq_len": int((arr > max_seq_len).sum()), "no_trainable_tokens": no_loss,
            **({"pairs": rows // 2} if pairs else {})}


def weight_bytes(recipe: Recipe, mixed_precision: str) -> int:
    """Bytes of a weight as held in training: LoRA keeps the frozen base in 16-bit; full fine-tuning keeps fp32
    weights (mixed precision computes in 16)."""
    lora = recipe.lora.enabled
    return 2 if (lora and mixed_precision in ("bf16", "fp16")) or recipe.model.dtype in ("bfloat16", "float16") else 4


def activation_precision(recipe: Recipe, mixed_precision: str) -> dict[str, Any]:
    """How activations are held: `activation_bytes` (2 under autocast or with 16-bit weights), `residual_bytes`
    (the hidden states between layers: the weights' dtype) and `adapter_input_copies` (fp32 LoRA adapters on a
    16-bit base without autocast: PEFT's per-layer fp32 input copies, which training turns off under autocast)."""
    autocast = mixed_precision in ("bf16", "fp16")
    param_bytes = weight_bytes(recipe, mixed_precision)
    return {"activation_bytes": 2 if autocast or param_bytes == 2 else 4, "residual_bytes": param_bytes,
            "adapter_input_copies": recipe.lora.enabled and param_bytes == 2 and not autocast}


def fused_layers_counted(recipe: Recipe, config: Any) -> str:
    """The fused layers the estimate counts: `auto` as training on this machine would resolve it; `liger` wherever
    preflight runs (it may estimate a GPU job from a machine without one)."""
    if recipe.model.fused_layers == "liger":
        return "liger"
    return resolve_fused_layers(recipe.model.fused_layers, str(config.model_type)).runs


def stage_estimates(recipe: Recipe, config: Any, stages: list[ResolvedStage], *, num_gpus: int, param_bytes: int,
                    activation_bytes: int = 2, residual_bytes: int | None = None,
                    adapter_input_copies: bool = False, fused_layers: bool = False, sp_size: int = 1,
                    grad_ckpt: bool | int | None = None) -> list[dict[str, dict[str, int]]]:
    """Per stage, `estimate_all`'s rows (strategy -> bytes) for one micro-batch of that stage: its own
    micro_batch_size x max_seq_len tokens (with packing a packed row is max_seq_len tokens; without, max_seq_len
    is the longest row the stage keeps, so the estimate is its worst case); a preference stage's micro-batch of
    pairs is twice as many sequences (each pair's chosen and rejected sides). `fused_layers`: Liger's layers counted
    (`fused_layers_counted`). `sp_size`: Ulysses sequence parallelism (each GPU holds its slice's activations);
    `grad_ckpt`: checkpointed layers other than the recipe's (preflight's proposal)."""
    lora = recipe.lora.enabled
    return [estimate_all(config, num_gpus=num_gpus, lora_r=recipe.lora.r if lora else None, param_bytes=param_bytes,
                         micro_batch=stage.micro_batch_size * (2 if stage.pairs or stage.kto else 1),
                         seq_len=stage.max_seq_len,
                         grad_ckpt=recipe.model.gradient_checkpointing if grad_ckpt is None else grad_ckpt,
                         lora_targets=recipe.lora.target_modules, sp_size=sp_size,
                         loss_head=recipe.model.loss_head, loss_chunk_size=recipe.model.loss_chunk_size,
                         activation_bytes=activation_bytes, residual_bytes=residual_bytes,
                         adapter_input_copies=adapter_input_copies, fused_layers=fused_layers)
            for stage in stages]


ESTIMATED_AS = {"fsdp2": ("fsdp", ""),
                "zero0": ("ddp", " (estimated as DDP)"),
                "zero1": ("ddp", " (ZeRO-1 estimated as DDP: an upper bound)")}
"""Launch names (toolkit.strategies) the memory table has no row of its own for: the row that stands for them."""


def table_row(strategy: str, rows: dict[str, dict[str, int]]) -> tuple[str, str]:
    """(memory-table row, note for the report) of the strategy a launch selects."""
    row, note = ESTIMATED_AS.get(strategy, (strategy, ""))
    if row not in rows:  # e.g. `single` with --num-gpus > 1
        row, note = next(iter(rows)), f" ({strategy} has no row for this GPU count: shown as {next(iter(rows))})"
    return row, note


def worst_stage(estimates: list[dict[str, dict[str, int]]]) -> int:
    """Index of the stage with the largest activations (the persistent state is the same in every stage)."""
    return max(range(len(estimates)), key=lambda i: next(iter(estimates[i].values()))["activations"])


def checkpointing_proposal(recipe: Recipe, config: Any, stages: list[ResolvedStage], strategy: str, *, gpus: int,
                           param_bytes: int, fused_layers: bool, sp_size: int, gpu_memory_gb: float,
                           precision: dict[str, Any], usable_fraction: float = 0.9) -> str:
    """The fewest checkpointed decoder layers with which every stage fits under `strategy`: each layer left out of
    checkpointing is a forward pass saved in backward (spare memory buys speed). `model.gradient_checkpointing: N`."""
    layers = int(config.get_text_config().num_hidden_layers)
    budget = gpu_memory_gb * GIB * usable_fraction

    def fits(n: int) -> bool:
        rows = stage_estimates(recipe, config, stages, num_gpus=gpus, param_bytes=param_bytes,
                               fused_layers=fused_layers, sp_size=sp_size, grad_ckpt=n if n < layers else True,
                               **precision)
        return all(r[strategy]["total"] <= budget for r in rows)

    fewest = next((n for n in range(layers + 1) if fits(n)), None)  # fits(n) grows with n: the first is the fewest
    if fewest is None:
        return (f"gradient checkpointing: even all {layers} decoder layers checkpointed do not fit under {strategy}; "
                "see the table below")
    value = "false" if fewest == 0 else ("true" if fewest == layers else str(fewest))
    return (f"gradient checkpointing: the fewest decoder layers that fit under {strategy}: {fewest} of {layers} "
            f"(model.gradient_checkpointing: {value})")


def scoring_passes(stages: list[Any]) -> list[str]:
    """What the scoring passes of the stages a model orders cost (difficulty by loss | perplexity | ifd): one
    no-grad forward over the stage's rows (ifd: two, the responses alone too), a forward being about 1/3 of a
    training step's compute per token (2 of 6 x parameters FLOPs); memory under the stage's training peak."""
    lines = []
    for stage in stages:
        how = stage.difficulty
        if how is None or how.by not in MODEL_MEASURES:
            continue
        when = "at the stage's first step" if how.model == "current" else "before the first step"
        passes = "two no-grad forwards (the rows, then their responses alone)" if how.by == "ifd" else \
            "one no-grad forward"
        if how.model in SCORERS:
            lines.append(f"  {stage.name}: {how.by} of the {how.model} model, {when}: {passes} over its rows, each "
                         "about 1/3 of an epoch's training compute; peak memory below the stage's training peak "
                         "above (no gradients, no optimizer step, the loss head's chunks)")
        else:
            lines.append(f"  {stage.name}: {how.by} of the scorer {how.model}, {when}: {passes} of the scorer over "
                         "its rows; the scorer loaded whole on each process (its weights in the run's dtype, beside "
                         "the policy's) for the pass, then freed")
    for stage in stages:
        if stage.objective == "dpo":
            scorer = ("the model with its adapter off" if stage.preference is not None
                      and stage.preference.reference == "base" else "the policy as it enters the stage")
            lines.append(f"  {stage.name}: dpo reference of {scorer}, at the stage's first step: one no-grad forward "
                         "over both sides of its train and eval pairs, about 1/3 of an epoch's training compute; "
                         "16 bytes per pair kept in <output_dir>/scores/ (float64 chosen and rejected log-probs)")
        if stage.objective == "kto":
            scorer = ("the model with its adapter off" if stage.preference is not None
                      and stage.preference.reference == "base" else "the policy as it enters the stage")
            lines.append(f"  {stage.name}: kto reference of {scorer}, at the stage's first step: one no-grad forward "
                         "over each train row and its KL side; each step then runs one more no-grad forward of its "
                         "rows and KL sides (the KL baseline); 16 bytes per row kept in <output_dir>/scores/")
    return ["scoring passes (difficulty by a model's score, a dpo stage's reference; toolkit/evals/scoring.py):",
            *lines] if lines else []


def rollout_lines(stages: list[ResolvedStage], config: Any, *, dtype_bytes: int) -> list[str]:
    """The KV cache of each grpo stage's largest `generate` call (toolkit/evals/rollout.py), per GPU: a step's
    rollout generates one prompt's rl.num_generations completions a call, the pass-rate pass (difficulty by
    pass_rate) PASS_RATE_BLOCK prompts x its samples; each row is at most the stage's max_seq_len (a prompt that
    leaves no room for max_completion_length is dropped). It lives between training steps, when no activations do,
    beside the weights (whole on every GPU under ZeRO-3 and FSDP2 while generating): not in the training peak."""
    from toolkit.train.rl_stage import PASS_RATE_BLOCK

    c = config.get_text_config()
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    lines = []
    for stage in stages:
        if stage.objective != "grpo" or stage.rl is None:
            continue
        calls = [(stage.rl.num_generations, f"a step's rollout: 1 prompt x rl.num_generations "
                                            f"{stage.rl.num_generations}")]
        if stage.difficulty is not None and stage.difficulty.by == "pass_rate":
            k = stage.difficulty.samples or stage.rl.num_generations
            calls.append((PASS_RATE_BLOCK * k, f"its pass-rate pass: {PASS_RATE_BLOCK} prompts x {k} samples"))
        for sequences, what in calls:
            size = kv_cache_bytes(config, sequences=sequences, tokens=stage.max_seq_len, dtype_bytes=dtype_bytes)
            lines.append(f"  {stage.name}: {what} = {sequences} sequences x {stage.max_seq_len} tokens x "
                         f"{c.num_hidden_layers} layers x 2 (k, v) x {kv_heads} kv heads x {head_dim} x "
                         f"{dtype_bytes} bytes: {size / GIB:.2f} GiB")
    return ["generation KV cache per GPU (grpo stages; the largest generate call, between training steps, beside "
            "the weights, gathered whole under ZeRO-3 and FSDP2; not in the training peak above):",
            *lines] if lines else []


PIXEL_BYTES = 4
"""Bytes of a pixel value as the processor hands it over (fp32 `pixel_values_videos`)."""


def _size(n: int) -> str:
    return f"{n / 1024 ** 2:.2f} MiB" if n >= 1024 ** 2 else f"{n / 1024:.1f} KiB"


def vision_stage_lines(recipe: Recipe, stages: list[ResolvedStage], config: Any, *, activation_bytes: int
                       ) -> list[str]:
    """A vision-language recipe's stages as training reads them (`load_stage` over the stores training opens: the
    processor's own token counts, every video sampled once into the run's data.cache_dir, as `toolkit inspect-data`
    does, so the launch that follows decodes nothing), each with its video tokens and its largest video row: frames,
    video tokens, and the memory its videos imply beside the decoder's activations above (which its tokens, within
    max_seq_len, are part of): their pixel values (patches x channels x temporal patch x patch^2, fp32) and the
    vision tower's hidden states (patches x the tower's hidden size, one block's; a tower that trains keeps one per
    block). A frame budget a stage's max_seq_len cannot hold is refused here, as training refuses it before step 1.
    Nothing is downloaded: a hub model's processor must be in the local cache."""
    from toolkit.builtin.models import materialize_builtin
    from toolkit.data.stages import load_stage, run_stores, stage_summary, tokenized_cache_dir
    from toolkit.model.load import load_processor

    layout = RunLayout(recipe.output_dir)
    found = {}
    for stage in stages:
        files = resolve_data_paths([e.path for e in stage.entries if e.path is not None], layout.dummy_data)
        found[stage.name] = "prompts not scanned" if stage.prompts else None if all(
            f.exists() or not f.suffix for f in files) else f"data not found ({', '.join(map(str, files))})"
    lines = ["stage data (the rows training reads; videos: the largest video row's frames, tokens and memory):"]
    if all(found.values()):  # nothing to read: nothing built or written
        return [*lines, *(f"  {name}: {why}" for name, why in found.items())]
    try:  # a built-in model is built where training builds it (the cache beside the output dir), once
        processor = load_processor(materialize_builtin(recipe.model.name_or_path, layout.cache),
                                   trust_remote_code=recipe.model.trust_remote_code,
                                   chat_template=recipe.data.chat_template, local_files_only=True)
    except OSError:
        return [f"data scan skipped: the processor of {recipe.model.name_or_path} is not in the local Hugging "
                "Face cache (preflight does not download)."]
    stores = run_stores(stages, recipe.data, processor.tokenizer, processor, layout.dummy_data,
                        tokenized_cache_dir(recipe.data.cache_dir, recipe.output_dir))
    ip, vision = processor.image_processor, config.vision_config
    patch_values = 3 * ip.temporal_patch_size * ip.patch_size ** 2
    hidden = int(getattr(vision, "hidden_size", 0) or getattr(vision, "embed_dim", 0))
    depth = int(getattr(vision, "depth", 0) or getattr(vision, "num_hidden_layers", 0))
    for stage in stages:
        if found[stage.name]:
            lines.append(f"  {stage.name}: {found[stage.name]}")
            continue
        src = load_stage(stage, recipe.data, stores)
        lines.append(f"  {stage_summary(stage, src, recipe.data)}")
        candidates = []  # per source holding videos: (video tokens, store, row) of its largest kept row
        for part in src.samples.parts:
            rows = part.selection.index * (2 if stage.pairs else 1)  # a pair's prompt media: its chosen row's
            if part.store.videos and len(rows):
                row = int(rows[np.argmax(part.store.video_counts()[0][rows])])
                candidates.append((int(part.store.video_counts()[0][row]), part.store, row))
        if not candidates:
            continue
        tokens, store, row = max(candidates, key=lambda c: c[0])
        patches = sum(t * h * w for t, h, w in store.video_grids(row))
        lines.append(f"  {stage.name}: largest video row {store.where(row)}: {store.video_counts()[1][row]} "
                     f"frames, {tokens} video tokens of its {store.lengths[row]} (max_seq_len "
                     f"{stage.max_seq_len}); {patches} patches: pixel values "
                     f"{_size(patches * patch_values * PIXEL_BYTES)}, vision tower hidden states "
                     f"{_size(patches * hidden * activation_bytes)} a block ({depth} blocks)")
    return lines


def preflight(recipe: Recipe, accelerate_config: Path, *, num_gpus: int | None, gpu_memory_gb: float,
              scan_data: bool = True) -> str:
    """The preflight report as text."""
    chosen, procs = strategy_of_config(accelerate_config)
    chosen, _, sp = chosen.partition("_sp")  # Ulysses: the strategy's row, with each GPU's slice of the tokens
    sp_size = int(sp or 1)
    gpus = num_gpus or procs
    config = _model_config(recipe.model.name_or_path)
    mixed = yaml.safe_load(accelerate_config.read_text()).get("mixed_precision", "no")
    lora = recipe.lora.enabled
    param_bytes = weight_bytes(recipe, mixed)
    stages = resolve_stages(recipe)
    fused = fused_layers_counted(recipe, config)
    precision = activation_precision(recipe, mixed)
    estimates = stage_estimates(recipe, config, stages, num_gpus=gpus, param_bytes=param_bytes,
                                fused_layers=fused == "liger", sp_size=sp_size, **precision)
    worst = worst_stage(estimates)
    shown, note = table_row(chosen, estimates[worst])
    if sp_size > 1:
        note += f" with Ulysses sp_size {sp_size}: activations and logits of each GPU's 1/{sp_size} of every row"
    width = max(len(s.name) for s in stages)
    per_stage = [f"per stage ({'packed rows of max_seq_len' if recipe.data.packing else 'rows up to max_seq_len'}"
                 f"; GiB per GPU under {shown}{note}):"]
    for stage, rows in zip(stages, estimates, strict=True):
        est = rows[shown]
        unit = (f" pairs ({2 * stage.micro_batch_size} sequences)" if stage.pairs else
                f" rows ({2 * stage.micro_batch_size} sequences with their KL sides)" if stage.kto else "")
        per_stage.append(f"  {stage.name.ljust(width)}  micro batch {stage.micro_batch_size}{unit} x "
                         f"{stage.max_seq_len} tokens: activations {est['activations'] / GIB:.2f}, "
                         f"peak {est['total'] / GIB:.2f}"
                         + ("  <- worst" if stage.index == worst else ""))
    lines = [f"model {recipe.model.name_or_path}: {'LoRA r=' + str(recipe.lora.r) if lora else 'full fine-tuning'}"
             f", {param_bytes * 8}-bit weights, gradient checkpointing "
             f"{'on' if recipe.model.gradient_checkpointing else 'off'}, loss head {recipe.model.loss_head}, "
             f"fused layers {fused}, "
             f"{gpus} GPU(s) of {gpu_memory_gb:g} GiB",
             f"selected by {accelerate_config}: {chosen}" + (f" + Ulysses sp_size {sp_size}" if sp_size > 1 else ""),
             "", *per_stage,
             checkpointing_proposal(recipe, config, stages, shown, gpus=gpus, param_bytes=param_bytes,
                                    fused_layers=fused == "liger", sp_size=sp_size, gpu_memory_gb=gpu_memory_gb,
                                    precision=precision), "",
             f"worst stage '{stages[worst].name}' (micro batch {stages[worst].micro_batch_size} x "
             f"{stages[worst].max_seq_len} tokens), every strategy:",
             format_table(estimates[worst], gpu_memory_gb=gpu_memory_gb)]
    scored = scoring_passes(stages)
    if scored:
        lines += ["", *scored]
    generation = rollout_lines(stages, config, dtype_bytes=precision["activation_bytes"])
    if generation:
        lines += ["", *generation]
    if scan_data and getattr(config, "vision_config", None) is not None:
        lines += ["", *vision_stage_lines(recipe, stages, config, activation_bytes=precision["activation_bytes"])]
    elif scan_data:
        from toolkit.builtin.models import materialize_builtin
        from toolkit.model.load import load_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            try:
                tokenizer = load_tokenizer(materialize_builtin(recipe.model.name_or_path, Path(tmp)),
                                           trust_remote_code=recipe.model.trust_remote_code,
                                           chat_template=recipe.data.chat_template, local_files_only=True)
            except OSError:  # preflight never downloads: a hub id must be in the local cache
                return "\n".join([*lines, "", f"data scan skipped: the tokenizer of {recipe.model.name_or_path} "
                                   "is not in the local Hugging Face cache (preflight does not download)."])
            lines += ["", "stage data (tokens per row):"]
            dummy_dir = RunLayout(recipe.output_dir).dummy_data
            for stage in stages:
                files = resolve_data_paths([e.path for e in stage.entries if e.path is not None], dummy_dir)
                if not all(f.exists() or not f.suffix for f in files):
                    lines.append(f"  {stage.name}: data not found ({', '.join(map(str, files))})")
                    continue
                st = scan_stage(list(stage.entries), tokenizer, dummy_dir, max_seq_len=stage.max_seq_len,
                                train_on=recipe.data.train_on, thinking=recipe.data.thinking,
                                chat_template=recipe.data.chat_template, pairs=stage.pairs, kto=stage.kto)
                if stage.difficulty is not None and stage.difficulty.by in MODEL_MEASURES:
                    passes = 2 if stage.difficulty.by == "ifd" else 1
                    lines.append(f"  {stage.name}: its scoring pass runs {passes * st['tokens']} tokens forward "
                                 f"({passes} x the {st['tokens']} of its rows within max_seq_len)")
                if stage.pairs:
                    lines.append(f"  {stage.name}: {st['pairs']} pairs, each two sequences (below, the sides'); its "
                                 f"reference pass runs their {st['tokens']} tokens forward")
                unit = "sequences" if stage.pairs else "rows"
                lines.append(f"  {stage.name}: {st['rows']} {unit}, p50 {st['p50']} p90 {st['p90']} p99 {st['p99']} "
                             f"max {st['max']}; {st['over_max_seq_len']} over max_seq_len, "
                             f"{st['no_trainable_tokens']} without trainable tokens")
    return "\n".join(lines)
