"""The set-up of a run, in the order train_curriculum.py calls it: the output folder claimed, inputs and stages
built, the model built with what each stage trains, the run assembled for the loop, and a resume checked and
loaded."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from transformers import AutoConfig

from toolkit import __version__, strategies
from toolkit.atomic import write_text_atomic
from toolkit.builtin.dummy_data import write_dummy_files
from toolkit.checkpoint.manager import CheckpointManager, check_integrity, read_meta
from toolkit.checkpoint.model_card import (
    StageCard,
    build_model_card,
    describe_chat_template,
    final_results,
    portable_tree,
    stage_results,
)
from toolkit.checkpoint.resume import RunIdentity, check_resumable, find_resume, restore
from toolkit.config.identity import recipe_hash, resume_invariants
from toolkit.config.load import recipe_to_yaml
from toolkit.config.schema import Recipe
from toolkit.config.stages import ResolvedStage
from toolkit.curriculum.stages import Curriculum, StagePlan, build_curriculum
from toolkit.data.batching import StageBatches
from toolkit.data.collate import batch_collator
from toolkit.data.frames import ImageStore, writable_store
from toolkit.data.stages import (
    holds_videos,
    load_curriculum_data,
    store_checksums,
    tokenized_cache_dir,
    uses_dummy_data,
)
from toolkit.data.vision import caches_resized
from toolkit.errors import ToolkitError
from toolkit.evals.evaluator import Evaluator, GenerationPlan
from toolkit.evals.forgetting import prune_after
from toolkit.metrics.log import Meter, MetricsLog, check_trackers, read_metrics, truncate_after
from toolkit.model.attention import check_packing_support, choose_attention
from toolkit.model.compile import compile_layers
from toolkit.model.flops import peak_flops
from toolkit.model.fused_layers import check_fused_layers, install_fused_layers, resolve_fused_layers
from toolkit.model.fused_lora import check_fused_lora, install_fused_lora
from toolkit.model.load import (
    check_model_source,
    check_remote_code,
    enable_gradient_checkpointing,
    is_vision_language,
    load_model,
    load_processing,
    resolve_dtype,
    setup_lora,
    skip_adapter_input_casts,
    upcast_trainable,
)
from toolkit.model.loss_head import check_loss_head, install_loss_head
from toolkit.model.params import count_parameters
from toolkit.model.trainable import TrainablePlan, plan_trainable
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout, RunLock, committed_checkpoints, set_aside_earlier_attempt
from toolkit.runtime.signals import PreemptionFlag
from toolkit.strategies import sequence_parallel
from toolkit.train.loop import Run, RunState
from toolkit.train.objectives import objective_of
from toolkit.train.optimizer import StageFreezer
from toolkit.train.pair_stage import describe_objective
from toolkit.train.rl_stage import ROLLOUTS, check_rl_stages
from toolkit.train.scorer_model import check_scorers
from toolkit.train.stability import StabilityGuard
from toolkit.train.stage_scores import check_kept_scores

log = logging.getLogger("toolkit")


def check_resume(accelerator: Accelerator, ckpt: Path, identity: RunIdentity, *,
                 force: bool) -> tuple[dict[str, Any], list[str]]:
    """The checkpoint's meta once it is shown to fit this run (settings, data, batch, layout, its own files), and
    what differs and was accepted by `force`."""
    meta = read_meta(ckpt)
    forced = check_resumable(meta, ckpt, invariants_hash=identity.recipe_hash, effective_batch=identity.effective_batch,
                             strategy=identity.strategy, world_size=identity.world_size, force=force,
                             stage_batches=identity.stage_batches, invariants=identity.invariants,
                             stage_steps=identity.stage_plan_steps, data_files=identity.data_files,
                             data_stores=identity.data_stores)
    check_integrity(accelerator, ckpt, meta)
    return meta, forced


def resume_run(run: Run, ckpt: Path, meta: dict[str, Any], forced: list[str]) -> None:
    """Load the checkpoint into the prepared objects (weights, optimizer, scheduler, RNG) and the run state (with
    the curriculum's: stages that ended early on eval patience keep their length)."""
    restored = restore(run.accelerator, run.model, run.optimizer, run.scheduler, ckpt,
                                  strategy=run.identity.strategy, seed=run.recipe.train.seed)
    run.restore(RunState.from_meta(meta))
    run.resumed_from = ckpt
    run.recorded_digests = dict(meta.get("scores") or {})  # kept scores are checked against these when read
    run.score_digests.update(run.recorded_digests)
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
    check_kept_scores(run, run.resumed.step)  # scores taken before this step: there, or refused before any write


def claim_output_dir(layout: RunLayout, resume: str, accelerator: Accelerator) -> tuple[RunLock, Path | None]:
    """Take the run lock (one writer per output dir, however its path is spelled: a second launch, or a requeue
    while an orphaned trainer runs, stops here) and the checkpoint to resume from, refusing to overwrite an earlier
    run's checkpoints. The caller holds the lock object for the whole run: the lock goes with it."""
    out, lock = layout.root, RunLock(layout)
    busy = distributed.broadcast_from_main(accelerator, lock.acquire() if accelerator.is_main_process else None)
    if busy is not None:
        raise ToolkitError(f"output_dir {out}: {busy}.")
    resume_from = find_resume(resume, layout.checkpoints)
    if resume == "none" and committed_checkpoints(layout.checkpoints):
        raise ToolkitError(f"{out} already holds checkpoints of an earlier run and checkpoint.resume is none: "
                           "they would be overwritten. Use resume: auto to continue it, or a new output_dir.")
    return lock, resume_from


def start_afresh(layout: RunLayout, recipe: Recipe, accelerator: Accelerator) -> None:
    """A run with no checkpoint to resume, in a folder that may hold an earlier run's outputs: rank 0 sets aside
    the records of an interrupted attempt of this recipe, or refuses (a finished run, another recipe's), and every
    rank stops with that refusal (toolkit/runtime/run_dir.py, set_aside_earlier_attempt)."""
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
    tokenizer; and the generated dummy data files the stages use, written to `dummy_dir` once per machine. A stage's
    separate scorer model that cannot score the run's rows (another tokenizer) is refused here, before the data."""
    processor, tokenizer = load_processing(model_path, vision=vision, trust_remote_code=recipe.model.trust_remote_code,
                                           chat_template=recipe.data.chat_template)
    check_scorers(recipe, resolved, tokenizer, vision=vision)
    if uses_dummy_data(resolved) and accelerator.is_local_main_process:
        write_dummy_files(dummy_dir, dummy_samples, seed=recipe.train.seed, vision=vision)
    accelerator.wait_for_everyone()
    return processor, tokenizer


def build_stages(recipe: Recipe, resolved: list[ResolvedStage], accelerator: Accelerator, tokenizer: Any,
                 processor: Any | None, dummy_dir: Path, cache: Path | None) -> Curriculum:
    """The curriculum: every stage's rows (loaded and tokenised once, cached), planned on the step axis with its
    sampler; lr_scaling scales each stage's lr by its own global batch. RL stages are checked first (whole groups
    of completions per global batch, text prompts: toolkit/train/rl_stage.py)."""
    check_rl_stages(resolved, grad_accum=recipe.train.grad_accum, place=sequence_parallel.layout(accelerator),
                    vision=processor is not None)
    training_sets, eval_rows = load_curriculum_data(resolved, recipe.data, tokenizer, processor, dummy_dir, cache)
    opt = recipe.optimizer
    replicas = sequence_parallel.layout(accelerator).dp_size  # the processes of a Ulysses group share rows
    return build_curriculum(resolved, training_sets, eval_rows, grad_accum=recipe.train.grad_accum,
                            world_size=replicas, seed=recipe.train.seed,
                            default_schedule=recipe.schedule.kind, lr_scaling=opt.lr_scaling,
                            reference_batch_size=opt.reference_batch_size)


def write_run_files(recipe: Recipe, layout: RunLayout, accelerator: Accelerator, identity: RunIdentity,
                    plans: list[StagePlan], trainable_params: list[int], *, resumed_at: int | None) -> None:
    """Outputs, created only now that every input was validated: recipe.yaml, run.json, and metrics.jsonl started
    afresh (or cut back to the resumed step: the steps after it are redone)."""
    if not accelerator.is_main_process:
        return
    layout.root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(layout.recipe, recipe_to_yaml(recipe))  # export reads both: never half-written
    write_text_atomic(layout.run_json, json.dumps({
        "run_name": identity.run_name, "strategy": identity.strategy, "num_processes": identity.world_size,
        "effective_batch": identity.effective_batch,
        "mixed_precision": accelerator.mixed_precision, "stages": [p.__dict__ for p in plans],
        "trainable_params": trainable_params,
        "versions": {m: importlib.metadata.version(m) for m in ("torch", "transformers", "accelerate", "peft")}
        | {"toolkit": __version__}}, indent=2))
    rollouts = sorted((layout.root / ROLLOUTS).glob("*.jsonl"))  # RL stages' completions (toolkit/train/rl_stage.py)
    if resumed_at is None:
        layout.metrics.unlink(missing_ok=True)
        for path in rollouts:
            path.unlink()
    else:
        truncate_after(layout.metrics, resumed_at)
        prune_after(layout, resumed_at)  # completions and matrix records of the evals that are redone
        for path in rollouts:  # the steps after the resumed one are drawn again
            truncate_after(path, resumed_at)


def assemble_run(recipe: Recipe, layout: RunLayout, accelerator: Accelerator, model: Any, optimizer: Any,
                 trainable: TrainablePlan, *, preemption: PreemptionFlag, curriculum: Curriculum, collate: Any,
                 identity: RunIdentity, num_workers: int, generation: GenerationPlan | None = None) -> Run:
    """The prepared model and optimizer wired with what the loop needs: per-stage freezing, the LR schedule, the
    stability guard, the meters, metrics.jsonl, the checkpoint manager, the evaluations and the batches (a
    DataLoader per stage with `num_workers` worker processes)."""
    saving, opt, stab = recipe.checkpoint, recipe.optimizer, recipe.stability
    # The curriculum's own method gives the LR: an early stage advance rebuilds the schedule behind it.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, curriculum.lr_at)
    accelerator.register_for_checkpointing(scheduler)  # we step it ourselves, so accelerate does not own it
    batches = StageBatches(accelerator, collate, grad_accum=recipe.train.grad_accum,
                           group_by_length=recipe.data.group_by_length, num_workers=num_workers)
    run = Run(recipe, accelerator, model, optimizer, scheduler,
               StageFreezer(accelerator, model, optimizer, trainable.groups),
               StabilityGuard(spike_factor=stab.loss_spike_factor, spike_window=stab.loss_spike_window,
                              max_consecutive_skips=stab.max_consecutive_skips),
               Meter(accelerator.device), MetricsLog(layout.metrics, enabled=accelerator.is_main_process),
               CheckpointManager(layout.checkpoints, keep_last=saving.keep_last,
                                            best_metric=saving.best_metric, best_mode=saving.best_mode,
                                            is_main=accelerator.is_main_process, barrier=accelerator.wait_for_everyone),
               preemption, curriculum, collate, identity,
               Evaluator(accelerator, curriculum, layout, generation, all_stages=recipe.eval.all_stages,
                         seed=recipe.train.seed),
               batches,
               text_config=accelerator.unwrap_model(model).config.get_text_config(),
               max_norm=opt.max_grad_norm if opt.max_grad_norm > 0 else math.inf,
               peak_flops=peak_flops(distributed.device_name(accelerator), recipe.logging.peak_tflops))
    run.rl.tokenizer = generation.processing if generation is not None else None  # decodes grpo completions
    # A stage's own eval rows under its objective (preference stages' eval pairs, against their reference).
    run.evaluator.pair_eval = lambda model, stage: objective_of(stage).evaluate(run, model, stage)
    return run


def run_identity(recipe: Recipe, accelerator: Accelerator, curriculum: Curriculum, *, run_name: str,
                 model_path: str, data_files: dict[str, str]) -> RunIdentity:
    """This run's identity, which every checkpoint records and a resume checks (its model state is added once the
    model is built)."""
    world, settings, plans = accelerator.num_processes, resume_invariants(recipe), curriculum.plans
    replicas = sequence_parallel.layout(accelerator).dp_size
    return RunIdentity(
        world_size=world, strategy=strategies.strategy_name(accelerator),
        effective_batch=recipe.train.micro_batch_size * recipe.train.grad_accum * replicas,
        stage_batches=[p.global_batch for p in plans], stage_plan_steps=[p.steps for p in plans],
        lora=recipe.lora.enabled, recipe_hash=recipe_hash(settings), invariants=settings, data_files=data_files,
        data_stores=store_checksums([s.data for s in curriculum.stages], [s.eval_rows for s in curriculum.stages]),
        run_name=run_name, base_model=model_path, toolkit_version=__version__)


def check_last_steps_applied(guard: StabilityGuard, layout: RunLayout) -> None:
    """A run whose last steps were skipped does not end in success: its weights are not where training ended."""
    if guard.consecutive:
        last_good = committed_checkpoints(layout.checkpoints)
        raise ToolkitError(
            f"Training ended with its last {guard.consecutive} step(s) skipped ({guard.last_reason}); final/ was "
            f"not written. Last checkpoint: {last_good[-1] if last_good else 'none'}. Lower the learning rate or "
            "check the data, then resume from a checkpoint before the trouble began.")


def build_model(recipe: Recipe, resolved: list[ResolvedStage], model_path: str, *, vision: bool,
                mixed_precision: str = "no", sp_attention: str | None = None) -> tuple[torch.nn.Module, TrainablePlan]:
    """The base model with its attention kernel, gradient checkpointing and LoRA, and what trains in each stage.
    `mixed_precision` is the launch's (accelerate's): under autocast LoRA layers keep no fp32 copy of their input.

    Modules that `trainable` patterns name in a LoRA run become PEFT modules_to_save (trained in full, saved with
    the adapter); `plan_trainable` then sets requires_grad on everything that trains in any stage.
    `sp_attention`: the accelerate config's `parallelism_config_sp_attn_implementation` under Ulysses.
    """
    requested = recipe.model.attn_implementation
    if sp_attention is not None:
        requested = sequence_parallel.attention_request(requested, sp_attention)
    attn = choose_attention(requested)
    check_loss_head(recipe.model.loss_head)  # a missing kernel fails before the weights load
    dtype = resolve_dtype(recipe.model.dtype, lora=recipe.lora.enabled)
    model_type = AutoConfig.from_pretrained(model_path, trust_remote_code=recipe.model.trust_remote_code).model_type
    fused = resolve_fused_layers(recipe.model.fused_layers, model_type)  # before the weights: kernels that cannot load
    log.info("loading %s (%s, attention=%s%s)", model_path, dtype, attn, ", vision-language" if vision else "")
    model = load_model(model_path, dtype=dtype, attn_implementation=attn,
                       trust_remote_code=recipe.model.trust_remote_code, vision=vision)
    install_fused_layers(model, fused)  # Liger's RMSNorm, RoPE, SwiGLU on CUDA
    if recipe.model.gradient_checkpointing:
        recomputed = enable_gradient_checkpointing(model, recipe.model.gradient_checkpointing)
        log.info("gradient checkpointing: %d decoder layer(s) recompute their activations in backward", recomputed)
    entries, keys = [s.trainable for s in resolved], [s.trainable_key for s in resolved]
    if recipe.lora.enabled:
        lora = recipe.lora
        model = setup_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules,
                           modules_to_save=lora.modules_to_save, exclude_modules=lora.exclude_modules,
                           stage_trainable=entries, trainable_keys=keys)
        install_fused_lora(model, lora.fused)  # PEFT's module objects stay: only their forward is swapped
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
    if recipe.train.compile:  # last: the traced layers are the ones that train
        compile_layers(model, row_length=max(s.max_seq_len for s in resolved), packing=recipe.data.packing)
    total = count_parameters(model)[0]
    for stage, count in zip(resolved, trainable.stage_counts, strict=True):
        log.info("stage '%s' trains %d of %d parameters (%.3f%%)", stage.name, count, total, 100 * count / total)
    return model, trainable


