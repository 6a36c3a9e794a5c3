"""The loop's units alone, in this process: the run state's meta.json round trip, one step against a loss computed
by hand, the order of the after-step events (a stage end at a checkpoint step), and the host-to-device copies of the
micro-batches (non-blocking from pinned memory, the next one issued before the current forward)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import train_curriculum as tc
from tests.helpers.inprocess import process_state_kept
from toolkit.builtin.models import materialize_builtin
from toolkit.checkpoint.manager import read_meta
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.collate import padding_collator
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.metrics.log import read_metrics
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout, committed_checkpoints
from toolkit.runtime.signals import PREEMPTED_EXIT_CODE, PreemptionFlag
from toolkit.train import loop, setup
from toolkit.train.loop import Run, RunState, after_step, enter_stage, evaluate_stage, run_step
from toolkit.train.optimizer import build_optimizer


@pytest.fixture(autouse=True)
def _kept() -> Iterator[None]:
    with process_state_kept():  # PreemptionFlag's signal handlers stay off the test runner
        yield


def test_run_state_round_trip_through_meta_json() -> None:
    """Every field survives meta.json (none forgotten), under the keys older checkpoints use."""
    state = RunState(step=7, stage="b", stage_index=1, stage_step=3, samples=56, tokens=1234,
                     pending_losses=[2.5, float("inf")], pending_skipped=1, stage_steps=[4, 5],
                     patience={"best": 1.5, "since_best": 2}, gate={"last": 0.5, "best": 0.75, "best_step": 6,
                                                                  "met_step": None},
                     adam_updates=[4, 3], metrics={"loss": 2.0}, stage_start_tokens=1000,
                     pending_pairs=[0.5, -0.5, 2.0, 1.0, -40.0, -44.0, 2.0],
                     pending_rl={"reward": [1.5, 3.0], "rewards/contains/mean": [0.5, 3.0]},
                     rl_rates={"1": {"attempts": [2.0, 0.0], "successes": [1.0, 0.0]}})
    defaults = RunState()
    assert all(getattr(state, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(RunState))
    meta = json.loads(json.dumps(state.to_meta()))
    assert RunState.from_meta(meta) == state
    assert meta["step"] == 7 and meta["tokens"] == 1234 and meta["stage_index"] == 1
    assert meta["pending"] == {"losses": [2.5, float("inf")], "skipped": 1}
    assert meta["curriculum"] == {"stage_steps": [4, 5], "patience": {"best": 1.5, "since_best": 2},
                                  "gate": state.gate}
    assert "gate" not in RunState(stage_steps=[4, 5]).to_meta()["curriculum"]  # ungated: as before gates existed
    assert meta["adam_updates"] == [4, 3] and meta["metrics"] == {"loss": 2.0}
    assert meta["stage_start_tokens"] == 1000  # the stage summary of a resumed run counts the whole stage
    assert meta["pending_pairs"] == state.pending_pairs  # a preference stage's metric sums not yet logged
    assert "pending_pairs" not in RunState().to_meta()  # an sft run's meta.json as before
    assert meta["pending_rl"] == state.pending_rl and "pending_rl" not in RunState().to_meta()  # an RL stage's
    assert meta["rl_rates"] == state.rl_rates and "rl_rates" not in RunState().to_meta()  # rl.prioritize's rates
    old = {"step": 3, "tokens": 10, "stage": "a", "stage_index": 0, "pending": {"losses": [], "skipped": 0}}
    assert RunState.from_meta(old) == RunState(step=3, tokens=10, stage="a")  # a checkpoint without the later keys


def test_overrides_may_come_between_and_after_the_options() -> None:
    """`train_curriculum.py --config R a=1 --create_dummy_data b=2` takes both overrides (argparse's default parse
    stopped at the first option after them: "unrecognized arguments: b=2")."""
    args = tc.parse_args(["--config", "r.yaml", "a=1", "--create_dummy_data", "b=2", "--num_dummy_samples", "4", "c=3"])
    assert (args.config, args.create_dummy_data, args.num_dummy_samples) == ("r.yaml", True, 4)
    assert args.overrides == ["a=1", "b=2", "c=3"]


def build_run(tmp_path: Path, *overrides: str) -> Run:
    """A single-process run of the embedded tiny recipe, wired by train_curriculum's own helpers."""
    recipe = load_recipe(None, [f"output_dir={tmp_path / 'run'}", "train.grad_accum=2", *overrides])
    out = Path(recipe.output_dir)
    accelerator = distributed.build_accelerator(recipe.train.grad_accum, 10)
    model_path = materialize_builtin(recipe.model.name_or_path, tmp_path / ".toolkit-cache")
    resolved = resolve_stages(recipe)
    layout = RunLayout(out)
    _, tokenizer = setup.prepare_inputs(recipe, resolved, accelerator, model_path, layout.dummy_data, vision=False,
                                     dummy_samples=32)
    curriculum = setup.build_stages(recipe, resolved, accelerator, tokenizer, None, layout.dummy_data, None)
    torch.manual_seed(0)
    model, trainable = setup.build_model(recipe, resolved, model_path, vision=False)
    curriculum.set_trainable_params(trainable.stage_counts)
    optimizer = build_optimizer(accelerator, trainable.param_groups(model), lr=1.0, weight_decay=0.0,
                                            betas=(0.9, 0.999), eps=1e-8)
    model, optimizer = accelerator.prepare(model, optimizer)
    out.mkdir(parents=True, exist_ok=True)
    preemption = PreemptionFlag()
    preemption.training()  # these runs are in their loop: a signal asks for a save
    return setup.assemble_run(recipe, layout, accelerator, model, optimizer, trainable, preemption=preemption,
                              curriculum=curriculum, collate=padding_collator(tokenizer), num_workers=0,
                              identity=setup.run_identity(recipe, accelerator, curriculum, run_name="unit",
                                                          model_path=model_path, data_files={}))


