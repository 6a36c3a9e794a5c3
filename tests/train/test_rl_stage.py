"""An RL stage in the run (toolkit/train/rl_stage.py): where each completion of a step goes, its seed, the
refusals before anything heavy loads (each applied as it advises), rewards under TRL's contract, and completions that
do not depend on the rank or batch that draws them (a real tiny model)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from accelerate import Accelerator
from transformers import AutoTokenizer

from tests.train.test_grpo import lora_grads, lora_model, nudge
from toolkit.builtin.dummy_data import write_dummy_letters
from toolkit.builtin.models import TINY_MODEL
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.curriculum.pass_rates import SuccessRates
from toolkit.curriculum.sampling import StageSampler
from toolkit.curriculum.stages import rank_micro_batches
from toolkit.data.plan import drop_counts, kept_by_rank
from toolkit.errors import ToolkitError
from toolkit.evals.evaluator import import_scorers
from toolkit.evals.rewards import score_completions
from toolkit.evals.rollout import rollout
from toolkit.model.loss_head import install_loss_head
from toolkit.strategies.sequence_parallel import layout
from toolkit.train.grpo import GrpoSettings, completion_logps, grpo_loss, normaliser
from toolkit.train.rl_stage import (
    PASS_RATE_KEYS,
    GrpoObjective,
    RlState,
    check_rl_stages,
    correctness,
    draw_prompts,
    eos_ids,
    slots_of,
)


@pytest.mark.parametrize(("world", "accum", "micro"), [(1, 2, 4), (2, 1, 4), (2, 2, 2), (4, 1, 2)])
def test_completion_slots_are_the_data_loader_s_and_cover_the_global_batch_once(world: int, accum: int,
                                                                              micro: int) -> None:
    size = world * accum * micro
    everything = []
    for rank in range(world):
        mine = slots_of(rank, world, accum, micro)
        assert mine == rank_micro_batches(list(range(size)), rank=rank, world_size=world, micro_batch_size=micro,
                                          grad_accum=accum)
        everything += [c for js in mine for c in js]
    assert sorted(everything) == list(range(size))


def grpo_recipe(tmp_path: Path, *, rl: dict | None = None, rewards: list | None = None, micro: int = 2,
                **stage: Any) -> Any:
    tree = {"model": {"name_or_path": TINY_MODEL}, "lora": {"enabled": True},
            "train": {"micro_batch_size": micro, "grad_accum": 1},
            "stages": [{"name": "rl", "data": ["p.jsonl"], "max_steps": 1, "objective": "grpo",
                        "rl": rl or {"num_generations": 4}, "rewards": rewards or [{"scorer": "contains"}], **stage}]}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    return load_recipe(tmp_path / "recipe.yaml")


def test_num_generations_must_divide_the_global_batch_and_its_advice_fits(tmp_path: Path) -> None:
    place = layout(Accelerator(cpu=True))
    recipe = grpo_recipe(tmp_path, micro=2)  # 2 completions per step, groups of 4
    with pytest.raises(ToolkitError) as e:
        check_rl_stages(resolve_stages(recipe), grad_accum=1, place=place, vision=False)
    assert "stages.0 ('rl'): rl.num_generations 4 does not divide the global batch of 2 completions" in str(e.value)
    advised = int(re.search(r"set the stage's micro_batch_size to (\d+)", str(e.value)).group(1))
    check_rl_stages(resolve_stages(grpo_recipe(tmp_path, micro=advised)), grad_accum=1, place=place, vision=False)
    with pytest.raises(ToolkitError, match="objective grpo on a vision-language model is not supported yet"):
        check_rl_stages(resolve_stages(grpo_recipe(tmp_path, micro=4)), grad_accum=1, place=place, vision=True)
    trained = {"num_generations": 4, "dynamic_sampling": True, "max_resample": 2, "prioritize": "failure_rate",
               "num_iterations": 2, "beta": 0.04}
    check_rl_stages(resolve_stages(grpo_recipe(tmp_path, micro=4, rl=trained)), grad_accum=1, place=place,
                    vision=False)


def _stage(rows: int, order: list[int], index: int = 1) -> Any:
    """What `draw_prompts` and `RlState.rates_of` read of a stage: its rows and its sampler's batch."""
    return SimpleNamespace(index=index, data=SimpleNamespace(samples=[{}] * rows),
                           sampler=SimpleNamespace(batch=lambda step: list(order), kept=None))