def start_accelerator(recipe: Recipe, layout: RunLayout) -> Accelerator:
    """The Accelerator of the launch's strategy, with the recipe's accumulation, collective timeout and trackers;
    a tracker, loss head, fused-layer kernel or fused LoRA layer that cannot run here fails first."""
    check_trackers(recipe.logging.trackers)
    check_loss_head(recipe.model.loss_head)  # a kernel that cannot run here fails before the data work
    check_fused_layers(recipe.model.fused_layers)
    accelerator = distributed.build_accelerator(recipe.train.grad_accum, recipe.distributed.timeout_minutes,
                                                log_with=recipe.logging.trackers or None,
                                                project_dir=str(layout.trackers))
    if recipe.lora.enabled:  # fused LoRA layers that cannot run under this strategy fail before the data work
        check_fused_lora(recipe.lora.fused, strategies.strategy_name(accelerator))
    return accelerator


def name_run(recipe: Recipe, accelerator: Accelerator) -> str:
    """The run's name (the recipe's, else the start time), decided on rank 0 and shared: clocks of different nodes
    disagree. Logs the launch's strategy and effective batch."""
    run_name = distributed.broadcast_from_main(accelerator, recipe.run_name or time.strftime("%Y%m%d-%H%M%S"))
    micro, accum, world = recipe.train.micro_batch_size, recipe.train.grad_accum, accelerator.num_processes
    place = sequence_parallel.layout(accelerator)
    replicas = (f"{place.dp_size} data-parallel replicas ({world} processes / sp_size {place.sp_size})"
                if place.sequence_parallel else f"{world} processes")
    log.info("run %s: strategy %s, %d process(es) on %s; effective batch = %d micro x %d accum x %s = %d",
             run_name, strategies.strategy_name(accelerator), world, accelerator.device, micro, accum, replicas,
             micro * accum * place.dp_size)
    return run_name


