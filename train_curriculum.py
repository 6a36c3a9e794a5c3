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
import importlib.metadata
import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig

from toolkit import __version__, checkpoint, distributed, strategies
from toolkit.atomic import write_text_atomic
from toolkit.attention import choose_attention
from toolkit.collate import batch_collator
from toolkit.config import (
    Recipe,
    ResolvedStage,
    flat_config,
    load_recipe,
    recipe_to_yaml,
    resolve_stages,
    resume_invariants,
)
from toolkit.curriculum import Curriculum, StagePlan, build_curriculum
from toolkit.data.batching import StageBatches
from toolkit.errors import ToolkitError, out_of_space
from toolkit.evals import Evaluator, GenerationPlan, import_scorers, load_generation_plan
from toolkit.flops import peak_flops
from toolkit.forgetting import prune_after
from toolkit.freezer import StageFreezer
from toolkit.fused_layers import check_fused_layers, install_fused_layers, resolve_fused_layers
from toolkit.guards import StabilityGuard
from toolkit.last_words import FAILED_EXIT_CODE, LastWords
from toolkit.loop import Run, RunState, after_step, enter_stage, run_step
from toolkit.loss_head import check_loss_head, install_loss_head
from toolkit.metrics import Meter, MetricsLog, check_trackers, read_metrics, truncate_after
from toolkit.model import (
    check_model_source,
    check_remote_code,
    count_parameters,
    enable_gradient_checkpointing,
    is_vision_language,
    load_model,
    load_processing,
    materialize_builtin,
    resolve_dtype,
    setup_lora,
    skip_adapter_input_casts,
    upcast_trainable,
)
from toolkit.model_card import StageCard, build_model_card, describe_chat_template, final_results, stage_results
from toolkit.packing import check_packing_support
from toolkit.preemption import (
    INTERRUPTED_EXIT_CODE,
    INTERRUPTED_LINE,
    PREEMPTED_EXIT_CODE,
    PreemptionFlag,
    Stopped,
    exit_code,
)
from toolkit.run_data import (
    data_fingerprint,
    hub_datasets,
    load_curriculum_data,
    loader_workers,
    store_checksums,
    tokenized_cache_dir,
    use_dummy_data,
    uses_dummy_data,
    write_dummy_files,
)
from toolkit.run_dir import RunLayout, RunLock, check_output_dir, set_aside_earlier_attempt
from toolkit.strategies.deepspeed import configure_deepspeed
from toolkit.trainable import TrainablePlan, plan_trainable