def test_one_step_loss_is_the_global_batch_mean_computed_by_hand(tmp_path: Path) -> None:
    run = build_run(tmp_path)
    stage = run.curriculum.stages[0]
    samples = [stage.data.samples[i] for i in stage.sampler.batch(0)]
    model = run.accelerator.unwrap_model(run.model)
    model.eval()
    with torch.no_grad():  # sum of every label token's cross-entropy over the whole global batch, / label tokens
        total, count = 0.0, 0
        for s in samples:
            logits = model(input_ids=torch.tensor([s["input_ids"]])).logits[0, :-1].float()
            labels = torch.tensor(s["labels"][1:])
            total += F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((labels != IGNORE_INDEX).sum())
    model.train()
    enter_stage(run, stage, 0)
    result = run_step(run, stage, 0, 0)
    assert result.loss == pytest.approx(total / count, rel=1e-5)
    assert not result.skipped and not result.preempted and result.grad_norm is not None and result.grad_norm > 0
    assert max(run.freezer.updates) == 1  # the update was applied (at lr 0: warmup starts there)
    assert run.meter.losses == [result.loss] and run.scheduler.last_epoch == 1


def test_stage_end_at_a_checkpoint_step_writes_the_summary_before_the_checkpoint(tmp_path: Path) -> None:
    """Step record, stage summary, then the checkpoint, whose state is the one after the summary."""
    run = build_run(tmp_path, "stages.0.max_steps=1", "checkpoint.save_steps=1")
    stage = run.curriculum.stages[0]
    saved_at: list[int] = []
    save = run.manager.save

    def recording_save(step, write, meta):  # the real save, noting how many records were written before it
        saved_at.append(len(read_metrics(run.metrics.path)))
        return save(step, write, meta)

    run.manager.save = recording_save  # type: ignore[method-assign]
    reductions: list[int] = []
    reduce = run.accelerator.reduce

    def counting_reduce(tensor, reduction="mean"):  # the real reduce, counted
        reductions.append(tensor.numel())
        return reduce(tensor, reduction=reduction)

    enter_stage(run, stage, 0)
    result = run_step(run, stage, 0, 0)
    run.accelerator.reduce = counting_reduce  # type: ignore[method-assign]
    assert after_step(run, stage, 0, 1, result) is None
    # the step record's interval reduce, then ONE token-count reduce for the stage summary and the checkpoint
    assert len(reductions) == 2, reductions
    records = read_metrics(run.metrics.path)
    assert [r.get("event", "step") for r in records] == ["step", "stage_end"] and saved_at == [2]
    meta = read_meta(committed_checkpoints(run.manager.root)[-1])
    state = RunState.from_meta(meta)
    assert (state.step, state.stage, state.stage_step) == (1, stage.name, 1)
    assert state.patience is None and state.pending_losses == [] and state.tokens == records[0]["tokens"]
    assert state.adam_updates == run.freezer.updates and state.stage_steps == [p.steps for p in run.curriculum.plans]
    summary = records[1]
    assert summary["trainable_params"] == stage.trainable_params > 0
    assert {k: summary[k] for k in ("step", "stage", "stage_index")} == {"step": 1, "stage": stage.name,
                                                                         "stage_index": 0}
    assert meta["run_name"] == "unit" and run.stage_start_tokens == records[0]["tokens"]
    # preemption: the checkpoint first, then the exit code
    assert after_step(run, stage, 0, 1, dataclasses.replace(result, preempted=True)) == PREEMPTED_EXIT_CODE