def check_model(model_path: str, *, trust_remote_code: bool) -> bool:
    """Fail early on a model that cannot be loaded or runs remote code unasked; whether it is vision-language."""
    check_model_source(model_path)
    check_remote_code(model_path, trust_remote_code=trust_remote_code)
    return is_vision_language(model_path, trust_remote_code=trust_remote_code)


def check_sequence_parallel(accelerator: Accelerator, resolved: list[ResolvedStage], model_path: str, *,
                            vision: bool, trust_remote_code: bool) -> str | None:
    """Under Ulysses sequence parallelism: refuse a model or rows it cannot split (before the data work), and
    return the config's attention kernel family (None without Ulysses)."""
    place = sequence_parallel.layout(accelerator)
    if not place.sequence_parallel:
        return None
    kto = [s.name for s in resolved if s.kto]
    if kto:
        raise ToolkitError(f"Stage '{kto[0]}' (objective kto) under Ulysses sequence parallelism is not supported: "
                           "its KL sides and their baseline are not summed over a group's slices; train it without "
                           "parallelism_config's sp_size (DDP, FSDP2 or ZeRO).")
    text = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
    sequence_parallel.check_model(place.sp_size, heads=text.num_attention_heads,
                                  kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                                  vision=vision, max_seq_lens=[s.max_seq_len for s in resolved])
    family = accelerator.parallelism_config.sp_handler.sp_attn_implementation
    log.info("sequence parallelism: Ulysses over %d processes per row, %d data-parallel replica(s)", place.sp_size,
             place.dp_size)
    return family


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
    """`accelerator.prepare` of the model and optimizer for the launch's strategy. Under Ulysses, accelerate wraps
    the kernel the model runs (toolkit/strategies/sequence_parallel.py), which then takes any micro-batch size."""
    sp = sequence_parallel.layout(accelerator).sequence_parallel
    kernel = model.config._attn_implementation
    if sp:
        sequence_parallel.use_kernel(accelerator, kernel)
    model, optimizer = accelerator.prepare(model, optimizer)
    if sp:
        sequence_parallel.follow_batch_size(kernel)
    return model, optimizer