log = logging.getLogger("toolkit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="Recipe YAML (default: the embedded tiny demo recipe).")
    p.add_argument("--create_dummy_data", action="store_true", help="Train every stage on generated dummy data.")
    p.add_argument("--num_dummy_samples", type=int, default=256, help="Rows per dummy data file.")
    p.add_argument("overrides", nargs="*", help="Recipe overrides, e.g. optimizer.lr=1e-4 stages.0.max_steps=5")
    return p.parse_intermixed_args(argv)  # overrides may come before, between and after the options


def train(recipe: Recipe, *, create_dummy: bool, dummy_samples: int, ending: LastWords,
          preemption: PreemptionFlag, config: str | None = None) -> int:
    """One run of `recipe` (read from the --config file `config`; None: the embedded default). A stop signal ends it
    at once until the first step begins (`Stopped`: nothing to save yet), and from then on after the step it is in,
    with a checkpoint (toolkit/preemption.py)."""
    out = Path(recipe.output_dir)
    layout = RunLayout(out)
    ending.layout = layout  # a stop names the checkpoint a relaunch resumes from
    micro, accum = recipe.train.micro_batch_size, recipe.train.grad_accum
    check_output_dir(out)
    # User scorer functions, imported before anything heavy (from the recipe's folder).
    scorers = import_scorers(recipe, Path(config).parent if config else Path.cwd())
    # A built-in tiny model is written (if missing) by every process before the process group exists: once it does,
    # transformers' save_pretrained writes weights on global rank 0 only, so another node's copy would have none.
    # Processes building at once are safe (each builds aside; the first rename wins, the copies are identical).
    model_path = materialize_builtin(recipe.model.name_or_path, layout.cache)

    # --- Accelerator: the launch config decides the strategy; we only pass what the recipe owns. ---
    check_trackers(recipe.logging.trackers)
    check_loss_head(recipe.model.loss_head)  # a kernel that cannot run here fails before the data work
    check_fused_layers(recipe.model.fused_layers)
    accelerator = distributed.build_accelerator(accum, recipe.distributed.timeout_minutes,
                                                log_with=recipe.logging.trackers or None,
                                                project_dir=str(layout.trackers))
    ending.watch(layout)  # should this rank stop unexpectedly, the others can name it
    world, strategy = accelerator.num_processes, strategies.strategy_name(accelerator)
    global_batch = micro * accum * world
    log.setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)  # one line per event
    # Decided once on rank 0 and shared: clocks of different nodes disagree.
    run_name = distributed.broadcast_from_main(accelerator, recipe.run_name or time.strftime("%Y%m%d-%H%M%S"))
    log.info("run %s: strategy %s, %d process(es) on %s; effective batch = %d micro x %d accum x %d processes = %d",
             run_name, strategy, world, accelerator.device, micro, accum, world, global_batch)
    _lock, resume_from = claim_output_dir(layout, recipe.checkpoint.resume, accelerator)  # held until exit

    # --- Data: tokenised and validated before the model is loaded, so bad input fails in seconds. ---
    check_model_source(model_path)
    check_remote_code(model_path, trust_remote_code=recipe.model.trust_remote_code)
    vision = is_vision_language(model_path, trust_remote_code=recipe.model.trust_remote_code)
    if create_dummy:  # stages not already on dummy data get the generated files
        use_dummy_data(recipe.stages, vision=vision)
    if resume_from is None:  # the recipe is final now: it tells an interrupted attempt of this run from another run
        start_afresh(layout, recipe, accelerator)
    resolved = resolve_stages(recipe)  # each stage's effective settings, from here on
    processor, tokenizer = prepare_inputs(recipe, resolved, accelerator, model_path, layout.dummy_data,
                                          vision=vision, dummy_samples=dummy_samples)
    cache = tokenized_cache_dir(recipe.data.cache_dir, out)
    curriculum = build_stages(recipe, resolved, accelerator, tokenizer, processor if vision else None,
                              layout.dummy_data, cache)
    collate = batch_collator(processor if vision else tokenizer, vision=vision, packing=recipe.data.packing,
                             min_pixels=recipe.data.min_pixels, max_pixels=recipe.data.max_pixels,
                             model_config=AutoConfig.from_pretrained(
                                 model_path, trust_remote_code=recipe.model.trust_remote_code) if vision else None)
    generation = load_generation_plan(recipe, resolved, scorers, processor if vision else tokenizer,
                                      layout.dummy_data, vision=vision)
    identity = run_identity(recipe, accelerator, curriculum.plans, run_name=run_name, model_path=model_path,
                            data_files=data_fingerprint(resolved, layout.dummy_data, cache),
                            data_stores=store_checksums([s.data for s in curriculum.stages],
                                                        [s.eval_rows for s in curriculum.stages]))
    hub = hub_datasets(resolved, layout.dummy_data)  # for the model card, while every entry is known to resolve
    resume_meta, forced = {}, []
    if resume_from is not None:  # before loading the model: a mismatch should fail in seconds
        resume_meta, forced = check_resume(accelerator, resume_from, identity, force=recipe.checkpoint.resume_force)

    # --- Model: same seed on every rank so LoRA init agrees (ZeRO-3 / FSDP shard each rank's own copy). ---
    set_seed(recipe.train.seed)
    model, trainable = build_model(recipe, resolved, model_path, vision=vision,
                                   mixed_precision=accelerator.mixed_precision)
    curriculum.set_trainable_params(trainable.stage_counts)
    identity["state"] = checkpoint.state_signature(model, trainable.groups)
    if resume_from is not None:  # before its weights load: a model that cannot hold them is refused, even forced
        checkpoint.check_state(resume_meta, resume_from, identity["state"], identity["invariants"])
    set_seed(recipe.train.seed, device_specific=True)  # from here on (dropout), each rank its own stream

    # --- Optimizer and schedule: base lr 1.0 so the LambdaLR returns the absolute per-stage lr. ---
    # Every parameter that trains in some stage is in the optimizer from the start, one param group per set of
    # stages it trains in; the StageFreezer below withholds the updates of the groups a stage freezes.
    opt = recipe.optimizer
    # DeepSpeed's train_micro_batch_size_per_gpu never sizes our batches (we feed them ourselves): it only sizes
    # its own deepspeed_io loader (unused), its samples/throughput counters and its check that train_batch_size =
    # micro x accum x processes. No one value fits every stage; the first stage's is the batch the engine sees
    # first, and it is the recipe's own value (train.micro_batch_size alone may be overridden by every stage).
    configure_deepspeed(accelerator, model, resolved[0].micro_batch_size, opt.max_grad_norm)
    optimizer = distributed.build_optimizer(accelerator, trainable.param_groups(model), lr=1.0,
                                            weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps)

    # --- Prepare: wraps model and optimizer for the strategy (DDP, FSDP2 sharding, DeepSpeed engine). ---
    model, optimizer = accelerator.prepare(model, optimizer)
    run = assemble_run(recipe, layout, accelerator, model, optimizer, trainable, preemption=preemption,
                       curriculum=curriculum, collate=collate, identity=identity, generation=generation,
                       num_workers=loader_workers(recipe.data, vision=vision))

    # --- Resume: weights, optimizer, scheduler, RNG and the run state; the data position is a function of the step.
    if resume_from is not None:
        resume_run(run, resume_from, resume_meta, forced)
    write_run_files(recipe, layout, accelerator, identity, curriculum.plans, trainable.stage_counts,
                    resumed_at=None if run.resumed is None else run.resumed.step)
    ending.run_folder_ready()  # from here on an unexpected end's traceback goes to <output_dir>/logs
    accelerator.init_trackers(run_name, config=flat_config(recipe))

    # --- The loop: one iteration = one optimizer step over a global batch of the current stage. ---
    model.train()
    step = run.resumed.step if run.resumed else 0
    preemption.training()  # a signal from here on finishes the step it is in, saves and exits
    run.bar = tqdm(total=curriculum.end_step, initial=step,
                   disable=not (accelerator.is_main_process and recipe.logging.progress_bar))
    while step < curriculum.end_step:  # the end moves up when a stage ends early
        stage, step_in_stage = curriculum.locate(step)
        if stage.index != run.current_stage:
            enter_stage(run, stage, step)
        result = run_step(run, stage, step_in_stage, step)
        if (code := after_step(run, stage, step_in_stage, step + 1, result)) is not None:
            return code
        step += 1
    run.bar.close()
    check_last_steps_applied(run.guard, layout)

    # --- Save: gathered adapter (or full model) + tokenizer / processor, usable with from_pretrained. ---
    card = model_card(recipe, config, curriculum, layout, processor, vision=vision, datasets=hub) \
        if accelerator.is_main_process else None  # metrics.jsonl is rank 0's
    final = checkpoint.save_final(accelerator, model, processor, layout.final, card=card)
    log.info("done. metrics: %s  final model: %s  (%d steps skipped)", layout.metrics, final,
             run.guard.total_skipped)
    distributed.finish_trackers(accelerator)
    return 0