def test_correctness_is_the_first_reward_above_one_half_and_none_is_wrong() -> None:
    table = torch.tensor([[1.0, 0.0], [0.4, 9.0], [float("nan"), 1.0], [0.6, float("nan")]], dtype=torch.float64)
    assert correctness(table).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_prompts_are_drawn_by_failure_rate_the_same_for_the_same_state_and_key() -> None:
    stage = _stage(6, [5, 4])
    rates = SuccessRates(6)
    rates.record([0, 0, 1, 1, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1])  # 0-3 always right: drawn last
    first = draw_prompts(stage, rates, 2, seed=3, step=4, step_in_stage=0, draw=0)
    assert sorted(first) == [4, 5]  # only 4 and 5 have weight; the sampler's order is not read
    copy = SuccessRates(6)
    copy.load_state_dict(rates.state_dict())
    assert draw_prompts(stage, copy, 2, seed=3, step=4, step_in_stage=0, draw=0) == first  # a resume draws the same
    many = draw_prompts(stage, rates, 8, seed=3, step=4, step_in_stage=0, draw=1)  # more than the stage holds
    assert len(many) == 8 and set(many[:6]) == set(range(6))
    assert draw_prompts(stage, None, 2, seed=3, step=4, step_in_stage=0, draw=0) == [5, 4]  # the sampler's batch
    later = [draw_prompts(stage, None, 2, seed=3, step=4, step_in_stage=0, draw=d) for d in (1, 1, 2)]
    assert later[0] == later[1] and all(0 <= i < 6 for i in later[0] + later[2])
    weighted = SuccessRates(6)
    weighted.record([0] * 10 + [1] * 10, [1] * 9 + [0] + [0] * 10)  # 0 fails 10%, 1 always; the rest never drawn
    counts = [0] * 6
    for step in range(3000):
        for i in draw_prompts(stage, weighted, 1, seed=0, step=step, step_in_stage=0, draw=0):
            counts[i] += 1
    assert counts[0] == pytest.approx(3000 * 0.1 / 5.1, rel=0.3) and counts[1] == pytest.approx(3000 / 5.1, rel=0.1)


def test_prompts_a_drop_leaves_out_are_never_drawn() -> None:
    """With a `drop` (by pass rate), prioritised draws and dynamic sampling's later draws pick kept prompts only."""
    stage = _stage(6, [1, 3])
    stage.sampler.kept = np.array([1, 3, 5])
    rates = SuccessRates(6)
    rates.record([1, 1, 3, 3], [1, 1, 1, 0])  # 1 always right: the others come first
    for step in range(20):
        for draw in (0, 1):
            got = draw_prompts(stage, rates, 2, seed=0, step=step, step_in_stage=0, draw=draw)
            assert len(set(got)) == 2 and set(got) <= {3, 5}
            assert set(draw_prompts(stage, None, 4, seed=0, step=step, step_in_stage=0, draw=1 + draw)) <= {1, 3, 5}
    assert sorted(draw_prompts(stage, rates, 3, seed=0, step=0, step_in_stage=0, draw=0)) == [1, 3, 5]


def test_a_stage_s_rates_come_from_the_checkpoint_and_go_back_to_it() -> None:
    state = RlState(saved_rates={"1": {"attempts": [2.0, 0.0, 1.0], "successes": [1.0, 0.0, 1.0]},
                                 "0": {"attempts": [1.0], "successes": [0.0]}})
    rates = state.rates_of(_stage(3, [0]))
    assert rates.rates[0] == 0.5 and rates.rates[2] == 1.0
    rates.record([1], [1.0])
    assert state.rates_state() == {"0": {"attempts": [1.0], "successes": [0.0]},
                                   "1": {"attempts": [2.0, 1.0, 1.0], "successes": [1.0, 1.0, 1.0]}}
    with pytest.raises(ToolkitError, match="the checkpoint's success rates cover 1 prompts but the stage has 3"):
        RlState(saved_rates={"1": {"attempts": [1.0], "successes": [0.0]}}).rates_of(_stage(3, [0]))
    assert RlState().rates_state() is None


