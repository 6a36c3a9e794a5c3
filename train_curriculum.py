"""Curriculum fine-tuning, one launch, any strategy.

    accelerate launch --config_file accelerate_configs/zero3.yaml train_curriculum.py --config recipes/X.yaml

The strategy (single, DDP, FSDP2, ZeRO-2/3, offload) comes only from the accelerate config; nothing below
changes with it. A run reads top to bottom: config, accelerator, data, model, optimizer, prepare, resume, loop,
save. Relaunching the same command resumes from the newest committed checkpoint (checkpoint.resume: auto).
With no --config it trains the embedded default: a tiny local Qwen3 on dummy data through a 2-stage curriculum.
The loop's units (one step, what follows a step, the run state a checkpoint restores) are in toolkit/train/loop.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from toolkit.builtin.dummy_data import use_dummy_data
from toolkit.builtin.models import materialize_builtin
from toolkit.checkpoint.final import save_final
from toolkit.checkpoint.resume import check_state, state_signature
from toolkit.config.load import flat_config, load_recipe
from toolkit.config.schema import Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.stages import data_fingerprint, hub_datasets, loader_workers, tokenized_cache_dir
from toolkit.errors import ToolkitError, out_of_space
from toolkit.evals.evaluator import import_scorers, load_generation_plan
from toolkit.metrics.report import refresh_report
from toolkit.runtime import process as distributed
from toolkit.runtime.exit_lines import FAILED_EXIT_CODE, LastWords
from toolkit.runtime.run_dir import RunLayout, check_output_dir, path_component
from toolkit.runtime.signals import (
    INTERRUPTED_EXIT_CODE,
    INTERRUPTED_LINE,
    PREEMPTED_EXIT_CODE,
    PreemptionFlag,
    Stopped,
    exit_code,
)
from toolkit.strategies.deepspeed import configure_deepspeed
from toolkit.train.loop import after_step, enter_stage, run_step
from toolkit.train.optimizer import build_optimizer
from toolkit.train.setup import (
    assemble_run,
    build_collator,
    build_model,
    build_stages,
    check_last_steps_applied,
    check_model,
    check_resume,
    check_sequence_parallel,
    claim_output_dir,
    model_card,
    name_run,
    prepare,
    prepare_inputs,
    resume_run,
    run_identity,
    start_accelerator,
    start_afresh,
    write_run_files,
)
from toolkit.train.stage_scores import score_before_training

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
    """One run of `recipe` (from the --config file `config`; None: the embedded default). A stop signal ends it at once
    before the first step (`Stopped`: nothing to save), then after its step, with a checkpoint (runtime/signals.py)."""
    layout = ending.layout = RunLayout(recipe.output_dir)  # a stop names the checkpoint a relaunch resumes from
    check_output_dir(layout.root)
    scorers = import_scorers(recipe, Path(config).parent if config else Path.cwd())  # user scorers, before the heavy
    # Every process writes a built-in tiny model (if missing) before the process group exists, since after it
    # save_pretrained writes weights on global rank 0 only. Builders at once are safe: the first rename wins.
    model_path = materialize_builtin(recipe.model.name_or_path, layout.cache)

    # --- Accelerator: the launch config decides the strategy; we only pass what the recipe owns. ---
    accelerator = start_accelerator(recipe, layout)
    ending.watch(layout)  # should this rank stop unexpectedly, the others can name it
    log.setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)  # one line per event
    run_name = name_run(recipe, accelerator)
    _lock, resume_from = claim_output_dir(layout, recipe.checkpoint.resume, accelerator)  # held until exit

    # --- Data: tokenised and validated before the model is loaded, so bad input fails in seconds. ---
    vision = check_model(model_path, trust_remote_code=recipe.model.trust_remote_code)
    if create_dummy:  # stages not already on dummy data get the generated files
        use_dummy_data(recipe.stages, vision=vision)
    if resume_from is None:  # the recipe is final now: it tells an interrupted attempt of this run from another run
        start_afresh(layout, recipe, accelerator)
    resolved = resolve_stages(recipe)  # each stage's effective settings, from here on
    sp_attention = check_sequence_parallel(accelerator, resolved, model_path, vision=vision,
                                           trust_remote_code=recipe.model.trust_remote_code)
    processor, tokenizer = prepare_inputs(recipe, resolved, accelerator, model_path, layout.dummy_data,
                                          vision=vision, dummy_samples=dummy_samples)
    cache = tokenized_cache_dir(recipe.data.cache_dir, layout.root)
    curriculum = build_stages(recipe, resolved, accelerator, tokenizer, processor if vision else None,
                              layout.dummy_data, cache)
    collate = build_collator(recipe, model_path, processor if vision else tokenizer, curriculum, vision=vision)
    generation = load_generation_plan(recipe, resolved, scorers, processor if vision else tokenizer,
                                      layout.dummy_data, vision=vision)
    identity = run_identity(recipe, accelerator, curriculum, run_name=run_name, model_path=model_path,
                            data_files=data_fingerprint(resolved, layout.dummy_data, cache))
    hub = hub_datasets(resolved, layout.dummy_data)  # for the model card, while every entry is known to resolve
    resume_meta, forced = {}, []  # a resume is checked before the model loads: a mismatch should fail in seconds
    if resume_from is not None:
        resume_meta, forced = check_resume(accelerator, resume_from, identity, force=recipe.checkpoint.resume_force)

    # --- Model: same seed on every rank so LoRA init agrees (ZeRO-3 / FSDP shard each rank's own copy). ---
    set_seed(recipe.train.seed)
    model, trainable = build_model(recipe, resolved, model_path, vision=vision,
                                   mixed_precision=accelerator.mixed_precision, sp_attention=sp_attention)
    curriculum.set_trainable_params(trainable.stage_counts)
    identity.state = state_signature(model, trainable.groups)
    if resume_from is not None:  # before its weights load: a model that cannot hold them is refused, even forced
        check_state(resume_meta, resume_from, identity.state, identity.invariants)
    set_seed(recipe.train.seed, device_specific=True)  # from here on (dropout), each rank its own stream

    # --- Optimizer and schedule: base lr 1.0 so the LambdaLR returns the absolute per-stage lr. ---
    # Every parameter that trains in some stage is in the optimizer from the start, one param group per set of
    # stages it trains in; the StageFreezer below withholds the updates of the groups a stage freezes.
    opt = recipe.optimizer
    configure_deepspeed(accelerator, model, resolved[0].micro_batch_size, opt.max_grad_norm)
    optimizer = build_optimizer(accelerator, trainable.param_groups(model), lr=1.0, weight_decay=opt.weight_decay,
                                betas=opt.betas, eps=opt.eps)

    # --- Prepare: wraps model and optimizer for the strategy (DDP, FSDP2 sharding, DeepSpeed engine, Ulysses). ---
    model, optimizer = prepare(accelerator, model, optimizer)
    run = assemble_run(recipe, layout, accelerator, model, optimizer, trainable, preemption=preemption,
                       curriculum=curriculum, collate=collate, identity=identity, generation=generation,
                       num_workers=loader_workers(recipe.data, vision=vision))

    # --- Resume: weights, optimizer, scheduler, RNG and the run state; the data position is a function of the step.
    if resume_from is not None:
        resume_run(run, resume_from, resume_meta, forced)
    write_run_files(recipe, layout, accelerator, identity, curriculum.plans, trainable.stage_counts,
                    resumed_at=None if run.resumed is None else run.resumed.step)
    ending.run_folder_ready()  # from here on an unexpected end's traceback goes to <output_dir>/logs
    accelerator.init_trackers(path_component(run_name), config=flat_config(recipe))  # a folder under trackers/

    # --- The loop: one iteration = one optimizer step over a global batch of the current stage. ---
    model.train()
    step = run.resumed.step if run.resumed else 0
    score_before_training(run, step)  # stages ordered by the base model's scores: taken before the first step
    preemption.training()  # a signal from here on finishes the step it is in, saves and exits
    run.bar = tqdm(total=curriculum.end_step, initial=step,
                   disable=not (accelerator.is_main_process and recipe.logging.progress_bar))
    while step < curriculum.end_step:  # the end moves up when a stage ends early
        stage, step_in_stage = curriculum.locate(step)
        if stage.index != run.current_stage and (code := enter_stage(run, stage, step)) is not None:
            return code  # stopped during the stage's scoring pass
        result = run_step(run, stage, step_in_stage, step)
        if (code := after_step(run, stage, step_in_stage, step + 1, result)) is not None:
            return code
        step += 1
    run.bar.close()
    check_last_steps_applied(run.guard, layout)

    # --- Save: gathered adapter (or full model) + tokenizer / processor, usable with from_pretrained. ---
    card = model_card(recipe, config, curriculum, layout, processor, accelerator, vision=vision, datasets=hub)
    final = save_final(accelerator, model, processor, layout.final, card=card)
    log.info("done. report: %s  metrics: %s  final model: %s  (%d steps skipped)", layout.report, layout.metrics, final,
             run.guard.total_skipped)
    distributed.finish_trackers(accelerator)
    return 0


def _stopped_on_error(ending: LastWords, e: ToolkitError) -> int:
    """Bad input or a full disk: one line (exit 2), which the other ranks can name; under a launch, once in all."""
    if (line := ending.stopped_on_error(str(e))) is not None:
        print(line, file=sys.stderr)
    return 2


def _quiet_about_full_disks(args: threading.ExceptHookArgs) -> None:
    """A library's writer thread (TensorBoard's event writer) that stops on a full disk hands the error to the
    training thread's next write, which ends the run in one line: its own traceback would only repeat it."""
    if out_of_space(args.exc_value) is None:
        threading.__excepthook__(args)