def check_resume(accelerator: Accelerator, ckpt: Path, identity: dict[str, Any], *,
                 force: bool) -> tuple[dict[str, Any], list[str]]:
    """The checkpoint's meta once it is shown to fit this run (settings, data, batch, layout, its own files), and
    what differs and was accepted by `force`."""
    meta = checkpoint.read_meta(ckpt)
    forced = checkpoint.check_resumable(meta, ckpt, invariants_hash=identity["recipe_hash"],
                                        effective_batch=identity["effective_batch"], strategy=identity["strategy"],
                                        world_size=identity["world_size"], force=force,
                                        stage_batches=identity["stage_batches"], invariants=identity["invariants"],
                                        stage_steps=identity["stage_plan_steps"],
                                        data_files=identity["data_files"], data_stores=identity["data_stores"])
    checkpoint.check_integrity(accelerator, ckpt, meta)
    return meta, forced


def resume_run(run: Run, ckpt: Path, meta: dict[str, Any], forced: list[str]) -> None:
    """Load the checkpoint into the prepared objects (weights, optimizer, scheduler, RNG) and the run state (with
    the curriculum's: stages that ended early on eval patience keep their length)."""
    restored = checkpoint.restore(run.accelerator, run.model, run.optimizer, run.scheduler, ckpt,
                                  strategy=run.identity["strategy"], seed=run.recipe.train.seed)
    run.restore(RunState.from_meta(meta))
    if forced:  # the loaded optimizer holds the checkpointed recipe's lr (for the next step), weight decay, betas
        opt = run.recipe.optimizer  # and eps (torch's load_state_dict restores them): the forced ones apply now
        for group, base, lr_at in zip(run.optimizer.param_groups, run.scheduler.base_lrs, run.scheduler.lr_lambdas,
                                      strict=True):
            group.update(lr=base * lr_at(run.scheduler.last_epoch), weight_decay=opt.weight_decay,
                         betas=tuple(opt.betas), eps=opt.eps)
    how = f"{restored.how}, forced past differences" if forced else restored.how
    (log.warning if restored.lost else log.info)("resumed (%s) from %s: step %d of %d, stage '%s'", how, ckpt,
                                                 run.resumed.step, run.curriculum.end_step, meta["stage"])
    for difference in forced:
        log.warning("checkpoint.resume_force: resumed despite %s", difference)