def build_collator(recipe: Recipe, model_path: str, processing: Any, curriculum: Curriculum | None = None, *,
                   vision: bool) -> Any:
    """The micro-batch collator: padded or packed rows, text or image rows (`processing`: the processor of a
    vision-language model, else the tokenizer). When a store of the `curriculum` holds video rows, every batch
    carries an image and a video (toolkit/data/collate.py VLCollator says why)."""
    model_config = AutoConfig.from_pretrained(model_path, trust_remote_code=recipe.model.trust_remote_code)
    videos = vision and curriculum is not None and holds_videos([s.data for s in curriculum.stages],
                                                                [s.eval_rows for s in curriculum.stages])
    return batch_collator(processing, vision=vision, packing=recipe.data.packing, min_pixels=recipe.data.min_pixels,
                          max_pixels=recipe.data.max_pixels, model_config=model_config if vision else None,
                          videos=videos, image_store=image_store(recipe, processing) if vision else None)


def image_store(recipe: Recipe, processor: Any) -> ImageStore | None:
    """The image cache of a vision run (data.image_cache, toolkit/data/frames.py `ImageStore`) in the frame store
    beside the token store; None, said once, where it is off: data.image_cache none, data.cache_dir none, a
    processor whose resize is not cached exactly (`caches_resized`), or a store that cannot be written."""
    if recipe.data.image_cache == "none":
        return None
    cache = tokenized_cache_dir(recipe.data.cache_dir, recipe.output_dir)
    why = ("data.cache_dir is none" if cache is None
           else f"{type(processor.image_processor).__name__} is not a processor whose resize is cached exactly"
           if not caches_resized(processor.image_processor) else writable_store(cache / "frames"))
    if cache is None or why is not None:
        log.info("image cache off (%s): images are decoded and resized at every batch", why)
        return None
    return ImageStore(cache / "frames", int(recipe.data.image_cache_gb * 1e9))


