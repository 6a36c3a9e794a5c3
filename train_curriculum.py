"""Curriculum fine-tuning, one launch, any strategy.

    accelerate launch --config_file accelerate_configs/zero3.yaml train_curriculum.py --config recipes/X.yaml

The strategy (single, DDP, FSDP2, ZeRO-2/3, offload) comes only from the accelerate config; nothing below
changes with it. A run reads top to bottom: config, accelerator, data, model, optimizer, prepare, loop, save.
With no --config it trains the embedded default: a tiny local Qwen3 on dummy data through a 2-stage curriculum.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from toolkit import __version__, curriculum, distributed
from toolkit.checkpoint import save_final
from toolkit.config import Recipe, load_recipe, recipe_to_yaml
from toolkit.data import IGNORE_INDEX, build_collator, load_stage_data, resolve_data_paths
from toolkit.dummy_data import write_dummy_data
from toolkit.errors import ToolkitError
from toolkit.metrics import MetricsLog
from toolkit.model import (
    apply_lora,
    check_model_source,
    choose_attention,
    count_parameters,
    enable_gradient_checkpointing,
    load_model,
    load_tokenizer,
    materialize_builtin,
    resolve_dtype,
)

log = logging.getLogger("toolkit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="Recipe YAML (default: the embedded tiny demo recipe).")
    p.add_argument("--create_dummy_data", action="store_true", help="Train every stage on generated dummy data.")
    p.add_argument("--num_dummy_samples", type=int, default=256, help="Rows per dummy data file.")
    p.add_argument("overrides", nargs="*", help="Recipe overrides, e.g. optimizer.lr=1e-4 stages.0.max_steps=5")
    return p.parse_args(argv)


def train(recipe: Recipe, *, dummy_samples: int | None) -> Path:
    out = Path(recipe.output_dir)
    lr_scale = 1.0

    # --- Accelerator: the launch config decides the strategy; we only pass what the recipe owns. ---
    accelerator = distributed.build_accelerator(recipe.train.grad_accum, recipe.distributed.timeout_minutes)
    world, rank = accelerator.num_processes, accelerator.process_index
    micro, accum = recipe.train.micro_batch_size, recipe.train.grad_accum
    global_batch = micro * accum * world
    if recipe.optimizer.lr_scaling != "none":
        ratio = global_batch / recipe.optimizer.reference_batch_size
        lr_scale = ratio if recipe.optimizer.lr_scaling == "linear" else math.sqrt(ratio)
    log.setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)  # one line per event
    # Decided once on rank 0 and shared: clocks of different nodes disagree.
    run_name = distributed.broadcast_from_main(accelerator, recipe.run_name or time.strftime("%Y%m%d-%H%M%S"))
    strategy = distributed.strategy_name(accelerator)
    log.info("run %s: strategy %s, %d process(es) on %s; effective batch = %d micro x %d accum x %d processes = %d",
             run_name, strategy, world, accelerator.device, micro, accum, world, global_batch)

    # --- Data: tokenised and validated before the model is loaded, so bad input fails in seconds. ---
    with accelerator.local_main_process_first():  # the builtin tiny model is built once per machine
        model_path = materialize_builtin(recipe.model.name_or_path, out.parent / ".toolkit-cache")
    check_model_source(model_path)
    tokenizer = load_tokenizer(model_path, trust_remote_code=recipe.model.trust_remote_code,
                               chat_template=recipe.data.chat_template)
    dummy_dir = out / "dummy_data"
    if dummy_samples is not None and accelerator.is_local_main_process:
        write_dummy_data(dummy_dir, dummy_samples, seed=recipe.train.seed)
    accelerator.wait_for_everyone()
    stage_data = []
    for stage in recipe.stages:
        data = load_stage_data(resolve_data_paths(stage.data, dummy_dir), tokenizer,
                               max_seq_len=recipe.data.max_seq_len, overlength=recipe.data.overlength,
                               train_on=recipe.data.train_on)
        log.info("stage '%s' data: %s", stage.name, data.stats.summary())
        stage_data.append(data)
    sch = recipe.schedule
    plans = curriculum.plan_stages(
        [s.name for s in recipe.stages], [len(d.samples) for d in stage_data], global_batch=global_batch,
        epochs=[s.epochs for s in recipe.stages], max_steps=[s.max_steps for s in recipe.stages],
        lrs=[(s.lr or recipe.optimizer.lr) * lr_scale for s in recipe.stages],
        warmup_ratios=[sch.warmup_ratio if s.warmup_ratio is None else s.warmup_ratio for s in recipe.stages],
        min_lr_ratios=[sch.min_lr_ratio if s.min_lr_ratio is None else s.min_lr_ratio for s in recipe.stages])
    total_steps = plans[-1].end_step
    collate = build_collator(tokenizer)

    # --- Model: same seed on every rank so LoRA init agrees (ZeRO-3 / FSDP shard each rank's own copy). ---
    set_seed(recipe.train.seed)
    attn = choose_attention(recipe.model.attn_implementation)
    dtype = resolve_dtype(recipe.model.dtype, lora=recipe.lora.enabled)
    log.info("loading %s (%s, attention=%s)", model_path, dtype, attn)
    model = load_model(model_path, dtype=dtype, attn_implementation=attn,
                       trust_remote_code=recipe.model.trust_remote_code)
    if recipe.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if recipe.lora.enabled:
        lo = recipe.lora
        model = apply_lora(model, r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=lo.target_modules,
                           modules_to_save=lo.modules_to_save)
    trainable, total = count_parameters(model)
    log.info("trainable parameters: %d of %d (%.3f%%)", trainable, total, 100 * trainable / total)
    set_seed(recipe.train.seed, device_specific=True)  # from here on (dropout), each rank its own stream

    # --- Optimizer and schedule: base lr 1.0 so the LambdaLR returns the absolute per-stage lr. ---
    opt = recipe.optimizer
    distributed.configure_deepspeed(accelerator, micro, opt.max_grad_norm)
    optimizer = distributed.build_optimizer(
        accelerator, [p for p in model.parameters() if p.requires_grad], lr=1.0,
        weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps)

    # --- Prepare: wraps model and optimizer for the strategy (DDP, FSDP2 sharding, DeepSpeed engine). ---
    model, optimizer = accelerator.prepare(model, optimizer)
    lr_at = curriculum.build_lr_lambda(plans, sch.kind)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    max_norm = opt.max_grad_norm if opt.max_grad_norm > 0 else math.inf

    # --- Outputs: created only now, after every input was validated. ---
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(recipe_to_yaml(recipe))
        (out / "run.json").write_text(json.dumps({
            "run_name": run_name, "strategy": strategy, "num_processes": world, "effective_batch": global_batch,
            "mixed_precision": accelerator.mixed_precision, "stages": [p.__dict__ for p in plans],
            "versions": {m: importlib.metadata.version(m) for m in ("torch", "transformers", "accelerate", "peft")}
            | {"toolkit": __version__}}, indent=2))
        (out / "metrics.jsonl").unlink(missing_ok=True)
    metrics = MetricsLog(out / "metrics.jsonl", enabled=accelerator.is_main_process)

    # --- The loop: one iteration = one optimizer step over a global batch of the current stage. ---
    model.train()
    bar = tqdm(total=total_steps, disable=not (accelerator.is_main_process and recipe.logging.progress_bar))
    loss_sum = torch.zeros((), device=accelerator.device)
    tokens_since = torch.zeros((), device=accelerator.device, dtype=torch.long)
    tokens_seen, samples_seen, last_log = 0, 0, time.perf_counter()
    current_stage, grad_norm = -1, None
    for step in range(total_steps):
        plan, step_in_stage = curriculum.locate(plans, step)
        if plan.index != current_stage:
            current_stage = plan.index
            log.info("stage %d/%d '%s': steps %d-%d, %d samples, peak lr %.3g", plan.index + 1, len(plans),
                     plan.name, plan.start_step + 1, plan.end_step, plan.num_samples, plan.lr)
        samples = stage_data[plan.index].samples
        indices = curriculum.global_batch_indices(plan, step_in_stage, recipe.train.seed)
        batches = [collate([samples[i] for i in idx]) for idx in curriculum.rank_micro_batches(
            indices, rank=rank, world_size=world, micro_batch_size=micro, grad_accum=accum)]

        # Normalise by the label tokens of the whole global batch (all ranks, all micro-steps): the gradient
        # is then independent of how the batch is split. Strategies average gradients over ranks and
        # accumulation steps, hence the world x accum factor in num_items_in_batch.
        local_label_tokens = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches).to(accelerator.device)
        global_label_tokens = accelerator.reduce(local_label_tokens, reduction="sum")
        items_per_micro = global_label_tokens / (world * accum)
        for batch in batches:
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with accelerator.accumulate(model):
                loss = model(**batch, num_items_in_batch=items_per_micro).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()
                optimizer.zero_grad()
            loss_sum += loss.detach()
            tokens_since += batch["attention_mask"].sum()
        scheduler.step()
        samples_seen += global_batch
        bar.update(1)

        if (step + 1) % recipe.logging.logging_steps == 0 or step + 1 == total_steps:
            # The only host syncs of the loop: once per logging interval.
            mean_loss = accelerator.reduce(loss_sum, reduction="sum").item() / (world * accum)
            new_tokens = int(accelerator.reduce(tokens_since, reduction="sum").item())
            steps_logged = (step % recipe.logging.logging_steps) + 1
            now = time.perf_counter()
            tokens_seen += new_tokens
            record = {
                "step": step + 1, "stage": plan.name, "stage_index": plan.index, "stage_step": step_in_stage + 1,
                "loss": mean_loss / steps_logged, "lr": lr_at(step),
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens": tokens_seen, "tokens_per_sec": new_tokens / (now - last_log), "samples": samples_seen,
            }
            metrics.write(record)
            bar.set_postfix(stage=plan.name, loss=f"{record['loss']:.4f}")
            loss_sum.zero_()
            tokens_since.zero_()
            last_log = now
    bar.close()

    # --- Save: gathered adapter (or full model) + tokenizer, usable with from_pretrained. ---
    final = save_final(accelerator, model, tokenizer, out / "final")
    accelerator.end_training()
    return final


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    try:
        recipe = load_recipe(args.config, args.overrides)
        dummy = args.num_dummy_samples if (args.create_dummy_data or args.config is None) else None
        if args.create_dummy_data:
            for i, stage in enumerate(recipe.stages):
                stage.data = ["dummy:stage1" if i == 0 else "dummy:stage2"]
        final = train(recipe, dummy_samples=dummy)
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger("toolkit").info("done. metrics: %s  final model: %s",
                                      Path(recipe.output_dir) / "metrics.jsonl", final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