def claim_output_dir(layout: RunLayout, resume: str, accelerator: Accelerator) -> tuple[RunLock, Path | None]:
    """Take the run lock (one writer per output dir, however its path is spelled: a second launch, or a requeue
    while an orphaned trainer runs, stops here) and the checkpoint to resume from, refusing to overwrite an earlier
    run's checkpoints. The caller holds the lock object for the whole run: the lock goes with it."""
    out, lock = layout.root, RunLock(layout)
    busy = distributed.broadcast_from_main(accelerator, lock.acquire() if accelerator.is_main_process else None)
    if busy is not None:
        raise ToolkitError(f"output_dir {out}: {busy}.")
    resume_from = checkpoint.find_resume(resume, layout.checkpoints)
    if resume == "none" and checkpoint.committed_checkpoints(layout.checkpoints):
        raise ToolkitError(f"{out} already holds checkpoints of an earlier run and checkpoint.resume is none: "
                           "they would be overwritten. Use resume: auto to continue it, or a new output_dir.")
    return lock, resume_from


def start_afresh(layout: RunLayout, recipe: Recipe, accelerator: Accelerator) -> None:
    """A run with no checkpoint to resume, in a folder that may hold an earlier run's outputs: rank 0 sets aside
    the records of an interrupted attempt of this recipe, or refuses (a finished run, another recipe's), and every
    rank stops with that refusal (toolkit/run_dir.py, set_aside_earlier_attempt)."""
    refusal = None
    if accelerator.is_main_process:
        try:
            set_aside_earlier_attempt(layout, resume_invariants(recipe))
        except ToolkitError as e:
            refusal = str(e)
    refusal = distributed.broadcast_from_main(accelerator, refusal)
    if refusal is not None:
        raise ToolkitError(refusal)


def prepare_inputs(recipe: Recipe, resolved: list[ResolvedStage], accelerator: Accelerator, model_path: str,
                   dummy_dir: Path, *, vision: bool, dummy_samples: int) -> tuple[Any, Any]:
    """(processor, tokenizer): the model's processor (vision-language; its tokenizer is saved with the model) or
    tokenizer; and the generated dummy data files the stages use, written to `dummy_dir` once per machine."""
    processor, tokenizer = load_processing(model_path, vision=vision, trust_remote_code=recipe.model.trust_remote_code,
                                           chat_template=recipe.data.chat_template)
    if uses_dummy_data(resolved) and accelerator.is_local_main_process:
        write_dummy_files(dummy_dir, dummy_samples, seed=recipe.train.seed, vision=vision)
    accelerator.wait_for_everyone()
    return processor, tokenizer


def build_stages(recipe: Recipe, resolved: list[ResolvedStage], accelerator: Accelerator, tokenizer: Any,
                 processor: Any | None, dummy_dir: Path, cache: Path | None) -> Curriculum:
    """The curriculum: every stage's rows (loaded and tokenised once, cached), planned on the step axis with its
    sampler; lr_scaling scales each stage's lr by its own global batch."""
    training_sets, eval_rows = load_curriculum_data(resolved, recipe.data, tokenizer, processor, dummy_dir, cache)
    opt = recipe.optimizer
    return build_curriculum(resolved, training_sets, eval_rows, grad_accum=recipe.train.grad_accum,
                            world_size=accelerator.num_processes, seed=recipe.train.seed,
                            default_schedule=recipe.schedule.kind, lr_scaling=opt.lr_scaling,
                            reference_batch_size=opt.reference_batch_size)