def test_a_reward_module_that_does_not_import_stops_before_anything_heavy(tmp_path: Path) -> None:
    recipe = grpo_recipe(tmp_path, micro=4, rewards=[{"scorer": "contains"}, {"scorer": "my_rewards:brevity"}])
    with pytest.raises(ToolkitError) as e:
        import_scorers(recipe, tmp_path)  # train_curriculum.py's first step
    assert str(e.value).startswith("reward stages.0.rewards.1 ('my_rewards:brevity'): module 'my_rewards' could not "
                                   f"be imported from {tmp_path}")
    (tmp_path / "my_rewards.py").write_text("def brevity(prompts, completions, completion_ids, **kw):\n"
                                            "    return [1.0] * len(completions)\n")
    import_scorers(recipe, tmp_path)


def test_num_iterations_trains_one_rollout_twice_against_its_kept_logps(models: dict[str, str],
                                                                       tmp_path: Path) -> None:
    """rl.num_iterations 2 (TRL's semantics): the stage's step 0 draws a rollout, step 1 trains the same
    micro-batches again, step 2 draws anew; each step's loss equals `grpo_loss` computed here on the same completions
    with the policy's own log-probs before the update as `old_logps` (the rollout's kept ones: equal to them), so a
    moved policy's ratios are not 1. A resume inside the iterations is refused in one line."""
    (tmp_path / "iter_rewards.py").write_text("def length(prompts, completions, **kw):\n"
                                            "    return [float(len(c)) for c in completions]\n")
    recipe = grpo_recipe(tmp_path, micro=4, rl={"num_generations": 4, "num_iterations": 2,
                                                "max_completion_length": 5, "epsilon": 0.05},
                         rewards=[{"scorer": "iter_rewards:length"}])
    recipe.output_dir = str(tmp_path / "out")
    resolved = resolve_stages(recipe)[0]
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    model = lora_model(models["text"])
    install_loss_head(model, "chunked")
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for q in ("2 + 2?", "Count to three.")]
    samples = [{"prompt_ids": i, "prompt": "q", "reference": "4", "columns": {}, "where": f"p.jsonl:{n + 1}"}
               for n, i in enumerate(ids)]
    stage = SimpleNamespace(index=0, name="rl", resolved=resolved, plan=SimpleNamespace(micro_batch=4),
                            data=SimpleNamespace(samples=samples),
                            sampler=SimpleNamespace(batch=lambda s: [s % 2], kept=None))
    run = SimpleNamespace(accelerator=Accelerator(cpu=True), model=model, recipe=recipe,
                          rl=RlState(recipe_dir=tmp_path, tokenizer=tokenizer))
    objective = GrpoObjective()
    objective.enter(run, stage, 0)
    settings = GrpoSettings(num_generations=4, max_completion_length=5, epsilon=0.05, num_iterations=2)
    drawn, olds = None, []
    for step in range(3):
        micro = objective.micro_batches(run, stage, step, step)
        current = run.rl.current
        if step == 1:
            assert micro is drawn and current.old_logps is not None  # the same batch, trained again
        else:
            assert micro is not drawn
            drawn = micro
            olds = [completion_logps(model, mb.batch, m, settings.temperature)[0].detach()
                    for mb, m in zip(micro, current.masks, strict=True)]
            for kept, old, m in zip(current.old_logps, olds, current.masks, strict=True):
                torch.testing.assert_close(kept * m, old * m, atol=1e-4, rtol=1e-4)
        assert any(bool(a.abs().sum()) for a in current.advantages)  # the loss is not trivially 0
        loss = objective.begin(run, stage, micro, 1, whole=None)
        ours = [loss.micro(model, j, mb.batch) for j, mb in enumerate(micro)]
        divisor = normaliser(settings.loss_type, tokens=current.tokens, sequences=current.sequences,
                             max_completion_length=5)
        for j, mb in enumerate(micro):
            logps, _ = completion_logps(model, mb.batch, current.masks[j], settings.temperature)
            theirs, terms = grpo_loss(logps, current.masks[j], current.advantages[j], settings, divisor=divisor,
                                      old_logps=olds[j])
            torch.testing.assert_close(ours[j], theirs, atol=1e-5, rtol=1e-4)
            if step == 1:  # the policy moved: the ratio is not 1, so the old log-probs were read
                assert not torch.allclose(terms.ratio * current.masks[j], current.masks[j].float())
        nudge(model)  # stands in for the optimizer step
    rollouts = (tmp_path / "out" / "rollouts" / "rl.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rollouts] == [1] * 4 + [3] * 4  # two rollouts for three steps
    run.rl = RlState(recipe_dir=tmp_path, tokenizer=tokenizer, rewards=run.rl.rewards)  # a resume at stage step 1
    with pytest.raises(ToolkitError, match=r"stages.0 \('rl'\): the checkpoint is at step 1 of the stage, inside "
                                           r"the 2 updates \(rl.num_iterations\)"):
        objective.micro_batches(run, stage, 1, 1)


def test_beta_takes_the_kl_to_the_policy_at_the_stage_s_entry_and_a_resume_reads_it_back(models: dict[str, str],
                                                                                          tmp_path: Path) -> None:
    """rl.beta > 0: the stage's reference is the policy as it entered (its adapter copied at the entry, here an
    adapter already trained away from the base, as after an sft stage), not the base and not the moved policy. After
    the policy moved, a step's loss, its LoRA gradients and its `kl` equal `grpo_loss` with the reference log-probs
    of an independent frozen copy of the entry model (which tests/train/test_grpo.py checks against TRL's
    GRPOTrainer at beta 0.04, whose "ref" adapter is that same entry copy), within 1e-6. A resume inside the stage
    reads the copy back from the run folder (or, into a new output_dir, from the checkpoint's, copying it over); one
    whose copy is gone is refused in one line."""
    (tmp_path / "kl_rewards.py").write_text("def length(prompts, completions, **kw):\n"
                                          "    return [float(len(c)) for c in completions]\n")
    recipe = grpo_recipe(tmp_path, micro=4, rl={"num_generations": 4, "max_completion_length": 5, "beta": 0.5},
                         rewards=[{"scorer": "kl_rewards:length"}])
    recipe.output_dir = str(tmp_path / "out")
    resolved = resolve_stages(recipe)[0]
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    model = lora_model(models["text"])
    install_loss_head(model, "chunked", chunk_tokens=5)
    frozen = lora_model(models["text"])  # the same entry adapter (seeded), never trained
    install_loss_head(frozen, "chunked", chunk_tokens=5)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for q in ("2 + 2?", "Count to three.")]
    samples = [{"prompt_ids": i, "prompt": "q", "reference": "4", "columns": {}, "where": f"p.jsonl:{n + 1}"}
               for n, i in enumerate(ids)]
    stage = SimpleNamespace(index=0, name="rl", resolved=resolved, plan=SimpleNamespace(micro_batch=4, start_step=0),
                            data=SimpleNamespace(samples=samples),
                            sampler=SimpleNamespace(batch=lambda s: [s % 2], kept=None))
    identity = SimpleNamespace(base_model=models["text"], invariants={}, state="s", recipe_hash="h", data_stores=[],
                               stage_batches=[])

    def new_run() -> Any:
        return SimpleNamespace(accelerator=Accelerator(cpu=True), model=model, recipe=recipe, identity=identity,
                               resumed_from=None, rl=RlState(recipe_dir=tmp_path, tokenizer=tokenizer))

    run = new_run()
    objective = GrpoObjective()
    objective.enter(run, stage, 0)  # the stage's first step: the adapter as it is now is the reference
    settings = GrpoSettings(num_generations=4, max_completion_length=5, beta=0.5)
    nudge(model)  # the policy moved during the stage (stands in for its first updates)
    micro = objective.micro_batches(run, stage, 1, 1)
    current = run.rl.current
    assert any(bool(a.abs().sum()) for a in current.advantages)
    divisor = normaliser(settings.loss_type, tokens=current.tokens, sequences=current.sequences,
                         max_completion_length=5)
    loss = objective.begin(run, stage, micro, 1, whole=None)
    kl = tokens = 0.0
    for j, mb in enumerate(micro):
        model.zero_grad(set_to_none=True)
        ours = loss.micro(model, j, mb.batch)
        ours.backward()
        our_grads = lora_grads(model)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            ref, _ = completion_logps(frozen, mb.batch, current.masks[j], settings.temperature)
            moved, _ = completion_logps(model, mb.batch, current.masks[j], settings.temperature)
        assert float(((ref - moved).abs() * current.masks[j]).max()) > 1e-3  # the reference is not the policy now
        logps, _ = completion_logps(model, mb.batch, current.masks[j], settings.temperature)
        theirs, terms = grpo_loss(logps, current.masks[j], current.advantages[j], settings, divisor=divisor,
                                  ref_logps=ref)
        theirs.backward()
        assert terms.kl is not None
        kl, tokens = kl + float((terms.kl.detach() * current.masks[j]).sum()), tokens + float(current.masks[j].sum())
        assert abs(float(ours) - float(theirs)) <= 1e-6
        their_grads = lora_grads(model)
        assert set(our_grads) == set(their_grads) and our_grads
        for name, grad in our_grads.items():
            torch.testing.assert_close(grad, their_grads[name], rtol=0, atol=1e-6, msg=name)
        kept = current.ref_logps[j] * current.masks[j]
        torch.testing.assert_close(kept, ref * current.masks[j], rtol=0, atol=1e-6)
    objective.add_sums(run, loss.sums.tolist())
    record = objective.record(run)
    assert record["kl"] == pytest.approx(kl / tokens, abs=1e-6) and record["kl"] > 1e-4  # TRL's name, with beta > 0
    resumed = new_run()  # a resume inside the stage reads the entry's copy, not the moved policy's
    objective.enter(resumed, stage, 2)
    for name, value in run.rl.references[0].items():
        assert torch.equal(resumed.rl.references[0][name], value)
    moved = new_run()  # a resume into another output_dir takes the copy over from the checkpoint's run folder
    moved.recipe = recipe.model_copy(update={"output_dir": str(tmp_path / "moved")})
    moved.resumed_from = tmp_path / "out" / "checkpoints" / "step-00000002"
    objective.enter(moved, stage, 2)
    assert all(torch.equal(moved.rl.references[0][n], v) for n, v in run.rl.references[0].items())
    assert len(list((tmp_path / "moved" / "scores").glob("reference-*.safetensors"))) == 1
    for kept_file in (tmp_path / "out" / "scores").glob("reference-*.safetensors"):
        kept_file.unlink()
    with pytest.raises(ToolkitError, match=r"stage 'rl' \(rl.beta 0.5\): its KL reference, the policy at the "
                                           r"stage's first step 0, is missing"):
        objective.enter(new_run(), stage, 2)


