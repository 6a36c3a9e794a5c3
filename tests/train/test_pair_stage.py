"""A preference stage's settings as a run takes them (toolkit/train/pair_stage.py): the losses an objective trains,
how the model card names them, and the logging interval's TRL metrics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.train.test_loop import _kept, build_run  # noqa: F401  (the fixture keeps signal handlers off the runner)
from toolkit.config.load import load_recipe
from toolkit.config.schema import pair_losses
from toolkit.config.stages import resolve_stages
from toolkit.errors import ToolkitError
from toolkit.train.loop import enter_stage, run_step
from toolkit.train.pair_stage import (
    METRIC_SUMS,
    PairState,
    describe_objective,
    evaluate_pairs,
    settings_of,
    takes_reference,
)
from toolkit.train.preference import METRICS


def stage_of(*overrides: str):  # the embedded default's stage 1, made a preference stage by the overrides
    return resolve_stages(load_recipe(None, list(overrides)))[1]


@pytest.mark.parametrize(("overrides", "losses", "reference", "card"), [
    ([], ("sigmoid",), True, "dpo (sigmoid; beta 0.1; reference: the policy at the stage's entry)"),
    (["stages.1.preference={loss: [sigmoid, sft], loss_weights: [1, 0.5], beta: 0.2}"], ("sigmoid", "sft"), True,
     "dpo (sigmoid, sft x0.5; beta 0.2; reference: the policy at the stage's entry)"),
    (["stages.1.preference={loss: robust, label_smoothing: 0.1, reference: base}"], ("robust",), True,
     "dpo (robust; beta 0.1; label smoothing 0.1; reference: the base model (adapter off))"),
    (["stages.1.objective=orpo"], ("orpo",), False, "orpo (orpo; beta 0.1)"),
    (["stages.1.objective=orpo", "stages.1.preference={loss: [sft]}"], ("orpo", "sft"), False,
     "orpo (orpo, sft; beta 0.1)"),
    (["stages.1.objective=orpo", "stages.1.preference={loss: [sft], loss_weights: [0.25]}"], ("orpo", "sft"),
     False, "orpo (orpo, sft x0.25; beta 0.1)"),
    (["stages.1.objective=simpo", "stages.1.preference={beta: 2.0, simpo_gamma: 1.0}"], ("simpo",), False,
     "simpo (simpo; beta 2; gamma 1)"),
])
def test_an_objective_trains_its_losses_and_the_card_names_them(overrides: list[str], losses: tuple[str, ...],
                                                                 reference: bool, card: str) -> None:
    overrides = overrides if any("objective" in o for o in overrides) else ["stages.1.objective=dpo", *overrides]
    stage = stage_of(*overrides)
    assert stage.pairs
    settings = settings_of(stage)
    assert settings.loss == losses
    # One owner of each objective's loss rules: the recipe's check and the run's settings read the same function.
    assert (settings.loss, settings.loss_weights) == pair_losses(stage.objective, stage.preference)
    assert takes_reference(stage) is reference
    assert describe_objective(stage) == card


def test_an_sft_stage_is_named_sft() -> None:
    stage = stage_of()
    assert not stage.pairs and describe_objective(stage) == "sft"


def test_the_interval_metrics_are_means_over_its_pairs_and_start_afresh() -> None:
    state = PairState()
    assert state.record() == {}  # an interval without pairs (an sft stage) adds nothing to its record
    state.add([1.0, -1.0, 2.0, 2.0, -10.0, -12.0, 2.0])  # a step of 2 pairs
    state.add([3.0, -3.0, 2.0, 6.0, -8.0, -20.0, 2.0])  # and one of 2 more
    assert len(state.pending) == METRIC_SUMS
    got = state.record()
    assert list(got) == list(METRICS)
    assert got == {"rewards/chosen": 1.0, "rewards/rejected": -1.0, "rewards/accuracies": 1.0,
                   "rewards/margins": 2.0, "logps/chosen": -4.5, "logps/rejected": -8.0}
    assert state.record() == {}


def test_pref_accuracy_is_the_share_of_pairs_whose_chosen_reward_wins(tmp_path, models) -> None:
    """Issue 48's mutation audit: `pref_accuracy` of a stage's eval pairs (evaluate_pairs) against an independent
    computation: each side's summed log-prob from plain full logits in float64, rewards beta * (policy - reference),
    the share of pairs whose chosen reward beats the rejected one. The reference is set so that the rewards rank
    every pair the other way round from the raw log-probs: computed from raw log-probs, the accuracy would be 1 - it
    (3 pairs: never equal)."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.data.test_pair_data import stage_of as pair_stage_of
    from tests.data.test_pair_data import write
    from tests.data.test_pairs import USER
    from toolkit.data.collate import padding_collator
    from toolkit.data.encoding import IGNORE_INDEX
    from toolkit.data.plan import PairSides
    from toolkit.data.stages import load_curriculum_data
    from toolkit.model.loss_head import install_loss_head
    from toolkit.runtime import process as distributed
    from toolkit.train.pair_stage import Reference, evaluate_pairs

    tok = AutoTokenizer.from_pretrained(models["text"])
    answers = [("4.", "5, or maybe 22."), ("Blue, like the sky.", "Loud."), ("c a t", "k a t t")]
    path = write(tmp_path / "pairs.jsonl", [{"prompt": [USER], "chosen": [{"role": "assistant", "content": c}],
                                             "rejected": [{"role": "assistant", "content": r}]} for c, r in answers])
    stage, recipe = pair_stage_of(tmp_path, models["text"], [path], eval_paths=(path,))
    _, [evals] = load_curriculum_data([stage], recipe.data, tok, None, tmp_path, None)
    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32).eval()
    with torch.no_grad():  # independent of the toolkit's scoring: full logits, float64, per side
        logps = []
        for side in (PairSides(evals.parts)[i] for i in range(2 * len(answers))):
            logp = F.log_softmax(model(input_ids=torch.tensor([side["input_ids"]])).logits[0].double(), dim=-1)
            target = torch.tensor(side["labels"][1:])
            keep = target != IGNORE_INDEX
            logps.append(float(logp[:-1][keep].gather(1, target[keep].unsqueeze(1)).sum()))
    chosen, rejected = np.array(logps[0::2]), np.array(logps[1::2])
    raw_wins = chosen > rejected
    flip = np.where(raw_wins, -1.0, 1.0)  # the rewards: chosen loses where its raw log-prob wins, and the other way
    reference = Reference(chosen - flip, rejected.copy())
    beta = 0.1
    rewards_c, rewards_r = beta * (chosen - reference.chosen), beta * (rejected - reference.rejected)
    expected = float(np.mean(rewards_c > rewards_r))
    assert expected == pytest.approx(1 - float(np.mean(raw_wins))) and expected != float(np.mean(raw_wins))
    install_loss_head(model, "chunked")
    run = SimpleNamespace(accelerator=distributed.build_accelerator(1, 10), pairs=PairState(evals={0: reference}),
                          collate=padding_collator(tok), current_stage=1)
    got = evaluate_pairs(run, model, SimpleNamespace(resolved=stage, index=0, eval_rows=evals))
    assert got is not None and got["eval_pairs"] == len(answers)
    assert got["pref_accuracy"] == expected
    assert got["eval_rewards/margins"] == pytest.approx(float(np.mean(rewards_c - rewards_r)), abs=1e-5)


