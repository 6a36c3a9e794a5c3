"""Curriculum fine-tuning, one launch, any strategy.

    accelerate launch --config_file accelerate_configs/zero3.yaml train_curriculum.py --config recipes/X.yaml

The strategy (single, DDP, FSDP2, ZeRO-2/3, offload) comes only from the accelerate config; nothing below
changes with it. A run reads top to bottom: config, accelerator, data, model, optimizer, prepare, resume, loop,
save. Relaunching the same command resumes from the newest committed checkpoint (checkpoint.resume: auto).
With no --config it trains the embedded default: a tiny local Qwen3 on dummy data through a 2-stage curriculum.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from toolkit import __version__, checkpoint, curriculum, distributed
from toolkit.config import Recipe, flat_config, load_recipe, recipe_to_yaml, resume_invariants
from toolkit.data import (
    DUMMY_PREFIX,
    IGNORE_INDEX,
    StageSources,
    build_collator,
    content_digest,
    load_stage_data,
    load_stage_sources,
    resolve_data_paths,
)
from toolkit.dummy_data import write_dummy_data
from toolkit.errors import ToolkitError
from toolkit.evaluation import evaluate
from toolkit.flops import batch_train_flops, peak_flops
from toolkit.guards import StabilityGuard, Verdict, injected_fault
from toolkit.loss_head import check_loss_head, install_loss_head
from toolkit.metrics import Meter, MetricsLog, check_trackers, sample_lengths, truncate_after
from toolkit.model import (
    apply_lora,
    check_model_source,
    check_remote_code,
    choose_attention,
    count_parameters,
    enable_gradient_checkpointing,
    is_vision_language,
    load_model,
    load_processor,
    load_tokenizer,
    materialize_builtin,
    resolve_dtype,
)
from toolkit.packing import PackedCollator, check_packing_support
from toolkit.preemption import PREEMPTED_EXIT_CODE, PreemptionFlag
from toolkit.run_dir import RunLock, check_not_an_earlier_run, check_output_dir
from toolkit.sampling import Pacing, StageSampler
from toolkit.trainable import TrainablePlan, modules_to_train, plan_trainable, stage_entries

log = logging.getLogger("toolkit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="Recipe YAML (default: the embedded tiny demo recipe).")
    p.add_argument("--create_dummy_data", action="store_true", help="Train every stage on generated dummy data.")
    p.add_argument("--num_dummy_samples", type=int, default=256, help="Rows per dummy data file.")
    p.add_argument("overrides", nargs="*", help="Recipe overrides, e.g. optimizer.lr=1e-4 stages.0.max_steps=5")
    return p.parse_args(argv)


def train(recipe: Recipe, *, create_dummy: bool, dummy_samples: int) -> int:
    out = Path(recipe.output_dir)
    check_output_dir(out)
    lr_scale = 1.0

    # --- Accelerator: the launch config decides the strategy; we only pass what the recipe owns. ---
    check_trackers(recipe.logging.trackers)
    accelerator = distributed.build_accelerator(recipe.train.grad_accum, recipe.distributed.timeout_minutes,
                                                log_with=recipe.logging.trackers or None,
                                                project_dir=str(out / "trackers"))
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
    # One writer per output dir: a second launch (or a requeue while an orphaned trainer runs) stops here.
    # The launcher's death reaches the trainer as SIGTERM from here on (see toolkit/preemption.py).
    preemption = PreemptionFlag()
    lock = RunLock(out, out.parent / ".toolkit-cache")
    busy = distributed.broadcast_from_main(accelerator, lock.acquire() if accelerator.is_main_process else None)
    if busy is not None:
        raise ToolkitError(f"output_dir {out}: {busy}.")
    ck = recipe.checkpoint
    resume_from = checkpoint.find_resume(ck.resume, out / "checkpoints")
    if ck.resume == "none" and checkpoint.committed_checkpoints(out / "checkpoints"):
        raise ToolkitError(f"{out} already holds checkpoints of an earlier run and checkpoint.resume is none: "
                           "they would be overwritten. Use resume: auto to continue it, or a new output_dir.")
    if resume_from is None:
        check_not_an_earlier_run(out)

    # --- Data: tokenised and validated before the model is loaded, so bad input fails in seconds. ---
    with accelerator.local_main_process_first():  # the builtin tiny models are built once per machine
        model_path = materialize_builtin(recipe.model.name_or_path, out.parent / ".toolkit-cache")
    check_model_source(model_path)
    check_remote_code(model_path, trust_remote_code=recipe.model.trust_remote_code)
    vision = is_vision_language(model_path, trust_remote_code=recipe.model.trust_remote_code)
    if create_dummy:  # stages not already on dummy data get the generated files
        use_dummy_data(recipe, vision=vision)
    if vision:  # the processor formats image rows; its tokenizer is saved with the model
        processor = load_processor(model_path, trust_remote_code=recipe.model.trust_remote_code,
                                   chat_template=recipe.data.chat_template)
        tokenizer = processor.tokenizer
    else:
        processor = tokenizer = load_tokenizer(model_path, trust_remote_code=recipe.model.trust_remote_code,
                                               chat_template=recipe.data.chat_template)
    dummy_dir = out / "dummy_data"
    if uses_dummy_data(recipe) and accelerator.is_local_main_process:
        write_dummy_data(dummy_dir, dummy_samples, seed=recipe.train.seed)
        if vision:
            from toolkit.vision import write_dummy_vl_data

            write_dummy_vl_data(dummy_dir, dummy_samples, seed=recipe.train.seed)
    accelerator.wait_for_everyone()
    stages, stage_eval = load_curriculum_data(recipe, tokenizer, processor if vision else None, dummy_dir,
                                              accelerator)
    sch = recipe.schedule
    plans = curriculum.plan_stages(
        [s.name for s in recipe.stages], [len(src.samples) for src in stages],
        micro_batches=[s.micro_batch_size or micro for s in recipe.stages], grad_accum=accum, world_size=world,
        epochs=[s.epochs for s in recipe.stages], max_steps=[s.max_steps for s in recipe.stages],
        lrs=[(s.lr or recipe.optimizer.lr) * lr_scale for s in recipe.stages],
        warmup_ratios=[sch.warmup_ratio if s.warmup_ratio is None else s.warmup_ratio for s in recipe.stages],
        min_lr_ratios=[sch.min_lr_ratio if s.min_lr_ratio is None else s.min_lr_ratio for s in recipe.stages],
        schedules=[s.schedule or sch.kind for s in recipe.stages], decay_ratio=sch.decay_ratio)
    samplers = [StageSampler(sizes=src.sizes, weights=stage.weights, replacement=stage.mixture_replacement,
                             order=stage.order, difficulty=None if src.difficulty is None else np.array(src.difficulty),
                             lengths=np.array(src.lengths), seed=recipe.train.seed, stage_index=plan.index,
                             pacing=Pacing(stage.pacing.kind, stage.pacing.start_fraction) if stage.pacing else None,
                             global_batch=plan.global_batch, total_steps=plan.steps)
                for stage, src, plan in zip(recipe.stages, stages, plans, strict=True)]
    if vision:
        from toolkit.vision import VLCollator

        collate = VLCollator(processor, min_pixels=recipe.data.min_pixels, max_pixels=recipe.data.max_pixels)
    else:
        collate = PackedCollator() if recipe.data.packing else build_collator(tokenizer)
    settings, data_files = resume_invariants(recipe), data_fingerprint(recipe, dummy_dir)
    invariants = checkpoint.recipe_hash(settings)
    resume_meta = checkpoint.read_meta(resume_from) if resume_from is not None else {}
    forced: list[str] = []
    if resume_from is not None:  # before loading the model: a mismatch should fail in seconds
        forced = checkpoint.check_resumable(resume_meta, resume_from, invariants_hash=invariants,
                                            effective_batch=global_batch, strategy=strategy, world_size=world,
                                            force=ck.resume_force, stage_batches=[p.global_batch for p in plans],
                                            invariants=settings, data_files=data_files)
        checkpoint.check_integrity(accelerator, resume_from, resume_meta)
        # Stages that ended early on eval patience keep their actual length (samplers keep the planned one).
        plans = curriculum.apply_stage_steps(plans, resume_meta.get("curriculum", {}).get(
            "stage_steps", [p.steps for p in plans]))

    # --- Model: same seed on every rank so LoRA init agrees (ZeRO-3 / FSDP shard each rank's own copy). ---
    set_seed(recipe.train.seed)
    model, trainable = build_model(recipe, model_path, vision=vision)
    if recipe.data.packing:
        check_packing_support(model)
    total = count_parameters(model)[1]
    for plan, count in zip(plans, trainable.stage_counts, strict=True):
        log.info("stage '%s' trains %d of %d parameters (%.3f%%)", plan.name, count, total, 100 * count / total)
    set_seed(recipe.train.seed, device_specific=True)  # from here on (dropout), each rank its own stream

    # --- Optimizer and schedule: base lr 1.0 so the LambdaLR returns the absolute per-stage lr. ---
    # Every parameter that trains in some stage is in the optimizer from the start, one param group per set of
    # stages it trains in; the StageFreezer below withholds the updates of the groups a stage freezes.
    opt = recipe.optimizer
    text_config = model.config.get_text_config()
    distributed.configure_deepspeed(accelerator, model, micro, opt.max_grad_norm)
    optimizer = distributed.build_optimizer(accelerator, trainable.param_groups(model), lr=1.0,
                                            weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps)

    # --- Prepare: wraps model and optimizer for the strategy (DDP, FSDP2 sharding, DeepSpeed engine). ---
    model, optimizer = accelerator.prepare(model, optimizer)
    freezer = distributed.StageFreezer(accelerator, model, optimizer, trainable.groups)
    lr_at = curriculum.build_lr_lambda(plans, sch.kind)
    # The lambda reads `lr_at` when called: an early stage advance rebinds it to the moved-up stages' schedule.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step))
    accelerator.register_for_checkpointing(scheduler)  # we step it ourselves, so accelerate does not own it
    max_norm = opt.max_grad_norm if opt.max_grad_norm > 0 else math.inf

    # --- Resume: weights, optimizer, scheduler, RNG; the data position is a pure function of the step. ---
    meter = Meter(accelerator.device)
    start_step = 0
    if resume_from is not None:
        how = checkpoint.restore(accelerator, model, optimizer, scheduler, resume_from, strategy=strategy)
        start_step, meter.tokens_total = resume_meta["step"], resume_meta["tokens"]
        meter.losses, meter.skipped = resume_meta["pending"]["losses"], resume_meta["pending"]["skipped"]
        freezer.updates = resume_meta.get("adam_updates", [start_step] * len(freezer.updates))
        log.info("resumed (%s) from %s: step %d of %d, stage '%s'", f"{how}, forced past differences" if forced
                 else how, resume_from, start_step, plans[-1].end_step, resume_meta["stage"])
        for difference in forced:
            log.warning("checkpoint.resume_force: resumed despite %s", difference)
    manager = checkpoint.CheckpointManager(out / "checkpoints", keep_last=ck.keep_last, best_metric=ck.best_metric,
                                           best_mode=ck.best_mode, is_main=accelerator.is_main_process,
                                           barrier=accelerator.wait_for_everyone)

    # --- Outputs: created only now, after every input was validated. ---
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(recipe_to_yaml(recipe))
        (out / "run.json").write_text(json.dumps({
            "run_name": run_name, "strategy": strategy, "num_processes": world, "effective_batch": global_batch,
            "mixed_precision": accelerator.mixed_precision, "stages": [p.__dict__ for p in plans],
            "trainable_params": trainable.stage_counts,
            "versions": {m: importlib.metadata.version(m) for m in ("torch", "transformers", "accelerate", "peft")}
            | {"toolkit": __version__}}, indent=2))
        if resume_from is None:
            (out / "metrics.jsonl").unlink(missing_ok=True)
        else:  # steps after the checkpoint will be redone
            truncate_after(out / "metrics.jsonl", start_step)
    metrics = MetricsLog(out / "metrics.jsonl", enabled=accelerator.is_main_process)
    accelerator.init_trackers(run_name, config=flat_config(recipe))
    guard = StabilityGuard(spike_factor=recipe.stability.loss_spike_factor,
                           spike_window=recipe.stability.loss_spike_window,
                           max_consecutive_skips=recipe.stability.max_consecutive_skips)
    peak = peak_flops(distributed.device_name(accelerator), recipe.logging.peak_tflops)
    saved_patience = resume_meta.get("curriculum", {}).get("patience")  # counters of the stage resumed into

    def log_record(record: dict) -> None:
        metrics.write(record)
        accelerator.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["step"])

    # --- The loop: one iteration = one optimizer step over a global batch of the current stage. ---
    model.train()
    bar = tqdm(total=plans[-1].end_step, initial=start_step,
               disable=not (accelerator.is_main_process and recipe.logging.progress_bar))
    last_save, current_stage, grad_norm, latest, patience = time.monotonic(), -1, None, {}, None
    stage_start_tokens = meter.tokens_total  # approximate after a mid-stage resume (counts from the resume)
    step = start_step
    while step < plans[-1].end_step:  # the end moves up when a stage ends early
        plan, step_in_stage = curriculum.locate(plans, step)
        stage = recipe.stages[plan.index]
        if plan.index != current_stage:
            current_stage = plan.index
            freezer.set_stage(plan.index)
            resumed_here = saved_patience is not None and resume_meta["stage_index"] == plan.index
            patience = None if stage.patience is None else curriculum.Patience.from_state(
                stage.patience, stage.patience_min_delta, saved_patience if resumed_here else None)
            log.info("stage %d/%d '%s': steps %d-%d, %d samples, global batch %d, lr %.3g at its start%s",
                     plan.index + 1, len(plans), plan.name, plan.start_step + 1, plan.end_step, plan.num_samples,
                     plan.global_batch, lr_at(step), " (continued schedule)" if plan.schedule == "continue" else "")
        samples = stages[plan.index].samples
        indices = samplers[plan.index].batch(step_in_stage)
        if recipe.data.group_by_length:  # same samples, fewer pad tokens: loss is normalised over the global batch
            indices = sorted(indices, key=stages[plan.index].lengths.__getitem__)
        rank_batches = curriculum.rank_micro_batches(indices, rank=rank, world_size=world,
                                                     micro_batch_size=plan.micro_batch, grad_accum=accum)
        batches = [collate([samples[i] for i in idx]) for idx in rank_batches]

        # Normalise by the label tokens of the whole global batch (all ranks, all micro-steps): the gradient
        # is then independent of how the batch is split. Strategies average gradients over ranks and
        # accumulation steps, hence the world x accum factor in num_items_in_batch.
        local_label_tokens = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches).to(accelerator.device)
        items_per_micro = accelerator.reduce(local_label_tokens, reduction="sum") / (world * accum)
        local_loss, verdict = torch.zeros((), device=accelerator.device), Verdict(skip=False)
        for j, (idx, batch) in enumerate(zip(rank_batches, batches, strict=True)):
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            lengths = [n for i in idx for n in sample_lengths(samples[i])]
            meter.add_batch(batch, batch_train_flops(text_config, lengths, lora=recipe.lora.enabled), len(lengths))
            with accelerator.accumulate(model):
                loss = model(**batch, num_items_in_batch=items_per_micro).loss
                if injected_fault(step + 1, rank):
                    loss = loss * float("nan")
                local_loss += loss.detach()
                if j == accum - 1:
                    # One all-reduce per step, before the update is committed: the step's global loss (NaN if
                    # any rank's is), preemption and timed-save flags. Every rank gets the same verdict.
                    time_due = ck.save_minutes is not None and time.monotonic() - last_save >= 60 * ck.save_minutes
                    summed = accelerator.reduce(torch.stack([
                        local_loss, torch.tensor(float(preemption.requested), device=accelerator.device),
                        torch.tensor(float(time_due), device=accelerator.device)]), reduction="sum").tolist()
                    step_loss, preempted, time_due = summed[0] / (world * accum), summed[1] > 0, summed[2] > 0
                    verdict = guard.judge(step_loss)
                    if verdict.skip:
                        loss = distributed.veto_update(loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    freezer.drop_frozen_grads()  # frozen parameters leave the norm and the update
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                if not verdict.skip:  # outside sync steps accelerate's optimizer.step() is a no-op anyway
                    optimizer.step()
                else:
                    distributed.skip_update(accelerator.scaler)  # fp16: the loss scaler closes the step too
                optimizer.zero_grad()
        scheduler.step()
        meter.add_step(step_loss, verdict.skip)
        if not verdict.skip and not distributed.scaler_skipped(optimizer):  # fp16 overflow: no update
            freezer.count_update(plan.index)
        bar.update(1)
        done = step + 1
        if verdict.skip:
            log.warning("step %d (stage '%s'): update skipped, %s", done, plan.name, verdict.reason)
            if guard.exhausted:
                last_good = checkpoint.committed_checkpoints(out / "checkpoints")
                raise ToolkitError(
                    f"Training diverged: {guard.consecutive} consecutive steps skipped up to step {done} in stage "
                    f"'{plan.name}' ({verdict.reason}). Last good checkpoint: "
                    f"{last_good[-1] if last_good else 'none'}. Lower the learning rate or check the data.")

        if done % recipe.logging.logging_steps == 0 or done == plans[-1].end_step:
            record = {"step": done, "stage": plan.name, "stage_index": plan.index, "stage_step": step_in_stage + 1,
                      **meter.record(accelerator, peak_flops=peak), "lr": lr_at(step),
                      "grad_norm": float(grad_norm) if grad_norm is not None else None,
                      "samples": curriculum.samples_seen(plans, done)}
            log_record(record)
            latest.update(record)
            bar.set_postfix(stage=plan.name, loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}")

        # Evaluation: every eval.every_steps and at the end of each stage, on the stage's (or global) eval set.
        # With patience, an evaluation that has not improved on the stage's best for that long ends the stage.
        stage_end = done == plan.end_step
        eval_samples = stage_eval[plan.index]
        if eval_samples and (stage_end or (recipe.eval.every_steps and done % recipe.eval.every_steps == 0)):
            result = evaluate(accelerator, model, eval_samples, collate, recipe.eval.micro_batch_size or micro)
            log_record({"step": done, "stage": plan.name, "stage_index": plan.index, **result})
            latest.update(result)
            log.info("step %d eval: loss %.4f, ppl %.2f", done, result["eval_loss"], result["eval_ppl"])
            if patience is not None and patience.update(result["eval_loss"]) and not stage_end:
                log.info("stage '%s' ends early after %d of %d steps: eval_loss has not improved on %.4f for %d "
                         "evaluations", plan.name, step_in_stage + 1, plan.steps, patience.best, patience.since_best)
                plans = curriculum.end_stage_early(plans, plan.index, step_in_stage + 1)
                plan, stage_end = plans[plan.index], True
                lr_at = curriculum.build_lr_lambda(plans, sch.kind)
                bar.total = plans[-1].end_step
                log_record({"step": done, "stage": plan.name, "stage_index": plan.index, "event": "early_advance",
                            "best_eval_loss": patience.best})

        if stage_end:  # the stage's summary, in the log and in metrics.jsonl
            tokens_now = meter.tokens_total + meter.reduced(accelerator)[0]
            summary = {"step": done, "stage": plan.name, "stage_index": plan.index, "event": "stage_end",
                       "stage_steps": plan.steps, "stage_samples": plan.steps * plan.global_batch,
                       "stage_tokens": tokens_now - stage_start_tokens,
                       "trainable_params": trainable.stage_counts[plan.index]}
            metrics.write(summary)
            log.info("stage '%s' done: %d steps, %d samples, %d tokens, %d trainable parameters", plan.name,
                     plan.steps, summary["stage_samples"], summary["stage_tokens"], summary["trainable_params"])
            stage_start_tokens = tokens_now

        # Checkpoint: every save_steps / save_minutes, at stage ends, and on preemption (all ranks agree).
        periodic = bool(ck.save_steps) and done % ck.save_steps == 0
        if preempted or time_due or periodic or (ck.save_on_stage_end and stage_end):
            meta = {"step": done, "stage": plan.name, "stage_index": plan.index, "stage_step": step_in_stage + 1,
                    "samples": curriculum.samples_seen(plans, done),
                    "tokens": meter.tokens_total + meter.reduced(accelerator)[0],
                    "pending": {"losses": meter.losses, "skipped": meter.skipped},
                    "curriculum": {"stage_steps": [p.steps for p in plans],
                                   "patience": None if patience is None or stage_end else patience.state()},
                    "adam_updates": freezer.updates,
                    "metrics": latest, "time": time.time(), "world_size": world, "strategy": strategy,
                    "effective_batch": global_batch, "stage_batches": [p.global_batch for p in plans],
                    "lora": recipe.lora.enabled, "recipe_hash": invariants, "invariants": settings,
                    "data_files": data_files,
                    "run_name": run_name, "base_model": model_path, "toolkit_version": __version__}
            portable = recipe.lora.enabled and ck.portable
            write = partial(checkpoint.write_state, accelerator, model, optimizer,
                            adam_steps=freezer.adam_steps() if portable else None)
            log.info("checkpoint %s", manager.save(done, write, meta))
            last_save = time.monotonic()
        if preempted:
            log.warning("preempted (%s): stopped after step %d, checkpoint saved; resume with the same command",
                        preemption.signal_name or "signal on another rank", done)
            accelerator.end_training()
            return PREEMPTED_EXIT_CODE
        step = done
    bar.close()
    if guard.consecutive:  # the last updates were withheld: what the weights hold is not where training ended
        last_good = checkpoint.committed_checkpoints(out / "checkpoints")
        raise ToolkitError(
            f"Training ended with its last {guard.consecutive} step(s) skipped ({guard.last_reason}); final/ was "
            f"not written. Last checkpoint: {last_good[-1] if last_good else 'none'}. Lower the learning rate or "
            "check the data, then resume from a checkpoint before the trouble began.")

    # --- Save: gathered adapter (or full model) + tokenizer / processor, usable with from_pretrained. ---
    final = checkpoint.save_final(accelerator, model, processor, out / "final")
    log.info("done. metrics: %s  final model: %s  (%d steps skipped)", out / "metrics.jsonl", final,
             guard.total_skipped)
    accelerator.end_training()
    return 0


def use_dummy_data(recipe: Recipe, *, vision: bool) -> None:
    """`--create_dummy_data`: stages not already on dummy data train on the generated files (image-text ones for a
    vision-language model), stage 1 on the first file, later stages on the second."""
    first, second = ("dummy:vl_stage1", "dummy:vl_stage2") if vision else ("dummy:stage1", "dummy:stage2")
    for i, stage in enumerate(recipe.stages):
        if not all(path.startswith(DUMMY_PREFIX) for path in stage.paths):
            stage.data = [first if i == 0 else second]  # type: ignore[list-item]


def uses_dummy_data(recipe: Recipe) -> bool:
    return any(path.startswith(DUMMY_PREFIX) for stage in recipe.stages
               for path in [*stage.paths, *(stage.eval or []), *recipe.eval.data])


def tokenized_cache_dir(recipe: Recipe) -> Path | None:
    """Where tokenised files (and data-file hashes) are cached; None when data.cache_dir is 'none'."""
    if recipe.data.cache_dir == "none":
        return None
    return Path(recipe.data.cache_dir or Path(recipe.output_dir).parent / ".toolkit-cache" / "tokenized")


def data_fingerprint(recipe: Recipe, dummy_dir: Path) -> dict[str, str]:
    """sha256 of every data file the run reads (training and eval), by its recipe entry. Stored in checkpoints:
    a resume on data that changed since is refused (the steps left would see other samples)."""
    entries = sorted({p for s in recipe.stages for p in [*s.paths, *(s.eval or [])]} | set(recipe.eval.data))
    paths = resolve_data_paths(entries, dummy_dir)
    cache = tokenized_cache_dir(recipe)
    return {entry: content_digest(path, cache) for entry, path in zip(entries, paths, strict=True)}


def load_curriculum_data(recipe: Recipe, tokenizer: Any, processor: Any | None, dummy_dir: Path,
                         accelerator: Accelerator) -> tuple[list[StageSources], list[list[dict[str, Any]]]]:
    """Every stage's training rows (tokenised, length policy applied, packed with packing) and eval rows.

    A vision-language model's rows go through its processor (`processor` given): image tokens are expanded and
    never cut, and the rows are neither cached nor packed.
    """
    if processor is not None and recipe.data.packing:
        raise ToolkitError("data.packing is not supported for vision-language models: set data.packing: false "
                           "(data.group_by_length: true also cuts padding).")
    cache = tokenized_cache_dir(recipe)

    def settings(stage: Any) -> dict[str, Any]:
        max_len = stage.max_seq_len or recipe.data.max_seq_len
        encoder = None
        if processor is not None:
            from toolkit.vision import vl_encoder

            encoder = vl_encoder(processor, max_seq_len=max_len, overlength=recipe.data.overlength,
                                 train_on=recipe.data.train_on, min_pixels=recipe.data.min_pixels,
                                 max_pixels=recipe.data.max_pixels)
        return {"max_seq_len": max_len, "overlength": recipe.data.overlength, "train_on": recipe.data.train_on,
                "thinking": recipe.data.thinking, "encoder": encoder}

    # One rank per machine tokenises text first and the others read its cache; image rows (not cached) are
    # encoded by every rank at once.
    order = contextlib.nullcontext if processor is not None else accelerator.local_main_process_first
    stages = []
    for stage in recipe.stages:
        with order():
            src = load_stage_sources(resolve_data_paths(stage.paths, dummy_dir), tokenizer, packing=recipe.data.packing,
                                     needs_difficulty=stage.order == "easy_to_hard", cache_dir=cache, **settings(stage))
        if not src.samples:
            raise ToolkitError(f"Stage '{stage.name}' has no usable rows ({src.stats.summary()}). Check its data.")
        log.info("stage '%s' data: %s%s", stage.name, src.stats.summary(),
                 f"; packed into {len(src.samples)} rows" if recipe.data.packing else "")
        stages.append(src)
    evals = []  # one per stage (the same files when they come from eval.data)
    for stage in recipe.stages:
        files = stage.eval if stage.eval is not None else recipe.eval.data
        evals.append(load_stage_data(resolve_data_paths(files, dummy_dir), tokenizer, **settings(stage)).samples
                     if files else [])
    return stages, evals


def build_model(recipe: Recipe, model_path: str, *, vision: bool) -> tuple[torch.nn.Module, TrainablePlan]:
    """The base model with its attention kernel, gradient checkpointing and LoRA, and what trains in each stage.

    Modules that `trainable` patterns name in a LoRA run become PEFT modules_to_save (trained in full, saved with
    the adapter); `plan_trainable` then sets requires_grad on everything that trains in any stage.
    """
    attn = choose_attention(recipe.model.attn_implementation)
    check_loss_head(recipe.model.loss_head)  # a missing kernel fails before the weights load
    dtype = resolve_dtype(recipe.model.dtype, lora=recipe.lora.enabled)
    log.info("loading %s (%s, attention=%s%s)", model_path, dtype, attn, ", vision-language" if vision else "")
    model = load_model(model_path, dtype=dtype, attn_implementation=attn,
                       trust_remote_code=recipe.model.trust_remote_code, vision=vision)
    if recipe.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    entries, keys = stage_entries([s.trainable for s in recipe.stages], recipe.train.trainable)
    if recipe.lora.enabled:
        lo = recipe.lora
        extra = modules_to_train(model, entries, keys)
        model = apply_lora(model, r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=lo.target_modules,
                           modules_to_save=[*lo.modules_to_save, *extra], exclude_modules=lo.exclude_modules)
    install_loss_head(model, recipe.model.loss_head, recipe.model.loss_chunk_size)  # no full-vocabulary logits
    return model, plan_trainable(model, entries, keys, lora=recipe.lora.enabled)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    try:
        if args.num_dummy_samples < 1:
            raise ToolkitError(f"--num_dummy_samples must be at least 1, got {args.num_dummy_samples}.")
        recipe = load_recipe(args.config, args.overrides)
        return train(recipe, create_dummy=args.create_dummy_data, dummy_samples=args.num_dummy_samples)
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr)
        distributed.record_launch_error(f"error: {e}")  # the launcher's failure summary ends with it
        return 2
    except KeyboardInterrupt:  # one line, not a traceback per frame; committed checkpoints are intact
        print("interrupted (Ctrl-C): stopped without saving; relaunch the same command to resume from the last "
              "checkpoint.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    distributed.exit_without_teardown(main())
