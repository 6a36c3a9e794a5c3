"""Curriculum fine-tuning, one launch, any strategy.

    accelerate launch --config_file accelerate_configs/zero3.yaml train_curriculum.py --config recipes/X.yaml

The strategy (single, DDP, FSDP2, ZeRO-2/3, offload) comes only from the accelerate config; nothing below
changes with it. A run reads top to bottom: config, accelerator, data, model, optimizer, prepare, resume, loop,
save. Relaunching the same command resumes from the newest committed checkpoint (checkpoint.resume: auto).
With no --config it trains the embedded default: a tiny local Qwen3 on dummy data through a 2-stage curriculum.
The loop's units (one step, what follows a step, the run state a checkpoint restores) are in toolkit/loop.py.
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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from toolkit import __version__, checkpoint, curriculum, distributed, freezer, strategies
from toolkit.config import Recipe, flat_config, load_recipe, recipe_to_yaml, resume_invariants
from toolkit.data import (
    DUMMY_PREFIX,
    TrainingSet,
    build_collator,
    content_digest,
    encode_files,
    load_training_set,
    resolve_data_paths,
)
from toolkit.dummy_data import write_dummy_data
from toolkit.errors import ToolkitError
from toolkit.flops import peak_flops
from toolkit.guards import StabilityGuard
from toolkit.loop import Run, RunState, after_step, enter_stage, run_step
from toolkit.loss_head import check_loss_head, install_loss_head
from toolkit.metrics import Meter, MetricsLog, check_trackers, truncate_after
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
from toolkit.preemption import PreemptionFlag
from toolkit.run_dir import RunLayout, RunLock, check_not_an_earlier_run, check_output_dir
from toolkit.sampling import Pacing, StageSampler
from toolkit.strategies.deepspeed import configure_deepspeed
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
    out, ck = Path(recipe.output_dir), recipe.checkpoint
    layout = RunLayout(out)
    micro, accum = recipe.train.micro_batch_size, recipe.train.grad_accum
    check_output_dir(out)

    # --- Accelerator: the launch config decides the strategy; we only pass what the recipe owns. ---
    check_trackers(recipe.logging.trackers)
    accelerator = distributed.build_accelerator(accum, recipe.distributed.timeout_minutes,
                                                log_with=recipe.logging.trackers or None,
                                                project_dir=str(layout.trackers))
    world, strategy = accelerator.num_processes, strategies.strategy_name(accelerator)
    global_batch = micro * accum * world
    log.setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)  # one line per event
    # Decided once on rank 0 and shared: clocks of different nodes disagree.
    run_name = distributed.broadcast_from_main(accelerator, recipe.run_name or time.strftime("%Y%m%d-%H%M%S"))
    log.info("run %s: strategy %s, %d process(es) on %s; effective batch = %d micro x %d accum x %d processes = %d",
             run_name, strategy, world, accelerator.device, micro, accum, world, global_batch)
    # The launcher's death reaches the trainer as SIGTERM from here on (see toolkit/preemption.py).
    preemption = PreemptionFlag()
    _lock, resume_from = claim_output_dir(recipe, accelerator)  # held (open) until the process exits

    # --- Data: tokenised and validated before the model is loaded, so bad input fails in seconds. ---
    with accelerator.local_main_process_first():  # the builtin tiny models are built once per machine
        model_path = materialize_builtin(recipe.model.name_or_path, layout.cache)
    check_model_source(model_path)
    check_remote_code(model_path, trust_remote_code=recipe.model.trust_remote_code)
    vision = is_vision_language(model_path, trust_remote_code=recipe.model.trust_remote_code)
    processor, tokenizer, dummy_dir = prepare_inputs(recipe, accelerator, model_path, vision=vision,
                                                     create_dummy=create_dummy, dummy_samples=dummy_samples)
    stages, stage_eval = load_curriculum_data(recipe, tokenizer, processor if vision else None, dummy_dir,
                                              accelerator)
    plans, samplers = plan_curriculum(recipe, stages, world_size=world, global_batch=global_batch)
    collate = build_batch_collator(recipe, processor if vision else tokenizer, vision=vision)
    identity = run_identity(recipe, accelerator, plans, run_name=run_name, model_path=model_path,
                            data_files=data_fingerprint(recipe, dummy_dir))
    resume_meta, forced = {}, []
    if resume_from is not None:  # before loading the model: a mismatch should fail in seconds
        resume_meta, forced, plans = check_resume(accelerator, resume_from, identity, plans, force=ck.resume_force)

    # --- Model: same seed on every rank so LoRA init agrees (ZeRO-3 / FSDP shard each rank's own copy). ---
    set_seed(recipe.train.seed)
    model, trainable = build_model(recipe, model_path, vision=vision)
    set_seed(recipe.train.seed, device_specific=True)  # from here on (dropout), each rank its own stream

    # --- Optimizer and schedule: base lr 1.0 so the LambdaLR returns the absolute per-stage lr. ---
    # Every parameter that trains in some stage is in the optimizer from the start, one param group per set of
    # stages it trains in; the StageFreezer below withholds the updates of the groups a stage freezes.
    opt = recipe.optimizer
    configure_deepspeed(accelerator, model, micro, opt.max_grad_norm)
    optimizer = distributed.build_optimizer(accelerator, trainable.param_groups(model), lr=1.0,
                                            weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps)

    # --- Prepare: wraps model and optimizer for the strategy (DDP, FSDP2 sharding, DeepSpeed engine). ---
    model, optimizer = accelerator.prepare(model, optimizer)
    run = assemble_run(recipe, accelerator, model, optimizer, trainable, preemption=preemption, plans=plans,
                       stages=stages, samplers=samplers, stage_eval=stage_eval, collate=collate, identity=identity)

    # --- Resume: weights, optimizer, scheduler, RNG and the run state; the data position is a function of the step.
    if resume_from is not None:
        resume_run(run, resume_from, resume_meta, forced)
    write_run_files(recipe, accelerator, run_name, plans, trainable.stage_counts,
                    resumed_at=None if run.resumed is None else run.resumed.step)
    accelerator.init_trackers(run_name, config=flat_config(recipe))

    # --- The loop: one iteration = one optimizer step over a global batch of the current stage. ---
    model.train()
    step = run.resumed.step if run.resumed else 0
    run.bar = tqdm(total=plans[-1].end_step, initial=step,
                   disable=not (accelerator.is_main_process and recipe.logging.progress_bar))
    while step < run.plans[-1].end_step:  # the end moves up when a stage ends early
        plan, step_in_stage = curriculum.locate(run.plans, step)
        if plan.index != run.current_stage:
            enter_stage(run, plan, step)
        result = run_step(run, plan, step_in_stage, step)
        if (code := after_step(run, plan, step_in_stage, step + 1, result)) is not None:
            return code
        step += 1
    run.bar.close()
    check_last_steps_applied(run.guard, out)

    # --- Save: gathered adapter (or full model) + tokenizer / processor, usable with from_pretrained. ---
    final = checkpoint.save_final(accelerator, model, processor, layout.final)
    log.info("done. metrics: %s  final model: %s  (%d steps skipped)", layout.metrics, final,
             run.guard.total_skipped)
    accelerator.end_training()
    return 0


def check_resume(accelerator: Accelerator, ckpt: Path, identity: dict[str, Any], plans: list[curriculum.StagePlan],
                 *, force: bool) -> tuple[dict[str, Any], list[str], list[curriculum.StagePlan]]:
    """The checkpoint's meta once it is shown to fit this run (settings, data, batch, layout, its own files), what
    differs and was accepted by `force`, and the plans with the stage lengths it actually ran (stages that ended
    early on eval patience keep their length; the samplers keep the planned one)."""
    meta = checkpoint.read_meta(ckpt)
    forced = checkpoint.check_resumable(meta, ckpt, invariants_hash=identity["recipe_hash"],
                                        effective_batch=identity["effective_batch"], strategy=identity["strategy"],
                                        world_size=identity["world_size"], force=force,
                                        stage_batches=identity["stage_batches"], invariants=identity["invariants"],
                                        data_files=identity["data_files"])
    checkpoint.check_integrity(accelerator, ckpt, meta)
    plans = curriculum.apply_stage_steps(plans, RunState.from_meta(meta).stage_steps or [p.steps for p in plans])
    return meta, forced, plans


def resume_run(run: Run, ckpt: Path, meta: dict[str, Any], forced: list[str]) -> None:
    """Load the checkpoint into the prepared objects (weights, optimizer, scheduler, RNG) and the run state."""
    how = checkpoint.restore(run.accelerator, run.model, run.optimizer, run.scheduler, ckpt,
                             strategy=run.identity["strategy"])
    run.restore(RunState.from_meta(meta))
    log.info("resumed (%s) from %s: step %d of %d, stage '%s'", f"{how}, forced past differences" if forced
             else how, ckpt, run.resumed.step, run.plans[-1].end_step, meta["stage"])
    for difference in forced:
        log.warning("checkpoint.resume_force: resumed despite %s", difference)


def claim_output_dir(recipe: Recipe, accelerator: Accelerator) -> tuple[RunLock, Path | None]:
    """Take the run lock (one writer per output dir: a second launch, or a requeue while an orphaned trainer runs,
    stops here) and the checkpoint to resume from, refusing to overwrite an earlier run's outputs. The caller
    holds the lock object for the whole run: the lock goes with it."""
    out, ck = Path(recipe.output_dir), recipe.checkpoint
    layout = RunLayout(out)
    lock = RunLock(layout)
    busy = distributed.broadcast_from_main(accelerator, lock.acquire() if accelerator.is_main_process else None)
    if busy is not None:
        raise ToolkitError(f"output_dir {out}: {busy}.")
    resume_from = checkpoint.find_resume(ck.resume, layout.checkpoints)
    if ck.resume == "none" and checkpoint.committed_checkpoints(layout.checkpoints):
        raise ToolkitError(f"{out} already holds checkpoints of an earlier run and checkpoint.resume is none: "
                           "they would be overwritten. Use resume: auto to continue it, or a new output_dir.")
    if resume_from is None:
        check_not_an_earlier_run(out)
    return lock, resume_from


def prepare_inputs(recipe: Recipe, accelerator: Accelerator, model_path: str, *, vision: bool, create_dummy: bool,
                   dummy_samples: int) -> tuple[Any, Any, Path]:
    """(processor, tokenizer, dummy data dir): the model's processor (vision-language; its tokenizer is saved with
    the model) or tokenizer, and the generated dummy data files the recipe uses, written once per machine."""
    if create_dummy:  # stages not already on dummy data get the generated files
        use_dummy_data(recipe, vision=vision)
    if vision:  # the processor formats image rows; its tokenizer is saved with the model
        processor = load_processor(model_path, trust_remote_code=recipe.model.trust_remote_code,
                                   chat_template=recipe.data.chat_template)
        tokenizer = processor.tokenizer
    else:
        processor = tokenizer = load_tokenizer(model_path, trust_remote_code=recipe.model.trust_remote_code,
                                               chat_template=recipe.data.chat_template)
    dummy_dir = RunLayout(recipe.output_dir).dummy_data
    if uses_dummy_data(recipe) and accelerator.is_local_main_process:
        write_dummy_data(dummy_dir, dummy_samples, seed=recipe.train.seed)
        if vision:
            from toolkit.dummy_data import write_dummy_vl_data

            write_dummy_vl_data(dummy_dir, dummy_samples, seed=recipe.train.seed)
    accelerator.wait_for_everyone()
    return processor, tokenizer, dummy_dir


def plan_curriculum(recipe: Recipe, stages: list[TrainingSet], *, world_size: int,
                    global_batch: int) -> tuple[list[curriculum.StagePlan], list[StageSampler]]:
    """Each stage placed on the step axis (steps, lr schedule, batch) and its sampler (mixture, order, pacing).
    With optimizer.lr_scaling the stages' lrs scale with the global batch over the reference batch size."""
    opt, sch, micro = recipe.optimizer, recipe.schedule, recipe.train.micro_batch_size
    lr_scale = 1.0
    if opt.lr_scaling != "none":
        ratio = global_batch / opt.reference_batch_size
        lr_scale = ratio if opt.lr_scaling == "linear" else math.sqrt(ratio)
    plans = curriculum.plan_stages(
        [s.name for s in recipe.stages], [len(src.samples) for src in stages],
        micro_batches=[s.micro_batch_size or micro for s in recipe.stages], grad_accum=recipe.train.grad_accum,
        world_size=world_size, epochs=[s.epochs for s in recipe.stages], max_steps=[s.max_steps for s in recipe.stages],
        lrs=[(s.lr or opt.lr) * lr_scale for s in recipe.stages],
        warmup_ratios=[sch.warmup_ratio if s.warmup_ratio is None else s.warmup_ratio for s in recipe.stages],
        min_lr_ratios=[sch.min_lr_ratio if s.min_lr_ratio is None else s.min_lr_ratio for s in recipe.stages],
        schedules=[s.schedule or sch.kind for s in recipe.stages], decay_ratio=sch.decay_ratio)
    samplers = [StageSampler(sizes=src.sizes, weights=stage.weights, replacement=stage.mixture_replacement,
                             order=stage.order, difficulty=None if src.difficulty is None else np.array(src.difficulty),
                             lengths=np.array(src.lengths), seed=recipe.train.seed, stage_index=plan.index,
                             pacing=Pacing(stage.pacing.kind, stage.pacing.start_fraction) if stage.pacing else None,
                             global_batch=plan.global_batch, total_steps=plan.steps)
                for stage, src, plan in zip(recipe.stages, stages, plans, strict=True)]
    return plans, samplers