def test_lr_scaling_and_the_eval_batch_follow_each_stage_micro_batch(tmp_path: Path) -> None:
    """A stage with its own micro batch: lr_scaling scales its lr by ITS global batch (micro x accum x world), and
    its evaluation runs micro-batches of its size (eval.micro_batch_size unset), not train.micro_batch_size's."""
    run = build_run(tmp_path, "stages.1.micro_batch_size=1", "optimizer.lr_scaling=linear",
                    "optimizer.reference_batch_size=4", "eval.data=[dummy:stage2]")
    first, second = run.curriculum.plans
    assert (first.global_batch, second.global_batch) == (8, 2)  # micro 4 x accum 2; micro 1 x accum 2
    assert first.lr == pytest.approx(1e-2 * 8 / 4) and second.lr == pytest.approx(5e-3 * 2 / 4)
    sizes: list[int] = []
    collate = run.collate

    def recording_collate(rows):  # the real collator, noting each eval micro-batch's size
        sizes.append(len(rows))
        return collate(rows)

    run.collate = recording_collate
    stage = run.curriculum.stages[1]
    enter_stage(run, stage, second.start_step)
    evaluate_stage(run, stage, second.steps - 1, second.end_step)  # the stage's end: it evaluates
    assert sizes and set(sizes) == {1} and len(sizes) == len(stage.eval_rows)


def test_a_stage_loader_ending_does_not_sync_early_micro_steps(tmp_path: Path) -> None:
    """The loop takes all of a step's micro-batches before its first forward; the stage's DataLoader (prepared by
    accelerate) is then at its end while the last step's first micro-step runs. That must not make accelerate sync
    and step the optimizer there: one Adam update per optimizer step, the last step's included."""
    run = build_run(tmp_path, "stages.0.max_steps=2")
    stage = run.curriculum.stages[0]
    syncs: list[bool] = []
    step = run.optimizer.step

    def recording_step(*args, **kwargs):  # accelerate's optimizer: a real update only where gradients sync
        syncs.append(run.accelerator.sync_gradients)
        return step(*args, **kwargs)

    run.optimizer.step = recording_step  # type: ignore[method-assign]
    enter_stage(run, stage, 0)
    for k in range(2):
        run_step(run, stage, k, k)
    assert syncs == [False, True, False, True]
    adam = run.optimizer.optimizer if hasattr(run.optimizer, "optimizer") else run.optimizer
    assert {int(st["step"]) for st in adam.state.values()} == {2}


def test_eval_time_is_left_out_of_training_throughput(tmp_path: Path) -> None:
    """tokens/s, step time and MFU are training's: the interval clock skips an evaluation's time."""
    run = build_run(tmp_path, "eval.data=[dummy:stage2]")
    stage = run.curriculum.stages[0]
    enter_stage(run, stage, 0)
    results = []
    evaluate = run.evaluator.evaluate

    def recording(*args, **kwargs):  # the real evaluation, its result kept
        results.append(evaluate(*args, **kwargs))
        return results[-1]

    run.evaluator.evaluate = recording  # type: ignore[method-assign]
    started = run.meter.started
    assert not evaluate_stage(run, stage, 0, 1)  # no eval.every_steps: step 1 is not due
    assert results == [] and run.meter.started == started
    evaluate_stage(run, stage, stage.plan.steps - 1, stage.plan.end_step)  # the stage's end: it evaluates
    assert len(results) == 1 and results[0].seconds > 0
    assert run.meter.started == pytest.approx(started + results[0].seconds, abs=1e-9)
    record = read_metrics(run.metrics.path)[-1]
    assert record["eval_seconds"] <= results[0].seconds and "eval_loss" in record