def test_eval_pairs_after_a_resume_into_a_later_stage(tmp_path: Path) -> None:
    """A run resumed into the stage after a dpo stage holds no reference in memory: the dpo stage's eval pairs (the
    forgetting matrix's, eval.all_stages) are scored against the reference read back from the run folder, never
    rescored with the later policy: the same metrics as the run that entered the stage.

    The same run takes the advice of each preference refusal (REFUSED: each refused, each fix loading): full
    fine-tuning (lora off) with the entry policy as reference, a dpo stage ordered by length with TRL's completion
    newline, then an orpo stage weighing its sft term; both train a step."""
    for bad, advice, fixed in REFUSED:
        with pytest.raises(ToolkitError, match=advice):
            load_recipe(None, bad)
        load_recipe(None, fixed)
    overrides = ("lora.enabled=false", "data.completion_newline=true", "stages.0.objective=dpo",
                 "stages.0.data=[dummy:pairs]", "stages.0.eval=[dummy:pairs]", "stages.0.difficulty={by: length}",
                 "stages.0.order=easy_to_hard", "stages.0.max_steps=1", "stages.1.objective=orpo",
                 "stages.1.data=[dummy:pairs]", "stages.1.preference={loss: [sft], loss_weights: [0.5]}",
                 "stages.1.max_steps=1", "train.micro_batch_size=2", "data.max_seq_len=96", "schedule.warmup_ratio=0")
    run = build_run(tmp_path, *overrides)
    dpo, orpo = run.curriculum.stages
    for step, stage in enumerate((dpo, orpo)):
        assert enter_stage(run, stage, step) is None
        result = run_step(run, stage, 0, step)
        assert math.isfinite(result.loss) and not result.skipped, stage.name
    expected = evaluate_pairs(run, run.model, dpo)
    assert expected is not None and expected["eval_rewards/margins"] != 0  # the policy moved from its reference
    again = build_run(tmp_path, *overrides)  # the relaunch: the same folder and weights, nothing in memory
    again.model.load_state_dict(run.model.state_dict())
    again.current_stage = 1
    assert dpo.index not in again.pairs.evals
    assert evaluate_pairs(again, again.model, again.curriculum.stages[0]) == expected
    assert again.pairs.evals[dpo.index].chosen.tolist() == run.pairs.evals[dpo.index].chosen.tolist()


REFUSED = [  # (a recipe's stage-1 overrides, the refusal's advice, the overrides that take it)
    (["stages.1.objective=orpo", "stages.1.preference={loss_weights: [0.5]}"],
     r"name it \(loss: \[sft\], loss_weights: \[w\]\)", ["stages.1.objective=orpo",
                                                         "stages.1.preference={loss: [sft], loss_weights: [0.5]}"]),
    (["lora.enabled=false", "stages.1.objective=dpo", "stages.1.preference={reference: base}"],
     "use reference: precompute", ["lora.enabled=false", "stages.1.objective=dpo",
                                   "stages.1.preference={reference: precompute}"]),
    (["stages.1.objective=dpo", "stages.1.difficulty={by: loss, model: current}", "stages.1.order=easy_to_hard"],
     r"order pairs by the model's margin or chosen_loss \(difficulty: \{by: margin, model: current\}\)",
     ["stages.1.objective=dpo", "stages.1.difficulty={by: margin, model: current}", "stages.1.order=easy_to_hard"]),
    (["data.completion_newline=true"], "give a stage objective: dpo", ["data.completion_newline=true",
                                                                      "stages.1.objective=dpo"]),
]


def test_the_card_names_a_grpo_stage_s_objective_not_sft() -> None:
    """The model card's and run page's objective column: a grpo stage names its loss, group size, KL and rewards
    (it used to read `sft`, as any stage that is not a pair stage did)."""
    from toolkit.train.pair_stage import describe_objective

    stages = resolve_stages(load_recipe("recipes/sft_then_grpo.yaml"))
    assert [describe_objective(s) for s in stages] == ["sft", "grpo (dapo; 4 generations; beta 0; rewards: contains)"]
