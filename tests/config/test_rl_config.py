"""An RL stage's recipe keys (`objective: grpo`, `rl:`, `rewards:`): TRL's GRPOConfig names and defaults, and the
refusals of keys that do not fit (each one line naming the key)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from trl import GRPOConfig

from toolkit.builtin.models import TINY_MODEL
from toolkit.config.identity import resume_invariants
from toolkit.config.load import load_recipe
from toolkit.config.schema import RlConfig
from toolkit.config.stages import resolve_stages
from toolkit.errors import ToolkitError

TRL_NAMED = ("loss_type", "num_generations", "max_completion_length", "temperature", "top_p", "beta", "epsilon",
             "epsilon_high", "scale_rewards", "mask_truncated_completions", "num_iterations")


def recipe(tmp_path: Path, grpo: dict, *, lora: bool = True) -> Path:
    tree = {"model": {"name_or_path": TINY_MODEL}, "lora": {"enabled": lora},
            "stages": [{"name": "sft", "data": ["a.jsonl"], "max_steps": 1},
                       {"name": "rl", "data": ["p.jsonl"], "max_steps": 1, **grpo}]}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_rl_keys_are_trl_s_names_with_trl_s_defaults() -> None:
    trl = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours = RlConfig()
    for key in TRL_NAMED:
        assert key in RlConfig.model_fields, key
        assert getattr(ours, key) == trl[key], key


def test_a_grpo_stage_resolves_its_settings_and_binds_a_checkpoint(tmp_path: Path) -> None:
    path = recipe(tmp_path, {"objective": "grpo", "rl": {"num_generations": 4, "loss_type": "dr_grpo"},
                             "rewards": [{"scorer": "contains"}, {"scorer": "my_rewards:fmt", "weight": 0.5},
                                         {"scorer": {"kind": "regex", "pattern": "(\\d+)", "name": "number"}}]})
    sft, rl = resolve_stages(load_recipe(path))
    assert sft.rl is None and not sft.prompts and rl.prompts and not rl.pairs
    assert (rl.rl.num_generations, rl.rl.loss_type, rl.rl.beta) == (4, "dr_grpo", 0.0)
    assert [(r.metric, r.weight, r.needs_reference) for r in rl.rewards] == [
        ("contains", 1.0, True), ("fmt", 0.5, False), ("number", 1.0, True)]
    bound = resume_invariants(load_recipe(path))
    assert "rl" not in bound["stages"][0] and bound["stages"][1]["rl"]["num_generations"] == 4  # sft stages as before
    other = recipe(tmp_path, {"objective": "grpo", "rl": {"num_generations": 2}, "rewards": [{"scorer": "contains"}]})
    assert resume_invariants(load_recipe(other)) != bound


@pytest.mark.parametrize(("stage", "lora", "says"), [
    ({"rl": {"beta": 0.1}}, True, "rl is set but the stage's objective is sft"),
    ({"objective": "grpo"}, True, "a grpo stage needs rewards"),
    ({"objective": "grpo", "rewards": [{"scorer": "maths"}]}, True, "unknown reward scorer 'maths' (did you mean"),
    ({"objective": "grpo", "rewards": [{"scorer": {"pattern": "x"}}]}, True, "names its kind"),
    ({"objective": "grpo", "rewards": [{"scorer": "exact"}, {"scorer": "exact"}]}, True, "reward names must be unique"),
    ({"objective": "grpo", "rewards": [{"scorer": "exact"}], "rl": {"max_resample": 2}}, True,
     "max_resample is read only with dynamic_sampling: true"),
    ({"objective": "grpo", "rewards": [{"scorer": "exact"}], "rl": {"num_generations": 1}}, True, "num_generations"),
    ({"objective": "grpo", "rewards": [{"scorer": "exact"}], "rl": {"beta": 0.04}}, False,
     "rl.beta is 0.04 but lora.enabled is false"),
    ({"objective": "grpo", "rewards": [{"scorer": "exact"}], "order": "easy_to_hard",
      "difficulty": {"by": "pass_rate"}}, True, "difficulty.by is pass_rate: name the model whose rollouts"),
    ({"objective": "grpo", "rewards": [{"scorer": "exact"}], "order": "easy_to_hard",
      "difficulty": {"by": "pass_rate", "model": "models/scorer"}}, True, "base (the LoRA adapter off) or current"),
    ({"order": "easy_to_hard", "difficulty": {"by": "length", "samples": 4}}, True,
     "difficulty.samples is read only with by: pass_rate"),
])
def test_rl_keys_that_do_not_fit_are_refused_naming_the_key(tmp_path: Path, stage: dict, lora: bool,
                                                             says: str) -> None:
    with pytest.raises(ToolkitError) as e:
        load_recipe(recipe(tmp_path, stage, lora=lora))
    assert says in str(e.value)


def test_an_rl_stage_may_gate_on_its_reward_without_evaluations(tmp_path: Path) -> None:
    grpo = {"objective": "grpo", "rewards": [{"scorer": "contains"}, {"scorer": "my_rewards:fmt"}]}
    gated = load_recipe(recipe(tmp_path, {**grpo, "advance_when": {"metric": "rewards/fmt/mean", "at_least": 0.9}}))
    assert gated.stages[1].advance_when.metric == "rewards/fmt/mean"  # no eval.every_steps: each logged step
    with pytest.raises(ToolkitError) as e:
        load_recipe(recipe(tmp_path, {**grpo, "advance_when": {"metric": "rewards", "at_least": 1}}))
    assert "advance_when.metric 'rewards' is not a metric this stage evaluates (did you mean reward?)" in str(e.value)


def test_a_recipe_as_the_run_folder_keeps_it_reads_back() -> None:
    """The run folder keeps the recipe with every default written out (the run page and the model card read it
    back): a grpo stage's dump validates again, and its objective is named from it, not as `sft` or a dpo stage."""
    from toolkit.config.schema import Recipe
    from toolkit.metrics.report import _objective

    tree = load_recipe("recipes/sft_then_grpo.yaml").model_dump(mode="json")
    assert Recipe.model_validate(tree).model_dump(mode="json") == tree
    assert _objective(tree["stages"][1]) == "grpo (dapo; 4 generations; beta 0; rewards: contains)"