def build_batch_collator(recipe: Recipe, processor: Any, *, vision: bool) -> Any:
    """Rows to a padded batch: the VL collator (images), the packing collator (flattened rows), or plain padding."""
    if vision:
        from toolkit.collate import VLCollator

        return VLCollator(processor, min_pixels=recipe.data.min_pixels, max_pixels=recipe.data.max_pixels)
    return PackedCollator() if recipe.data.packing else build_collator(processor)


def write_run_files(recipe: Recipe, accelerator: Accelerator, run_name: str, plans: list[curriculum.StagePlan],
                    trainable_params: list[int], *, resumed_at: int | None) -> None:
    """Outputs, created only now that every input was validated: recipe.yaml, run.json, and metrics.jsonl started
    afresh (or cut back to the resumed step: the steps after it are redone)."""
    if not accelerator.is_main_process:
        return
    layout = RunLayout(recipe.output_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.recipe.write_text(recipe_to_yaml(recipe))
    world = accelerator.num_processes
    layout.run_json.write_text(json.dumps({
        "run_name": run_name, "strategy": strategies.strategy_name(accelerator), "num_processes": world,
        "effective_batch": recipe.train.micro_batch_size * recipe.train.grad_accum * world,
        "mixed_precision": accelerator.mixed_precision, "stages": [p.__dict__ for p in plans],
        "trainable_params": trainable_params,
        "versions": {m: importlib.metadata.version(m) for m in ("torch", "transformers", "accelerate", "peft")}
        | {"toolkit": __version__}}, indent=2))
    if resumed_at is None:
        layout.metrics.unlink(missing_ok=True)
    else:
        truncate_after(layout.metrics, resumed_at)


def assemble_run(recipe: Recipe, accelerator: Accelerator, model: Any, optimizer: Any, trainable: TrainablePlan, *,
                 preemption: PreemptionFlag, plans: list[curriculum.StagePlan], stages: list[TrainingSet],
                 samplers: list[StageSampler], stage_eval: list[list[dict[str, Any]]], collate: Any,
                 identity: dict[str, Any]) -> Run:
    """The prepared model and optimizer wired with what the loop needs: per-stage freezing, the LR schedule, the
    stability guard, the meters, metrics.jsonl and the checkpoint manager."""
    layout, ck, opt = RunLayout(recipe.output_dir), recipe.checkpoint, recipe.optimizer
    stab = recipe.stability
    run = Run(recipe, accelerator, model, optimizer, None,
              freezer.StageFreezer(accelerator, model, optimizer, trainable.groups),
              StabilityGuard(spike_factor=stab.loss_spike_factor, spike_window=stab.loss_spike_window,
                             max_consecutive_skips=stab.max_consecutive_skips),
              Meter(accelerator.device), MetricsLog(layout.metrics, enabled=accelerator.is_main_process),
              checkpoint.CheckpointManager(layout.checkpoints, keep_last=ck.keep_last, best_metric=ck.best_metric,
                                           best_mode=ck.best_mode, is_main=accelerator.is_main_process,
                                           barrier=accelerator.wait_for_everyone),
              preemption, plans, stages, samplers, stage_eval, collate, trainable.stage_counts, identity,
              text_config=accelerator.unwrap_model(model).config.get_text_config(),
              max_norm=opt.max_grad_norm if opt.max_grad_norm > 0 else math.inf,
              peak_flops=peak_flops(distributed.device_name(accelerator), recipe.logging.peak_tflops),
              lr_at=curriculum.build_lr_lambda(plans, recipe.schedule.kind))
    # The lambda reads `run.lr_at` when called: an early stage advance rebinds it to the moved-up stages' schedule.
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: run.lr_at(step))
    accelerator.register_for_checkpointing(run.scheduler)  # we step it ourselves, so accelerate does not own it
    return run