def test_a_signal_during_an_eval_stops_the_run_at_that_step(tmp_path: Path) -> None:
    """SIGTERM while step 1's eval runs (a generation eval may take minutes, beyond a scheduler's grace period):
    the run checkpoints step 1 and exits, not one step (and maybe one eval) later. The hostile pass saw a signal
    during step 2's eval stop the gated smoke after step 3: the flag rode only the step's all-reduce."""
    run = build_run(tmp_path, "eval.data=[dummy:stage1]", "eval.every_steps=1", "stages.0.max_steps=3")
    stage = run.curriculum.stages[0]
    evaluate = run.evaluator.evaluate

    def signalled_evaluate(*args, **kwargs):  # the real eval, with SIGTERM arriving while it runs
        out = evaluate(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return out

    run.evaluator.evaluate = signalled_evaluate  # type: ignore[method-assign]
    enter_stage(run, stage, 0)
    result = run_step(run, stage, 0, 0)
    assert not result.preempted
    assert after_step(run, stage, 0, 1, result) == PREEMPTED_EXIT_CODE
    assert [c.name for c in committed_checkpoints(run.manager.root)] == ["step-00000001"]



def test_to_device_copies_pinned_tensors_without_blocking_and_keeps_ints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned tensor (the loader pins on CUDA) is copied with non_blocking=True, any other blocking; the packed
    row's max lengths stay Python ints. (This torch has no pinned memory without a GPU: `is_pinned` stands in.)"""
    pinned, pageable = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 1]])
    copies: list[tuple[torch.Tensor, bool]] = []
    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies.append((self, kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self is pinned)
    monkeypatch.setattr(torch.Tensor, "to", to)
    moved = loop.to_device({"input_ids": pinned, "attention_mask": pageable, "max_length_q": 3},
                           torch.device("cpu"))
    assert [(t is pinned, blocking) for t, blocking in copies] == [(True, True), (False, False)]
    assert type(moved["max_length_q"]) is int and moved["input_ids"] is pinned


def copies_and_forwards(run: Run, monkeypatch: pytest.MonkeyPatch, steps: int) -> tuple[list[str], list[Any]]:
    """The order of the loop's host-to-device copies and forwards over `steps` optimizer steps (`c<j>` / `f<j>`, j
    the micro-batch by first appearance), and the steps' results."""
    seen: list[torch.Tensor] = []
    events: list[str] = []
    real = loop.to_device

    def label(kind: str, ids: torch.Tensor) -> None:
        if not any(ids is s for s in seen):
            seen.append(ids)
        events.append(f"{kind}{next(i for i, s in enumerate(seen) if s is ids)}")

    def to_device(batch: dict[str, Any], device: torch.device, **kwargs: Any) -> dict[str, Any]:
        label("c", batch["input_ids"])
        return real(batch, device, **kwargs)

    monkeypatch.setattr(loop, "to_device", to_device)
    run.model.register_forward_pre_hook(lambda _m, _a, kwargs: label("f", kwargs["input_ids"]), with_kwargs=True)
    stage = run.curriculum.stages[0]
    enter_stage(run, stage, 0)
    results = [run_step(run, stage, step, step) for step in range(steps)]
    return events, results


def test_the_next_micro_batch_is_copied_before_the_current_forward(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batch j + 1's copy is issued before micro-batch j's forward (on CUDA it runs on a side stream while j
    computes); the losses and gradient norms are those of copying each batch just before its forward, to the bit."""
    overrides = ("train.grad_accum=3", "train.micro_batch_size=1", "stages.0.max_steps=2", "data.packing=true",
                 "data.max_seq_len=96")
    events, overlapped = copies_and_forwards(build_run(tmp_path / "a", *overrides), monkeypatch, steps=2)
    assert events == ["c0", "c1", "f0", "c2", "f1", "f2", "c3", "c4", "f3", "c5", "f4", "f5"]
    monkeypatch.setattr(loop, "OVERLAP_COPIES", False)
    events, in_turn = copies_and_forwards(build_run(tmp_path / "b", *overrides), monkeypatch, steps=2)
    assert events == ["c0", "f0", "c1", "f1", "c2", "f2", "c3", "f3", "c4", "f4", "c5", "f5"]
    for a, b in zip(overlapped, in_turn, strict=True):
        assert a.loss == b.loss and torch.equal(torch.as_tensor(a.grad_norm), torch.as_tensor(b.grad_norm))