def write_run_files(recipe: Recipe, layout: RunLayout, accelerator: Accelerator, identity: dict[str, Any],
                    plans: list[StagePlan], trainable_params: list[int], *, resumed_at: int | None) -> None:
    """Outputs, created only now that every input was validated: recipe.yaml, run.json, and metrics.jsonl started
    afresh (or cut back to the resumed step: the steps after it are redone)."""
    if not accelerator.is_main_process:
        return
    layout.root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(layout.recipe, recipe_to_yaml(recipe))  # export reads both: never half-written
    write_text_atomic(layout.run_json, json.dumps({
        "run_name": identity["run_name"], "strategy": identity["strategy"], "num_processes": identity["world_size"],
        "effective_batch": identity["effective_batch"],
        "mixed_precision": accelerator.mixed_precision, "stages": [p.__dict__ for p in plans],
        "trainable_params": trainable_params,
        "versions": {m: importlib.metadata.version(m) for m in ("torch", "transformers", "accelerate", "peft")}
        | {"toolkit": __version__}}, indent=2))
    if resumed_at is None:
        layout.metrics.unlink(missing_ok=True)
    else:
        truncate_after(layout.metrics, resumed_at)
        prune_after(layout, resumed_at)  # completions and matrix records of the evals that are redone


def assemble_run(recipe: Recipe, layout: RunLayout, accelerator: Accelerator, model: Any, optimizer: Any,
                 trainable: TrainablePlan, *, preemption: PreemptionFlag, curriculum: Curriculum, collate: Any,
                 identity: dict[str, Any], num_workers: int, generation: GenerationPlan | None = None) -> Run:
    """The prepared model and optimizer wired with what the loop needs: per-stage freezing, the LR schedule, the
    stability guard, the meters, metrics.jsonl, the checkpoint manager, the evaluations and the batches (a
    DataLoader per stage with `num_workers` worker processes)."""
    saving, opt, stab = recipe.checkpoint, recipe.optimizer, recipe.stability
    # The curriculum's own method gives the LR: an early stage advance rebuilds the schedule behind it.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, curriculum.lr_at)
    accelerator.register_for_checkpointing(scheduler)  # we step it ourselves, so accelerate does not own it
    batches = StageBatches(accelerator, collate, grad_accum=recipe.train.grad_accum,
                           group_by_length=recipe.data.group_by_length, num_workers=num_workers)
    return Run(recipe, accelerator, model, optimizer, scheduler,
               StageFreezer(accelerator, model, optimizer, trainable.groups),
               StabilityGuard(spike_factor=stab.loss_spike_factor, spike_window=stab.loss_spike_window,
                              max_consecutive_skips=stab.max_consecutive_skips),
               Meter(accelerator.device), MetricsLog(layout.metrics, enabled=accelerator.is_main_process),
               checkpoint.CheckpointManager(layout.checkpoints, keep_last=saving.keep_last,
                                            best_metric=saving.best_metric, best_mode=saving.best_mode,
                                            is_main=accelerator.is_main_process, barrier=accelerator.wait_for_everyone),
               preemption, curriculum, collate, identity,
               Evaluator(accelerator, curriculum, layout, generation, all_stages=recipe.eval.all_stages,
                         seed=recipe.train.seed),
               batches,
               text_config=accelerator.unwrap_model(model).config.get_text_config(),
               max_norm=opt.max_grad_norm if opt.max_grad_norm > 0 else math.inf,
               peak_flops=peak_flops(distributed.device_name(accelerator), recipe.logging.peak_tflops))


def run_identity(recipe: Recipe, accelerator: Accelerator, plans: list[StagePlan], *, run_name: str,
                 model_path: str, data_files: dict[str, str], data_stores: dict[str, str]) -> dict[str, Any]:
    """What every checkpoint's meta.json says about the run itself (not its progress): a resume checks it."""
    world, settings = accelerator.num_processes, resume_invariants(recipe)
    return {"world_size": world, "strategy": strategies.strategy_name(accelerator),
            "effective_batch": recipe.train.micro_batch_size * recipe.train.grad_accum * world,
            "stage_batches": [p.global_batch for p in plans], "stage_plan_steps": [p.steps for p in plans],
            "lora": recipe.lora.enabled,
            "recipe_hash": checkpoint.recipe_hash(settings), "invariants": settings, "data_files": data_files,
            "data_stores": data_stores,
            "run_name": run_name, "base_model": model_path, "toolkit_version": __version__}