def run_identity(recipe: Recipe, accelerator: Accelerator, plans: list[curriculum.StagePlan], *, run_name: str,
                 model_path: str, data_files: dict[str, str]) -> dict[str, Any]:
    """What every checkpoint's meta.json says about the run itself (not its progress): a resume checks it."""
    world, settings = accelerator.num_processes, resume_invariants(recipe)
    return {"world_size": world, "strategy": strategies.strategy_name(accelerator),
            "effective_batch": recipe.train.micro_batch_size * recipe.train.grad_accum * world,
            "stage_batches": [p.global_batch for p in plans], "lora": recipe.lora.enabled,
            "recipe_hash": checkpoint.recipe_hash(settings), "invariants": settings, "data_files": data_files,
            "run_name": run_name, "base_model": model_path, "toolkit_version": __version__}


def check_last_steps_applied(guard: StabilityGuard, out: Path) -> None:
    """A run whose last steps were skipped does not end in success: its weights are not where training ended."""
    if guard.consecutive:
        last_good = checkpoint.committed_checkpoints(RunLayout(out).checkpoints)
        raise ToolkitError(
            f"Training ended with its last {guard.consecutive} step(s) skipped ({guard.last_reason}); final/ was "
            f"not written. Last checkpoint: {last_good[-1] if last_good else 'none'}. Lower the learning rate or "
            "check the data, then resume from a checkpoint before the trouble began.")


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
    return Path(recipe.data.cache_dir or RunLayout(recipe.output_dir).tokenized)