def test_pass_rate_orders_and_drops_prompts_by_rollouts_at_the_entry_and_a_resume_reads_them(
        models: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """difficulty {by: pass_rate}: each prompt's failure rate is the share of its `samples` completions that the
    stage's first reward finds wrong, drawn by the policy as it enters (current) or with the adapter off (base),
    each completion seeded by (run seed, the stage's first step or 0, PASS_RATE_KEYS + prompt, sample): recomputed
    here with `rollout` itself. The sampler then goes from the most solved to the least, without the most solved
    quarter (drop.easiest). A resume reads the kept rates without generating; one whose file is gone is refused."""
    n, k = 8, 4
    rows = [json.loads(line) for line in write_dummy_letters(tmp_path, n, seed=0).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    model = lora_model(models["text"])
    install_loss_head(model, "chunked")
    nudge(model)  # the policy entering the stage is not the base
    ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
           for r in rows]
    samples = [{"prompt_ids": i, "prompt": r["prompt"], "reference": r["reference"], "columns": {},
                "where": f"letters.jsonl:{j + 1}"} for j, (i, r) in enumerate(zip(ids, rows, strict=True))]
    dropped = drop_counts(n, easiest=0.25, hardest=0.0)
    lengths = np.array([len(i) for i in ids])
    start = 3  # the stage's first step (current's seeds take it)

    def new_run(model_of: str) -> Any:
        recipe = grpo_recipe(tmp_path, micro=4, rl={"num_generations": 4, "max_completion_length": 4},
                             rewards=[{"scorer": {"kind": "contains", "lower": True}}], order="easy_to_hard",
                             difficulty={"by": "pass_rate", "model": model_of, "samples": k}, drop={"easiest": 0.25})
        recipe.output_dir = str(tmp_path / "out")
        sampler = StageSampler(sizes=[n], weights=None, replacement=False, order="easy_to_hard", difficulty=None,
                               lengths=lengths, pacing=None, seed=0, stage_index=0, global_batch=1, total_steps=6,
                               keep=kept_by_rank(lengths.astype(np.float64), *dropped))
        stage = SimpleNamespace(index=0, name="rl", resolved=resolve_stages(recipe)[0], sampler=sampler,
                                plan=SimpleNamespace(micro_batch=4, start_step=start),
                                data=SimpleNamespace(samples=samples, dropped_by_score=dropped, difficulty=None))
        identity = SimpleNamespace(base_model=models["text"], invariants={}, state="s", recipe_hash="h",
                                   data_stores=[], stage_batches=[])
        return stage, SimpleNamespace(accelerator=Accelerator(cpu=True), model=model, recipe=recipe,
                                      identity=identity, resumed_from=None,
                                      rl=RlState(recipe_dir=tmp_path, tokenizer=tokenizer))

    def measured(run: Any, at: int, base: bool) -> np.ndarray:
        (reward,) = run.rl.rewards[0]
        with model.disable_adapter() if base else contextlib.nullcontext():
            drawn = rollout(model, ids, [PASS_RATE_KEYS + i for i in range(n)], num_generations=k,
                            max_completion_length=4, temperature=1.0, top_p=1.0, seed=run.recipe.train.seed, step=at,
                            eos_ids=eos_ids(model, tokenizer), pad_id=tokenizer.pad_token_id, prompts_per_batch=n)
        references = [r["reference"] for r in rows for _ in range(k)]
        texts = tokenizer.batch_decode(drawn.completion_ids, skip_special_tokens=True)
        table, error = score_completions([reward], [r["prompt"] for r in rows for _ in range(k)],
                                         [[{"role": "assistant", "content": t}] for t in texts],
                                         drawn.completion_ids, {"reference": references}, references)
        assert error is None
        return 1.0 - correctness(table).view(n, k).mean(dim=1).numpy()

    stage, run = new_run("current")
    GrpoObjective().enter(run, stage, start)
    failure = stage.data.difficulty
    np.testing.assert_allclose(failure, measured(run, start, base=False), rtol=0, atol=1e-12)
    assert len(set(failure.tolist())) > 2  # the letters spread: common letters solved more often
    order = [stage.sampler.batch(s)[0] for s in range(n - dropped[0])]
    kept = np.flatnonzero(kept_by_rank(failure, *dropped))
    assert sorted(order) == kept.tolist()  # every kept prompt once, the most solved quarter left out
    assert failure[order].tolist() == sorted(failure[order].tolist())  # easy (most solved) to hard
    assert failure[[i for i in range(n) if i not in kept]].max() <= failure[kept].min()

    def no_generation(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a resume generated again")

    with monkeypatch.context() as patched:
        patched.setattr("toolkit.train.rl_stage.rollout", no_generation)
        stage, resumed = new_run("current")
        GrpoObjective().enter(resumed, stage, start + 2)  # a resume inside the stage reads the kept rates
        np.testing.assert_array_equal(stage.data.difficulty, failure)
        assert [stage.sampler.batch(s)[0] for s in range(n - dropped[0])] == order
        for kept_file in (tmp_path / "out" / "scores").glob("scores-*.npz"):
            kept_file.unlink()
        stage, resumed = new_run("current")
        with pytest.raises(ToolkitError, match=r"stage 'rl' pass rates \(4 completions a prompt by the current "
                                               r"model\): .* is missing or incomplete, and this launch resumes past"):
            GrpoObjective().enter(resumed, stage, start + 2)

    stage, run = new_run("base")  # the adapter off: the base's rates, not the entering policy's
    GrpoObjective().enter(run, stage, start)
    base = measured(run, 0, base=True)
    np.testing.assert_allclose(stage.data.difficulty, base, rtol=0, atol=1e-12)