def model_card(recipe: Recipe, config: str | None, curriculum: Curriculum, layout: RunLayout, processor: Any, *,
               vision: bool, datasets: list[str]) -> str | None:
    """final/README.md of the finished run (toolkit/model_card.py): its stages as they ran (lengths after an early
    advance) and its results, read from metrics.jsonl, so a resumed run's card is the uninterrupted run's. None, with
    a warning, when metrics.jsonl cannot be read: the trained weights are saved without their card, not lost."""
    try:
        records = read_metrics(layout.metrics) if layout.metrics.is_file() else []
    except (ToolkitError, OSError) as e:
        log.warning("final/ is written without its model card (README.md): %s", e)
        return None
    outcome = stage_results(records)
    stages = []
    for stage in curriculum.stages:
        settings, plan, got = stage.resolved, stage.plan, outcome.get(stage.name, {})
        stages.append(StageCard(
            name=stage.name, data=list(zip(settings.paths, settings.weights or [None] * len(settings.paths),
                                           strict=True)),
            rows=plan.num_samples, steps=plan.steps, samples=plan.steps * plan.global_batch, lr=plan.lr,
            trainable=list(settings.trainable or []), trainable_params=stage.trainable_params,
            tokens=got.get("tokens"), ended_by=got.get("ended_by"), evals=got.get("last_eval", {})))
    return str(build_model_card(
        title=recipe.run_name or Path(recipe.output_dir).name, base_model=recipe.model.name_or_path,
        lora=recipe.lora.enabled, vision=vision, stages=stages, results=final_results(records),
        chat_template=describe_chat_template(recipe.data.chat_template, getattr(processor, "chat_template", None)),
        recipe_source=config, recipe_yaml=recipe_to_yaml(recipe), toolkit_version=__version__,
        datasets=datasets))


def check_last_steps_applied(guard: StabilityGuard, layout: RunLayout) -> None:
    """A run whose last steps were skipped does not end in success: its weights are not where training ended."""
    if guard.consecutive:
        last_good = checkpoint.committed_checkpoints(layout.checkpoints)
        raise ToolkitError(
            f"Training ended with its last {guard.consecutive} step(s) skipped ({guard.last_reason}); final/ was "
            f"not written. Last checkpoint: {last_good[-1] if last_good else 'none'}. Lower the learning rate or "
            "check the data, then resume from a checkpoint before the trouble began.")


def build_model(recipe: Recipe, resolved: list[ResolvedStage], model_path: str, *, vision: bool,
                mixed_precision: str = "no") -> tuple[torch.nn.Module, TrainablePlan]:
    """The base model with its attention kernel, gradient checkpointing and LoRA, and what trains in each stage.
    `mixed_precision` is the launch's (accelerate's): under autocast LoRA layers keep no fp32 copy of their input.

    Modules that `trainable` patterns name in a LoRA run become PEFT modules_to_save (trained in full, saved with
    the adapter); `plan_trainable` then sets requires_grad on everything that trains in any stage.
    """
    attn = choose_attention(recipe.model.attn_implementation)
    check_loss_head(recipe.model.loss_head)  # a missing kernel fails before the weights load
    dtype = resolve_dtype(recipe.model.dtype, lora=recipe.lora.enabled)
    model_type = AutoConfig.from_pretrained(model_path, trust_remote_code=recipe.model.trust_remote_code).model_type
    fused = resolve_fused_layers(recipe.model.fused_layers, model_type)  # before the weights: kernels that cannot load
    log.info("loading %s (%s, attention=%s%s)", model_path, dtype, attn, ", vision-language" if vision else "")
    model = load_model(model_path, dtype=dtype, attn_implementation=attn,
                       trust_remote_code=recipe.model.trust_remote_code, vision=vision)
    install_fused_layers(model, fused)  # Liger's RMSNorm, RoPE, SwiGLU on CUDA
    if recipe.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    entries, keys = [s.trainable for s in resolved], [s.trainable_key for s in resolved]
    if recipe.lora.enabled:
        lora = recipe.lora
        model = setup_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules,
                           modules_to_save=lora.modules_to_save, exclude_modules=lora.exclude_modules,
                           stage_trainable=entries, trainable_keys=keys)
        if mixed_precision in ("bf16", "fp16"):
            skip_adapter_input_casts(model)  # the adapters compute in 16-bit under autocast: no fp32 input copies
        elif dtype != torch.float32:
            log.warning("model.dtype %s with mixed precision off: the fp32 LoRA adapters compute in fp32, and each "
                        "adapted layer keeps an fp32 copy of its input for backward; launch with --mixed_precision "
                        "bf16 to avoid it", str(dtype).removeprefix("torch."))
    install_loss_head(model, recipe.model.loss_head, recipe.model.loss_chunk_size)  # no full-vocabulary logits
    if recipe.data.packing:
        check_packing_support(model)
    trainable = plan_trainable(model, entries, keys, lora=recipe.lora.enabled)
    if recipe.lora.enabled and dtype != torch.float32:
        upcast_trainable(model)  # modules trained in full over a 16-bit base: fp32, as the adapters
    total = count_parameters(model)[1]
    for stage, count in zip(resolved, trainable.stage_counts, strict=True):
        log.info("stage '%s' trains %d of %d parameters (%.3f%%)", stage.name, count, total, 100 * count / total)
    return model, trainable