def data_fingerprint(recipe: Recipe, dummy_dir: Path) -> dict[str, str]:
    """sha256 of every data file the run reads (training and eval), by its recipe entry. Stored in checkpoints:
    a resume on data that changed since is refused (the steps left would see other samples)."""
    entries = sorted({p for s in recipe.stages for p in [*s.paths, *(s.eval or [])]} | set(recipe.eval.data))
    paths = resolve_data_paths(entries, dummy_dir)
    cache = tokenized_cache_dir(recipe)
    return {entry: content_digest(path, cache) for entry, path in zip(entries, paths, strict=True)}


def load_curriculum_data(recipe: Recipe, tokenizer: Any, processor: Any | None, dummy_dir: Path,
                         accelerator: Accelerator) -> tuple[list[TrainingSet], list[list[dict[str, Any]]]]:
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
            from toolkit.vl_data import vl_encoder

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
            src = load_training_set(resolve_data_paths(stage.paths, dummy_dir), tokenizer, packing=recipe.data.packing,
                                     needs_difficulty=stage.order == "easy_to_hard", cache_dir=cache, **settings(stage))
        if not src.samples:
            raise ToolkitError(f"Stage '{stage.name}' has no usable rows ({src.stats.summary()}). Check its data.")
        log.info("stage '%s' data: %s%s", stage.name, src.stats.summary(),
                 f"; packed into {len(src.samples)} rows" if recipe.data.packing else "")
        stages.append(src)
    evals = []  # one per stage (the same files when they come from eval.data)
    for stage in recipe.stages:
        files = stage.eval if stage.eval is not None else recipe.eval.data
        evals.append(encode_files(resolve_data_paths(files, dummy_dir), tokenizer, **settings(stage)).samples
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
    if recipe.data.packing:
        check_packing_support(model)
    trainable = plan_trainable(model, entries, keys, lora=recipe.lora.enabled)
    total = count_parameters(model)[1]
    for stage, count in zip(recipe.stages, trainable.stage_counts, strict=True):
        log.info("stage '%s' trains %d of %d parameters (%.3f%%)", stage.name, count, total, 100 * count / total)
    return model, trainable


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
