"""An RL stage in the run (toolkit/train/rl_stage.py): where each completion of a step goes, its seed, the
refusals before anything heavy loads (each applied as it advises), rewards under TRL's contract, and completions that
do not depend on the rank or batch that draws them (a real tiny model)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from accelerate import Accelerator

from toolkit.builtin.models import TINY_MODEL
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.curriculum.stages import rank_micro_batches
from toolkit.errors import ToolkitError
from toolkit.evals.evaluator import import_scorers
from toolkit.strategies.sequence_parallel import layout
from toolkit.train.rl_stage import (
    check_rl_stages,
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
    for key, value in (("beta", 0.04), ("num_iterations", 2), ("dynamic_sampling", True)):
        with pytest.raises(ToolkitError, match=f"rl.{key} is {value}, which this build does not train yet"):
            recipe = grpo_recipe(tmp_path, micro=4, rl={"num_generations": 4, key: value})
            check_rl_stages(resolve_stages(recipe), grad_accum=1, place=place, vision=False)


def test_a_reward_module_that_does_not_import_stops_before_anything_heavy(tmp_path: Path) -> None:
    recipe = grpo_recipe(tmp_path, micro=4, rewards=[{"scorer": "contains"}, {"scorer": "my_rewards:brevity"}])
    with pytest.raises(ToolkitError) as e:
        import_scorers(recipe, tmp_path)  # train_curriculum.py's first step
    assert str(e.value).startswith("reward stages.0.rewards.1 ('my_rewards:brevity'): module 'my_rewards' could not "
                                   f"be imported from {tmp_path}")
    (tmp_path / "my_rewards.py").write_text("def brevity(prompts, completions, completion_ids, **kw):\n"
                                            "    return [1.0] * len(completions)\n")
    import_scorers(recipe, tmp_path)