def _stopped_on_error(ending: LastWords, e: ToolkitError) -> int:
    """Bad input or a full disk: one line on this rank (exit 2), which the other ranks can name."""
    ending.stopped_on_error(str(e))
    print(f"error: {e}", file=sys.stderr)
    distributed.record_launch_error(f"error: {e}")  # the launcher's failure summary ends with it
    return 2


def _quiet_about_full_disks(args: threading.ExceptHookArgs) -> None:
    """A library's writer thread (TensorBoard's event writer) that stops on a full disk hands the error to the
    training thread's next write, which ends the run in one line: its own traceback would only repeat it."""
    if out_of_space(args.exc_value) is None:
        threading.__excepthook__(args)


def main(argv: list[str] | None = None) -> int:
    """Every rank ends with one line: bad input (exit 2), Ctrl-C (130), or anything unexpected here or on another
    rank (FAILED_EXIT_CODE; the traceback goes to the rank's log file, toolkit/last_words.py)."""
    gpu = distributed.gpu_defaults()  # before anything touches CUDA (its allocator reads its config once)
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    ending = LastWords()
    # Stop signals from here on: before the first step they end the run at once, then after a step with a checkpoint;
    # the launcher's death reaches the trainer as SIGTERM (toolkit/preemption.py).
    preemption = PreemptionFlag(advice=ending.relaunch_advice)
    threading.excepthook = _quiet_about_full_disks
    if torch.cuda.is_available():
        log.info("GPU defaults: %s", ", ".join(gpu) or "none (the allocator config is the user's)")
    try:
        if args.num_dummy_samples < 1:
            raise ToolkitError(f"--num_dummy_samples must be at least 1, got {args.num_dummy_samples}.")
        recipe = load_recipe(args.config, args.overrides)
        code = train(recipe, create_dummy=args.create_dummy_data, dummy_samples=args.num_dummy_samples,
                     ending=ending, preemption=preemption,
                     config=args.config)
        ending.finished()
        return code
    except ToolkitError as e:
        return _stopped_on_error(ending, e)
    except Stopped as e:  # a stop signal before the first step: nothing to save, nothing half-written kept
        return _stopped(ending, preemption, e.signal_name)
    except KeyboardInterrupt:  # one line, not a traceback per frame; committed checkpoints are intact
        ending.interrupted()
        preemption.say_once(INTERRUPTED_LINE)
        return INTERRUPTED_EXIT_CODE
    except Exception as e:  # a bug, or a peer process that died: one line here, the traceback in the rank's log
        if preemption.requested and not preemption.started:  # a collective that failed as its peers stopped too
            return _stopped(ending, preemption, preemption.signal_name or "SIGTERM")
        if (full := out_of_space(e)) is not None:  # a full disk that no writer of ours named (a library's file)
            return _stopped_on_error(ending, full)
        line = ending.unexpected(e)
        print(line, file=sys.stderr)
        distributed.record_launch_error(line)
        return PREEMPTED_EXIT_CODE if ending.stopped_with_a_peer else FAILED_EXIT_CODE
    finally:
        preemption.ended()


def _stopped(ending: LastWords, preemption: PreemptionFlag, signal_name: str) -> int:
    """The end of a run stopped by `signal_name` before its first step: one line, the signal's exit code."""
    preemption.say_once(preemption.stop_line(signal_name))
    ending.stopped(signal_name)  # for the peers' lines (a store that went away may hold it: the watcher ends it)
    return exit_code(signal_name)


if __name__ == "__main__":
    exit_code = main()
    distributed.exit_without_teardown(exit_code)
