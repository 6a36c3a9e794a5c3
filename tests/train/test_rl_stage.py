"""An RL stage in the run (toolkit/train/rl_stage.py): where each completion of a step goes, its seed, the
refusals before anything heavy loads (each applied as it advises), rewards under TRL's contract, and completions that
do not depend on the rank or batch that draws them (a real tiny model)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from accelerate import Accelerator

from toolkit.builtin.models import TINY_MODEL
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.curriculum.pass_rates import SuccessRates
from toolkit.curriculum.stages import rank_micro_batches
from toolkit.errors import ToolkitError
from toolkit.evals.evaluator import import_scorers
from toolkit.strategies.sequence_parallel import layout
from toolkit.train.rl_stage import (
    RlState,
    check_rl_stages,
    correctness,
    draw_prompts,
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


def grpo_recipe(tmp_path: Path, *, rl: dict | None = None, rewards: list | None = None, micro: int = 2) -> Any:
    tree = {"model": {"name_or_path": TINY_MODEL}, "lora": {"enabled": True},
            "train": {"micro_batch_size": micro, "grad_accum": 1},
            "stages": [{"name": "rl", "data": ["p.jsonl"], "max_steps": 1, "objective": "grpo",
                        "rl": rl or {"num_generations": 4}, "rewards": rewards or [{"scorer": "contains"}]}]}
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
    for key, value in (("beta", 0.04), ("num_iterations", 2)):
        with pytest.raises(ToolkitError, match=f"rl.{key} is {value}, which this build does not train yet"):
            recipe = grpo_recipe(tmp_path, micro=4, rl={"num_generations": 4, key: value})
            check_rl_stages(resolve_stages(recipe), grad_accum=1, place=place, vision=False)
    trained = {"num_generations": 4, "dynamic_sampling": True, "max_resample": 2, "prioritize": "failure_rate"}
    check_rl_stages(resolve_stages(grpo_recipe(tmp_path, micro=4, rl=trained)), grad_accum=1, place=place,
                    vision=False)


def _stage(rows: int, order: list[int], index: int = 1) -> Any:
    """What `draw_prompts` and `RlState.rates_of` read of a stage: its rows and its sampler's batch."""
    return SimpleNamespace(index=index, data=SimpleNamespace(samples=[{}] * rows),
                           sampler=SimpleNamespace(batch=lambda step: list(order)))


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
