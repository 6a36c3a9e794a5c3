"""An RL stage in the run (toolkit/train/rl_stage.py): where each completion of a step goes, its seed, the
refusals before anything heavy loads (each applied as it advises), rewards under TRL's contract, and completions that
do not depend on the rank or batch that draws them (a real tiny model)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.builtin.models import TINY_MODEL
from toolkit.config.load import load_recipe
from toolkit.config.schema import RlConfig
from toolkit.config.stages import resolve_stages
from toolkit.curriculum.stages import rank_micro_batches
from toolkit.errors import ToolkitError
from toolkit.evals.scorers import check_reward_imports
from toolkit.strategies.sequence_parallel import layout
from toolkit.train.rl_stage import (
    Reward,
    check_rl_stages,
    generate_completions,
    sample_seed,
    score,
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


def test_a_completion_s_seed_depends_on_its_stage_step_prompt_and_sample_only() -> None:
    seeds = {sample_seed(7, stage, step, prompt, sample) for stage in range(2) for step in range(3)
             for prompt in range(4) for sample in range(4)}
    assert len(seeds) == 2 * 3 * 4 * 4 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(7, 1, 2, 3, 0) != sample_seed(8, 1, 2, 3, 0)


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


def test_a_reward_module_that_does_not_import_is_one_line_and_the_advice_fixes_it(tmp_path: Path) -> None:
    stages = grpo_recipe(tmp_path, micro=4, rewards=[{"scorer": "contains"}, {"scorer": "my_rewards:brevity"}]).stages
    with pytest.raises(ToolkitError) as e:
        check_reward_imports(stages, tmp_path)
    assert str(e.value).startswith("reward stages.0.rewards.1 ('my_rewards:brevity'): module 'my_rewards' could not "
                                   f"be imported from {tmp_path}")
    assert "put my_rewards.py next to the recipe" in str(e.value)
    (tmp_path / "my_rewards.py").write_text("def brevity(completions, **kw):\n    return [1.0] * len(completions)\n")
    check_reward_imports(stages, tmp_path)
    with pytest.raises(ToolkitError, match="scorer math is not available in this build yet"):
        check_reward_imports(grpo_recipe(tmp_path, micro=4, rewards=[{"scorer": "math"}]).stages, tmp_path)


def test_rewards_take_trl_s_contract_none_skips_and_a_raise_names_the_reward_and_rows() -> None:
    samples = [{"prompt": "2 + 2 =", "reference": "4", "columns": {"level": 1}, "where": "p.jsonl:1"},
               {"prompt": "3 + 3 =", "reference": "6", "columns": {"level": 2}, "where": "p.jsonl:2"}]
    seen: dict[str, Any] = {}

    def graded(*, prompts: list, completions: list, completion_ids: list, reference: list, level: list) -> list:
        seen.update(prompts=prompts, ids=completion_ids, level=level)
        return [1.0 if r in c else 0.0 for c, r in zip(completions, reference, strict=True)]

    def unsure(**_: Any) -> list:
        return [None, 0.5]

    table, error = score([Reward("graded", 1.0, "stages.0.rewards.0", graded),
                          Reward("unsure", 1.0, "stages.0.rewards.1", unsure)], samples, [" 4", " 5"], [[1], [2]])
    assert error is None and seen == {"prompts": ["2 + 2 =", "3 + 3 ="], "ids": [[1], [2]], "level": [1, 2]}
    np.testing.assert_array_equal(table, [[1.0, np.nan], [0.0, 0.5]])

    def broken(**_: Any) -> list:
        raise KeyError("solution")

    _, error = score([Reward("broken", 1.0, "stages.0.rewards.0", broken)], samples, [" 4", " 5"], [[1], [2]])
    assert error == ("reward stages.0.rewards.0 ('broken') raised KeyError: 'solution' (on the completions of "
                     "p.jsonl:1, p.jsonl:2).")


def test_a_completion_is_the_same_whichever_batch_or_rank_draws_it(models: dict[str, str]) -> None:
    tok = AutoTokenizer.from_pretrained(models["text"])
    model = AutoModelForCausalLM.from_pretrained(models["text"]).train()
    acc = Accelerator(cpu=True)
    rl = RlConfig(max_completion_length=6)
    a, b = tok("The sky is")["input_ids"], tok("2 + 2 = 4, 3 + 3 =")["input_ids"]
    jobs = [(a, sample_seed(7, 1, 0, 5, s)) for s in range(3)] + [(b, sample_seed(7, 1, 0, 9, 0))]
    together = generate_completions(acc, model, tok, rl, jobs)
    alone = [generate_completions(acc, model, tok, rl, [job])[0] for job in reversed(jobs)][::-1]
    assert together == alone
    assert len({tuple(c) for c in together[:3]}) == 3  # the samples of one prompt differ
    assert all(0 < len(c) <= 6 for c in together) and model.training  # sampled in eval mode, left training