def model_card(recipe: Recipe, config: str | None, curriculum: Curriculum, layout: RunLayout, processor: Any,
               accelerator: Accelerator, *, vision: bool, datasets: list[str]) -> str | None:
    """final/README.md of the finished run (toolkit/checkpoint/model_card.py): its stages as they ran (lengths after an
    early advance) and its results, read from metrics.jsonl, so a resumed run's card is the uninterrupted run's. None,
    with a warning, when metrics.jsonl cannot be read: the trained weights are saved without their card, not lost.
    Written by rank 0, which holds metrics.jsonl (None on the other ranks)."""
    if not accelerator.is_main_process:
        return None
    try:
        records = read_metrics(layout.metrics) if layout.metrics.is_file() else []
    except (ToolkitError, OSError) as e:
        log.warning("final/ is written without its model card (README.md): %s", e)
        return None
    outcome = stage_results(records)
    here = Path(config).parent if config else Path.cwd()  # the card's paths are relative to the recipe's folder
    stages = []
    for stage in curriculum.stages:
        settings, plan, got = stage.resolved, stage.plan, outcome.get(stage.name, {})
        stages.append(StageCard(
            name=stage.name, data=list(zip(portable_tree(list(settings.paths), here),
                                           settings.weights or [None] * len(settings.paths), strict=True)),
            rows=plan.num_samples, steps=plan.steps, samples=plan.steps * plan.global_batch, lr=plan.lr,
            trainable=list(settings.trainable or []), trainable_params=stage.trainable_params,
            tokens=got.get("tokens"), ended_by=got.get("ended_by"), evals=got.get("last_eval", {}),
            objective=describe_objective(settings)))
    return str(build_model_card(
        title=recipe.run_name or Path(recipe.output_dir).name,
        base_model=portable_tree(recipe.model.name_or_path, here),
        lora=recipe.lora.enabled, vision=vision, stages=stages, results=final_results(records),
        chat_template=describe_chat_template(portable_tree(recipe.data.chat_template, here),
                                             getattr(processor, "chat_template", None)),
        recipe_source=portable_tree(config, here), toolkit_version=__version__,
        recipe_yaml=yaml.safe_dump(portable_tree(recipe.model_dump(mode="json"), here), sort_keys=False),
        datasets=datasets))
