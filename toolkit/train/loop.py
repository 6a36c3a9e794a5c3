"""The training loop as named units: the run state, one step, and what happens after a step.

train_curriculum.py wires the pieces (accelerator, curriculum, model, optimizer) into a `Run` and calls, per
optimizer step, `enter_stage` (at a stage's first step), `run_step` and `after_step`. Each unit can be called alone:

* `RunState`: what a checkpoint must restore (step, stage, meter totals, pending losses, patience, stage lengths,
  Adam update counts, last metrics), written to and read from meta.json as one object (`to_meta` / `from_meta`),
  so a resume cannot forget a field.
* `run_step`: global-batch selection, micro-batches (each copied to the device while the one before it computes,
  `prefetched`), forward/backward with the loss normalised over the global batch, the one all-reduce (loss,
  preemption and timed-save flags), the guard's verdict, optimizer and scheduler.
* `after_step`: in this order, the step record, evaluation and patience (early stage advance), the stage summary,
  the checkpoint, report.html (rank 0, after an evaluation or a stage end), the preemption exit.

Host syncs (a device value read on the host stalls a GPU's queue; tests/train/test_sync_budget.py counts them):
* every step: one, the guard's all-reduce (`summed ... .tolist()`: the step's loss, preemption and timed-save
  flags; every rank needs the verdict before the update is committed). The stage's objective
  (toolkit/train/objectives.py) reads none more: a preference stage's global pair and chosen-token counts
  (`global_normalisers`), which its micro-batches' losses divide by, stay on the device, and an objective's metric
  sums (TRL's metrics) ride in the guard's all-reduce.
* inside each micro-batch's forward, outside this module: transformers' mask creation reads one value (the
  position-id restart check of a packed row, or the padding check of a padded batch), and the chunked loss head
  selects the label positions (`nonzero`: it skips the head's matmul for every other token). None per layer: the
  packing collator hands the attention kernels their boundaries with host-side lengths.
* logging steps: the meter's one reduction (tokens, FLOPs, samples) and the peak-memory max, read back, and the
  gradient norm as a float; evaluation steps: the summed eval loss and token count; stage ends and checkpoints: the
  token count (`Run.tokens_now`). Token and FLOP counts are host arithmetic on the known lengths.
* never: a host-to-device copy. The loader leaves batches on the host, pinned on CUDA, and `prefetched` copies them
  without blocking (a blocking copy waits for the device's whole queue, the previous step's backward included).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from toolkit.atomic import writing
from toolkit.checkpoint import manager as checkpoint
from toolkit.checkpoint.manager import CheckpointManager
from toolkit.checkpoint.resume import RunIdentity
from toolkit.config.schema import Recipe
from toolkit.config.stages import rl_gate_metrics
from toolkit.curriculum.stages import Curriculum, Stage
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.errors import ToolkitError
from toolkit.evals.evaluator import Evaluator
from toolkit.metrics.log import Meter, MetricsLog
from toolkit.metrics.report import refresh_report
from toolkit.model.flops import batch_train_flops
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import committed_checkpoints
from toolkit.runtime.signals import PREEMPTED_EXIT_CODE, PreemptionFlag
from toolkit.strategies import sequence_parallel
from toolkit.train.objectives import OBJECTIVES, objective_of
from toolkit.train.optimizer import StageFreezer
from toolkit.train.pair_stage import PairState
from toolkit.train.rl_stage import RlState
from toolkit.train.stability import StabilityGuard, Verdict, injected_fault, scaler_skipped, skip_update, veto_update
from toolkit.train.stage_scores import ScoringStopped, order_by_model

log = logging.getLogger("toolkit")


@dataclass
class RunState:
    """What a checkpoint must restore to continue a run exactly, saved and restored as one object.

    The weights, optimizer, scheduler and RNG are the checkpoint's state files; the data position is a function of
    `step`. Keys in meta.json keep the names older checkpoints (and tools reading them) use.
    """

    step: int = 0
    stage: str = ""
    stage_index: int = 0
    stage_step: int = 0
    samples: int = 0
    tokens: int = 0  # global token count of the logged intervals plus the pending one
    pending_losses: list[float] = field(default_factory=list)  # step losses not yet in a logged record
    pending_skipped: int = 0
    stage_steps: list[int] | None = None  # actual stage lengths (a stage ended early on patience is shorter)
    patience: dict[str, Any] | None = None  # the current stage's patience counters; None at a stage end
    gate: dict[str, Any] | None = None  # the current stage's mastery gate (a gated stage only; at its end too)
    adam_updates: list[int] | None = None  # optimizer updates applied to each parameter group
    metrics: dict[str, Any] = field(default_factory=dict)  # the latest train and eval values (best-checkpoint)
    stage_start_tokens: int | None = None  # `tokens` when the current stage began (its summary counts from it)
    pending_pairs: list[float] | None = None  # a preference stage's metric sums not yet in a logged record
    pending_rl: dict[str, list[float]] | None = None  # an RL stage's metric values not yet in a logged record
    rl_rates: dict[str, Any] | None = None  # rl.prioritize stages' success rates, stage index -> SuccessRates state

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step, "stage": self.stage, "stage_index": self.stage_index,
                "stage_step": self.stage_step, "samples": self.samples, "tokens": self.tokens,
                "pending": {"losses": self.pending_losses, "skipped": self.pending_skipped},
                "curriculum": {"stage_steps": self.stage_steps, "patience": self.patience,
                               **({"gate": self.gate} if self.gate is not None else {})},
                "adam_updates": self.adam_updates, "metrics": self.metrics,
                "stage_start_tokens": self.stage_start_tokens,
                **({"pending_pairs": self.pending_pairs} if self.pending_pairs is not None else {}),
                **({"pending_rl": self.pending_rl} if self.pending_rl is not None else {}),
                **({"rl_rates": self.rl_rates} if self.rl_rates is not None else {})}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> RunState:
        """The state of a checkpoint's meta.json; keys that older checkpoints lack get their defaults."""
        pending, cur = meta.get("pending", {}), meta.get("curriculum", {})
        return cls(step=meta["step"], stage=meta.get("stage", ""), stage_index=meta.get("stage_index", 0),
                   stage_step=meta.get("stage_step", 0), samples=meta.get("samples", 0), tokens=meta["tokens"],
                   pending_losses=list(pending.get("losses", [])), pending_skipped=pending.get("skipped", 0),
                   stage_steps=cur.get("stage_steps"), patience=cur.get("patience"), gate=cur.get("gate"),
                   adam_updates=meta.get("adam_updates"), metrics=dict(meta.get("metrics", {})),
                   stage_start_tokens=meta.get("stage_start_tokens"), pending_pairs=meta.get("pending_pairs"),
                   pending_rl=meta.get("pending_rl"), rl_rates=meta.get("rl_rates"))