def main(argv: list[str] | None = None) -> int:
    """Every rank ends with one line: bad input (exit 2), Ctrl-C (130), or anything unexpected here or on another
    rank (FAILED_EXIT_CODE; the traceback goes to the rank's log file, toolkit/runtime/exit_lines.py)."""
    gpu = distributed.gpu_defaults()  # before anything touches CUDA (its allocator reads its config once)
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    ending = LastWords()
    # Stop signals from here on end the run at once before the first step, then after a step (runtime/signals.py).
    preemption = PreemptionFlag(advice=ending.relaunch_advice)
    threading.excepthook = _quiet_about_full_disks
    if torch.cuda.is_available():
        log.info("GPU defaults: %s", ", ".join(gpu) or "none (the allocator config is the user's)")
    try:
        if args.num_dummy_samples < 1:
            raise ToolkitError(f"--num_dummy_samples must be at least 1, got {args.num_dummy_samples}.")
        recipe = load_recipe(args.config, args.overrides)
        code = train(recipe, create_dummy=args.create_dummy_data, dummy_samples=args.num_dummy_samples,
                     ending=ending, preemption=preemption, config=args.config)
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
        if ending.outputs_written and ending.rank == 0 and ending.layout is not None:
            refresh_report(ending.layout)  # at the run's end, however it ended: the page shows how far it got


def _stopped(ending: LastWords, preemption: PreemptionFlag, signal_name: str) -> int:
    """The end of a run stopped by `signal_name` before its first step: one line, the signal's exit code."""
    preemption.say_once(preemption.stop_line(signal_name))
    ending.stopped(signal_name)  # for the peers' lines (a store that went away may hold it: the watcher ends it)
    return exit_code(signal_name)


if __name__ == "__main__":
    status = main()
    distributed.exit_without_teardown(status)