@dataclass
class StepResult:
    """One optimizer step: its global loss (mean over ranks and micro-steps), gradient norm, the guard's verdict
    and the flags every rank agreed on in the step's all-reduce."""

    loss: float
    grad_norm: Any  # what the strategy's clip returned (a tensor or float; None when there was no sync)
    lr: float  # the learning rate the step's update used (read from the optimizer, not recomputed)
    skipped: bool = False
    reason: str | None = None
    preempted: bool = False
    time_due: bool = False


@dataclass
class Run:
    """The wired-up pieces of a run that the loop units use, and the live state between steps. The stages, their
    data, the LR schedule (`scheduler` is a LambdaLR over `curriculum.lr_at`) and patience are the curriculum's."""

    recipe: Recipe
    accelerator: Accelerator
    model: Any  # the prepared model (a strategy wrapper)
    optimizer: Any  # the prepared optimizer (accelerate's wrapper)
    scheduler: torch.optim.lr_scheduler.LambdaLR
    freezer: StageFreezer
    guard: StabilityGuard
    meter: Meter
    metrics: MetricsLog
    manager: CheckpointManager
    preemption: PreemptionFlag
    curriculum: Curriculum
    collate: Any
    identity: RunIdentity  # what meta.json says of the run, not its progress (checked on resume)
    evaluator: Evaluator  # eval loss and generation evals, every eval.every_steps and at stage ends
    batches: Any = None  # toolkit.data.batching.StageBatches: this rank's micro-batches, step by step
    text_config: Any = None  # the model's text config (FLOPs per token)
    max_norm: float = float("inf")  # gradient clipping
    peak_flops: float | None = None
    bar: Any = None
    resumed: RunState | None = None
    resumed_from: Path | None = None  # the checkpoint folder resumed from (its run folder holds the stage scores)
    current_stage: int = -1
    last_save: float = field(default_factory=time.monotonic)  # monotonic: not carried over a resume
    stage_start_tokens: int = 0
    latest: dict[str, Any] = field(default_factory=dict)
    pairs: PairState = field(default_factory=PairState)  # preference stages: references, pending metric sums
    rl: RlState = field(default_factory=RlState)  # RL stages: rewards, the step's rollout, pending metrics
    score_digests: dict[str, str] = field(default_factory=dict)  # scores the run took or read, by key (checkpointed)
    recorded_digests: dict[str, str] | None = None  # those the checkpoint resumed from records (checked on reading)

    def log_record(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        with writing(Path(self.accelerator.logging_dir or ".")):  # the trackers' files (TensorBoard's events)
            self.accelerator.log({k: v for k, v in record.items() if isinstance(v, int | float)},
                                 step=record["step"])

    def restore(self, state: RunState) -> None:
        """Continue from a checkpoint's state: meter totals, pending losses, Adam update counts, the curriculum's
        stage lengths and patience."""
        self.resumed = state
        self.curriculum.restore({"stage_steps": state.stage_steps, "patience": state.patience, "gate": state.gate},
                                stage_index=state.stage_index)
        self.curriculum.check_resumed_at(state.step, state.stage_index)  # a required gate left unmet stops again
        self.meter.tokens_total = state.tokens
        self.meter.losses, self.meter.skipped = state.pending_losses, state.pending_skipped
        self.freezer.updates = state.adam_updates or [state.step] * len(self.freezer.updates)
        # Checkpoints of earlier versions lack it: their stage summary then counts from the resume.
        self.stage_start_tokens = state.tokens if state.stage_start_tokens is None else state.stage_start_tokens
        if state.pending_pairs is not None:
            self.pairs.pending = list(state.pending_pairs)
        if state.pending_rl is not None:
            self.rl.pending = {k: list(v) for k, v in state.pending_rl.items()}
        if state.rl_rates is not None:
            self.rl.saved_rates = dict(state.rl_rates)

    def tokens_now(self) -> int:
        """Tokens trained on so far, over all ranks (collective: reduces the pending interval's count)."""
        return self.meter.tokens_total + self.meter.reduced(self.accelerator)[0]

    def state(self, done: int, stage: Stage, step_in_stage: int, *, stage_end: bool, tokens: int) -> RunState:
        """The run state after optimizer step `done`, with `tokens` from `tokens_now`."""
        cur = self.curriculum.state(stage_end=stage_end)
        return RunState(step=done, stage=stage.name, stage_index=stage.index, stage_step=step_in_stage + 1,
                        samples=self.curriculum.samples_seen(done), tokens=tokens,
                        pending_losses=self.meter.losses, pending_skipped=self.meter.skipped,
                        stage_steps=cur["stage_steps"], patience=cur["patience"], gate=cur.get("gate"),
                        adam_updates=self.freezer.updates, metrics=self.latest,
                        stage_start_tokens=self.stage_start_tokens,
                        pending_pairs=list(self.pairs.pending) if any(self.pairs.pending) else None,
                        pending_rl={k: list(v) for k, v in self.rl.pending.items()} or None,
                        rl_rates=self.rl.rates_state())


def objective_records(run: Run) -> dict[str, float]:
    """Every objective's metrics of the logging interval (a stage's last sums may land in the next stage's record)."""
    out: dict[str, float] = {}
    for objective in OBJECTIVES:
        out.update(objective.record(run))
    return out


def record_header(done: int, stage: Stage) -> dict[str, Any]:
    """The keys that open every metrics.jsonl record: the step and its stage."""
    return {"step": done, "stage": stage.name, "stage_index": stage.index}


def enter_stage(run: Run, stage: Stage, step: int) -> int | None:
    """A stage's first step (or the first after a resume): its freezing, its patience (resumed counters when the
    checkpoint was taken inside this stage), its order by a model's scores (taken now, or read back on a resume:
    toolkit/train/stage_scores.py). Returns the preempted exit code when a stop signal ended that scoring pass
    (its finished blocks kept; the checkpoint at this step resumes it), else None."""
    plan = stage.plan
    if run.current_stage >= 0 and run.curriculum.stages[run.current_stage].resolved.objective != \
            stage.resolved.objective:
        run.guard.recent.clear()  # another objective's losses: the spike rule's window starts afresh
    run.current_stage = stage.index
    run.freezer.set_stage(stage.index)
    run.curriculum.enter(stage)
    started = time.perf_counter()
    try:
        scored = order_by_model(run, stage, step)  # difficulty by a model's scores: the sampler, before its first step
        objective_of(stage).enter(run, stage, step)  # e.g. a dpo stage's reference: the policy as it enters
    except ScoringStopped as stopped:
        log.warning("preempted (%s) during the scoring pass (%s): its finished blocks are kept, the checkpoint at "
                    "step %d resumes it; relaunch the same command", run.preemption.signal_name or "signal on "
                    "another rank", stopped, step)
        distributed.finish_trackers(run.accelerator)
        return PREEMPTED_EXIT_CODE
    by = stage.resolved.difficulty.by if stage.resolved.difficulty is not None else None
    if scored is not None or stage.resolved.objective in ("dpo", "kto") or by == "pass_rate":
        # The entry's scoring pass (a dpo or kto stage's reference, a model's difficulty scores or a grpo stage's
        # pass rates; read back on a resume) is not training: left out of the first step's tokens/s and step time,
        # and recorded apart for the run page.
        seconds = time.perf_counter() - started
        run.meter.exclude(seconds)
        run.log_record({**record_header(step, stage), "event": "stage_entry_pass", "seconds": round(seconds, 3)})
    log.info("stage %d/%d '%s': steps %d-%d, %d samples, global batch %d, lr %.3g at its start%s",
             plan.index + 1, len(run.curriculum.stages), plan.name, plan.start_step + 1, plan.end_step,
             plan.num_samples, plan.global_batch, run.curriculum.lr_at(step),
             " (continued schedule)" if plan.schedule == "continue" else "")
    return None


def to_device(batch: dict[str, Any], device: torch.device, *, non_blocking: bool | None = None) -> dict[str, Any]:
    """A collated batch on `device`: its tensors moved, its ints (the packed row's `max_length_q/k`, which the
    attention kernels take as host ints) left as they are. A pinned tensor (the loader pins on CUDA) is copied
    without blocking the host (`non_blocking=None`): a blocking copy waits for the whole queue, the previous step's
    backward and update included, before the host may launch anything more."""
    def move(value: torch.Tensor) -> torch.Tensor:
        return value.to(device, non_blocking=value.is_pinned() if non_blocking is None else non_blocking)

    return {k: move(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


OVERLAP_COPIES = True
"""Copy micro-batch j + 1 to the device while micro-batch j computes (`prefetched`). bench/profile_step.py turns it
off (PROFILE_OVERLAP=0) to measure what it saves; training keeps it on."""


class _DeviceCopies:
    """Host-to-device copies of micro-batches, on a side stream on CUDA so that they overlap the compute stream's
    work. `issue` queues a batch's copy; `take` hands the batch to the compute stream, which waits for that copy on
    the device (an event, not a host wait), and marks each tensor used by it (`record_stream`): the tensors were
    allocated on the side stream, and the caching allocator must not give their memory away while the forward and
    backward still read them. Off CUDA nothing is copied (`.to` returns the tensor itself) and nothing waits."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def issue(self, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        if self.stream is None:
            return to_device(batch, self.device), None
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device)
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, done

    def take(self, issued: tuple[dict[str, Any], Any]) -> dict[str, Any]:
        batch, done = issued
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            for value in batch.values():
                if isinstance(value, torch.Tensor):
                    value.record_stream(compute)
        return batch


def prefetched(micro: list[Any], device: torch.device, *, overlap: bool | None = None) -> Iterator[tuple[Any, ...]]:
    """`micro`'s micro-batches (`(batch, *counts)` tuples, `toolkit.data.batching.MicroBatch`) with each batch on
    `device`, micro-batch j + 1's copy issued before micro-batch j is handed out, i.e. before j's forward: the copy
    runs while j computes, and the host never waits for a copy (`_DeviceCopies`). Off (`overlap` False, default
    `OVERLAP_COPIES`): each batch copied, blocking, on the compute stream just before its forward, as before."""
    if not (OVERLAP_COPIES if overlap is None else overlap):
        for batch, *counts in micro:
            yield (to_device(batch, device, non_blocking=False), *counts)
        return
    copies = _DeviceCopies(device)
    issued = copies.issue(micro[0][0]) if micro else None
    for j, (_, *counts) in enumerate(micro):
        current = issued
        issued = copies.issue(micro[j + 1][0]) if j + 1 < len(micro) else None
        yield (copies.take(current), *counts)


def run_step(run: Run, stage: Stage, step_in_stage: int, step: int) -> StepResult:
    """One optimizer step over the stage's global batch; stops the run when the guard has skipped too many."""
    acc, model, optimizer, meter = run.accelerator, run.model, run.optimizer, run.meter
    accum, saving = run.recipe.train.grad_accum, run.recipe.checkpoint
    plan = stage.plan
    # This rank's micro-batches of the step: the stage's rows (toolkit/data/batching.py), or a grpo stage's
    # completions of its prompts (toolkit/train/rl_stage.py), as the stage's objective says.
    objective = objective_of(stage)
    micro = objective.micro_batches(run, stage, step_in_stage, step)
    # Under Ulysses each process of a sequence-parallel group trains its slice of the same micro-batches.
    place = sequence_parallel.layout(acc)
    real: list[int | None] = [None] * len(micro)
    whole = [m.batch for m in micro]  # before slicing: a pair batch's counts and segments are over whole rows
    if place.sequence_parallel:
        sliced = [sequence_parallel.shard_batch(m.batch, place, ignore_index=IGNORE_INDEX) for m in micro]
        micro = [m._replace(batch=b) for m, (b, _) in zip(micro, sliced, strict=True)]
        real = [n for _, n in sliced]
    batches = [m.batch for m in micro]

    # The stage's objective (toolkit/train/objectives.py) takes the step's global normalisers: over every rank and
    # micro-step, so the gradient does not depend on how the batch is split. Strategies average gradients over
    # ranks and accumulation steps, hence the divisor. Under Ulysses every process counts its slice's tokens (the
    # sum counts each token once) and DeepSpeed may average over replicas only.
    averaged = sequence_parallel.gradient_divisor(acc)  # the processes, except under Ulysses (see there)
    losses = objective.begin(run, stage, batches, averaged * accum, whole=whole)
    local_loss = torch.zeros((), dtype=losses.dtype, device=acc.device)
    verdict = Verdict(skip=False)
    step_loss, preempted, time_due, grad_norm = float("nan"), False, False, None
    for j, (batch, lengths, label_tokens) in enumerate(prefetched(micro, acc.device)):
        logits_for = None if run.recipe.model.loss_head == "standard" else label_tokens  # chunked / Liger heads
        # The processes of a Ulysses group share the row's FLOPs and samples: the sums count each once.
        flops = batch_train_flops(run.text_config, lengths, lora=run.recipe.lora.enabled,
                                  head_tokens=logits_for) / place.sp_size
        meter.add_batch(batch, flops, len(lengths) if place.sp_rank == 0 else 0, real=real[j])
        with acc.accumulate(model):
            loss = losses.micro(model, j, batch)
            if injected_fault(step + 1, acc.process_index):
                loss = loss * float("nan")
            local_loss += loss.detach()
            if j == accum - 1:
                # One all-reduce per step, before the update is committed: the step's global loss (NaN if
                # any rank's is), preemption and timed-save flags. Every rank gets the same verdict.
                time_due = (saving.save_minutes is not None
                            and time.monotonic() - run.last_save >= 60 * saving.save_minutes)
                kind = {"device": acc.device, "dtype": local_loss.dtype}
                flags = torch.stack([local_loss, torch.tensor(float(run.preemption.requested), **kind),
                                     torch.tensor(float(time_due), **kind)])
                sums = losses.sums  # the objective's metric sums ride in the same all-reduce
                summed = acc.reduce(flags if sums is None else torch.cat([flags, sums]), reduction="sum").tolist()
                step_loss, preempted, time_due = summed[0] / (averaged * accum), summed[1] > 0, summed[2] > 0
                if sums is not None:  # TRL's metrics of the global batch, in the interval's record
                    objective.add_sums(run, summed[3:])
                verdict = run.guard.judge(step_loss)
                if verdict.skip:
                    loss = veto_update(loss)
            acc.backward(loss)
            if acc.sync_gradients:
                run.freezer.drop_frozen_grads()  # frozen parameters leave the norm and the update
                grad_norm = acc.clip_grad_norm_(model.parameters(), run.max_norm)
            if not verdict.skip:  # outside sync steps accelerate's optimizer.step() is a no-op anyway
                optimizer.step()
            else:
                skip_update(acc.scaler)  # fp16: the loss scaler closes the step too
            optimizer.zero_grad()
    lr = optimizer.param_groups[0]["lr"]  # every group has base lr 1.0: the same absolute lr
    run.scheduler.step()
    meter.add_step(step_loss, verdict.skip)
    if not verdict.skip and not scaler_skipped(optimizer):  # fp16 overflow: no update
        run.freezer.count_update(plan.index)
    if run.bar is not None:
        run.bar.update(1)
    done = step + 1
    if verdict.skip:
        log.warning("step %d (stage '%s'): update skipped, %s", done, plan.name, verdict.reason)
        if run.guard.exhausted:
            last_good = committed_checkpoints(run.manager.root)
            raise ToolkitError(
                f"Training diverged: {run.guard.consecutive} consecutive steps skipped up to step {done} in stage "
                f"'{plan.name}' ({verdict.reason}). Last good checkpoint: "
                f"{last_good[-1] if last_good else 'none'}. Lower the learning rate or check the data.")
    return StepResult(step_loss, grad_norm, lr, verdict.skip, verdict.reason, preempted, time_due)


def after_step(run: Run, stage: Stage, step_in_stage: int, done: int, result: StepResult) -> int | None:
    """Everything that follows optimizer step `done`, in this order: the step record, evaluation and patience
    (which may end the stage early), the stage summary, the checkpoint, report.html, the preemption exit.

    Returns the exit code when the run stops here (preempted), else None. Collective: every rank calls it.
    """
    recipe, acc, saving = run.recipe, run.accelerator, run.recipe.checkpoint
    record = None
    if done % recipe.logging.logging_steps == 0 or done == run.curriculum.end_step:
        record = {**record_header(done, stage), "stage_step": step_in_stage + 1,
                  **run.meter.record(acc, peak_flops=run.peak_flops), "lr": result.lr,
                  "grad_norm": float(result.grad_norm) if result.grad_norm is not None else None,
                  "samples": run.curriculum.samples_seen(done), **objective_records(run)}
        run.log_record(record)
        run.latest.update(record)
        if run.bar is not None:
            run.bar.set_postfix(stage=stage.name, loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}")
    evaluates = eval_due(run, stage, done)
    stage_end = evaluate_stage(run, stage, step_in_stage, done)
    if record is not None and not stage_end and reward_gated(run, stage):  # an RL stage's gate on its reward
        stage_end = advance_stage(run, stage, step_in_stage, done, record)
    if evaluates and not result.preempted:
        # A signal during an eval (minutes for generation) stops here, not one step and maybe one eval later: the
        # step's all-reduce carried the flag before the eval began. Every rank evaluated, so every rank asks.
        flag = acc.reduce(torch.tensor(float(run.preemption.requested), device=acc.device), reduction="sum")
        result = dataclasses.replace(result, preempted=bool(flag.item() > 0))
    # Checkpoint: every save_steps / save_minutes, at stage ends, and on preemption (all ranks agree).
    periodic = bool(saving.save_steps) and done % saving.save_steps == 0
    save = result.preempted or result.time_due or periodic or (saving.save_on_stage_end and stage_end)
    tokens = run.tokens_now() if stage_end or save else 0  # one reduction serves the summary and the checkpoint
    if stage_end:
        stage_summary(run, stage, done, tokens)
    if save:
        save_checkpoint(run, run.state(done, stage, step_in_stage, stage_end=stage_end, tokens=tokens))
    if (evaluates or stage_end) and acc.is_main_process:  # the page after each evaluation and stage end
        refresh_report(run.evaluator.layout)
    if stage_end and (unmet := run.curriculum.unmet_required_gate(stage)) is not None:
        raise ToolkitError(unmet)  # after the checkpoint: its state says so, and a resume there stops again
    if result.preempted:
        log.warning("preempted (%s): stopped after step %d, checkpoint saved; resume with the same command",
                    run.preemption.signal_name or "signal on another rank", done)
        distributed.finish_trackers(acc)
        return PREEMPTED_EXIT_CODE
    return None


def eval_due(run: Run, stage: Stage, done: int) -> bool:
    """Whether step `done` evaluates: every eval.every_steps and at the stage's end, when the stage has evals."""
    every = run.recipe.eval.every_steps
    due = done == stage.plan.end_step or bool(every and done % every == 0)
    return due and run.evaluator.has_evals(stage)


def evaluate_stage(run: Run, stage: Stage, step_in_stage: int, done: int) -> bool:
    """Evaluation every eval.every_steps and at the end of each stage (toolkit/evals/evaluator.py: eval loss and
    generation evals of the stage, or of every stage with eval.all_stages). Its time is left out of training tokens/s. A
    gate met, or patience run out, ends the stage: the curriculum moves the later stages up (`stage.plan` is then the
    shortened one). Every rank decides on rank 0's metrics. Returns whether the stage ends at `done`."""
    if not eval_due(run, stage, done):
        return done == stage.plan.end_step
    result = run.evaluator.evaluate(run.model, run.collate, stage, done)
    run.meter.exclude(result.seconds)  # tokens/s, step time and MFU stay training's
    run.log_record({**record_header(done, stage), **result.metrics})
    run.latest.update(result.metrics)
    log.info("step %d eval: %s", done, ", ".join(f"{k} {v:.4g}" for k, v in result.metrics.items()
                                               if k not in ("eval_tokens", "eval_seconds", "eval_gen_seconds")))
    return advance_stage(run, stage, step_in_stage, done, result.metrics)


def reward_gated(run: Run, stage: Stage) -> bool:
    """Whether the stage's gate reads a training metric (an RL stage's reward), checked at each logged step."""
    gate = stage.resolved.advance_when
    return gate is not None and gate.metric in rl_gate_metrics(stage.resolved)


def advance_stage(run: Run, stage: Stage, step_in_stage: int, done: int, metrics: dict[str, Any]) -> bool:
    """The stage's gate and patience on `metrics` (an evaluation's, or an RL stage's logged reward): either may end
    the stage early, moving the later stages up. Returns whether the stage ends at `done`."""
    cur = run.curriculum
    stage_end = done == stage.plan.end_step
    advance = cur.advance(stage, step_in_stage + 1, done, metrics)
    if advance is not None and not stage_end:
        why = (f"advance_when {advance['gate']} is met ({advance['value']:.4g})" if advance["reason"] == "gate" else
               f"eval_loss has not improved on {advance['best_eval_loss']:.4f} for {cur.patience.since_best} "
               "evaluations")
        log.info("stage '%s' ends early after %d of %d steps: %s", stage.name, step_in_stage + 1, stage.plan.steps, why)
        cur.end_stage_early(stage, step_in_stage + 1, advance["reason"])
        reapply_schedule(run.scheduler)
        if run.bar is not None:
            run.bar.total = cur.end_step
        run.log_record({**record_header(done, stage), "event": "early_advance", **advance})
        return True
    return stage_end


def reapply_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Set the optimizer's lr for the next step from the curriculum's current schedule. The scheduler computed it at
    its last `step()`, from the schedule before an early advance moved the later stages up: without this the next
    stage's first step would train at the cut stage's lr. Stepping again from one step back recomputes it."""
    scheduler.last_epoch -= 1
    scheduler.step()


def stage_summary(run: Run, stage: Stage, done: int, tokens_now: int) -> None:
    """The ended stage's summary, in the log and in metrics.jsonl; `tokens_now` is `run.tokens_now()`."""
    plan = stage.plan
    summary = {**record_header(done, stage), "event": "stage_end",
               "stage_steps": plan.steps, "stage_samples": plan.steps * plan.global_batch,
               "stage_tokens": tokens_now - run.stage_start_tokens, "trainable_params": stage.trainable_params,
               **run.curriculum.ending()}
    run.metrics.write(summary)
    log.info("stage '%s' done: %d steps, %d samples, %d tokens, %d trainable parameters", plan.name,
             plan.steps, summary["stage_samples"], summary["stage_tokens"], summary["trainable_params"])
    gate = summary.get("gate")
    if gate is not None and not gate["met"]:
        log.warning("stage '%s' ended at its length (%d steps) without meeting advance_when %s (last %s, best %s)",
                    plan.name, plan.steps, run.curriculum.gate.rule.describe(), gate["last"], gate["best"])
    run.stage_start_tokens = tokens_now


def save_checkpoint(run: Run, state: RunState) -> None:
    """Commit a checkpoint of the run at `state.step`: the state files and meta.json (`state` plus the run's
    identity, which a resume checks)."""
    recipe = run.recipe
    meta = {**state.to_meta(), "time": time.time(), **run.identity.to_meta(),
            "scores": dict(run.score_digests)}  # the scores it depends on: a resume refuses other ones
    portable = recipe.lora.enabled and recipe.checkpoint.portable
    write = partial(checkpoint.write_state, run.accelerator, run.model, run.optimizer,
                    adam_steps=run.freezer.adam_steps() if portable else None)
    log.info("checkpoint %s", run.manager.save(state.step, write, meta))
    run.last_save = time.monotonic()
