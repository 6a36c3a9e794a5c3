"""The GRPO loss and advantages (toolkit/train/grpo.py) against TRL 1.16's GRPOTrainer, on the same completions
and rewards.

TRL's side is its own code: a GRPOTrainer on the tiny Qwen3 (fp32, a LoRA adapter with B off zero), whose
generation is replaced by the fixed completions below, so that `_generate_and_score_completions` computes its
advantages, truncation mask, old and reference log-probs from the fixed rewards, and `_compute_loss` its loss and
metrics; its LoRA gradients are then compared with ours. Our side takes the same token ids through the chunked loss
head (several chunks per batch) in its per-token mode, at TRL's sampling temperature. TRL, handed a PEFT model, keeps
a copy of the adapter as "ref": the policy at the stage's entry, our reference. Before the loss, both policies are
nudged the same way, so that with num_iterations 2 the ratios leave 1 and clip. One trainer serves every case:
loss_type, scale_rewards, beta, num_iterations and mask_truncated_completions are attributes its methods read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from trl import GRPOConfig, GRPOTrainer

from tests.helpers.seeded_lora import seeded_lora
from toolkit.builtin.dummy_data import write_dummy_letters
from toolkit.errors import ToolkitError
from toolkit.evals.rewards import build_rewards, score_completions
from toolkit.evals.rollout import rollout
from toolkit.model.loss_head import install_loss_head
from toolkit.train.grpo import (
    GrpoSettings,
    combined_rewards,
    completion_logps,
    group_advantages,
    grpo_loss,
    informative_groups,
    mask_truncated,
    metric_means,
    metric_sums,
    normaliser,
    policy_batch,
    tokens_to_grid,
    truncated,
)
from toolkit.train.rl_reference import entry_reference, reference_logps

G, L, TEMPERATURE, WEIGHTS = 4, 6, 0.7, (1.0, 0.5)
PROMPTS = ["What is 2 + 2?", "Count to five, slowly."]  # different lengths: the prompts are left-padded
# per prompt, G completions: token ids (2 = <|im_end|> ends one; L tokens without it = truncated)
COMPLETIONS = [[301, 295, 2], [456, 394, 703, 14, 455, 382], [33, 2], [312, 298, 312, 33, 16, 17],
               [16, 17, 18, 2], [455, 382, 16, 701, 702, 703], [2], [703, 14, 455, 2]]
# two rewards per completion (None: that reward skips it); row 6 no reward can score; group 1's first reward is
# mixed, its second constant
REWARDS: list[tuple[float | None, float | None]] = [(1.0, 0.2), (0.0, None), (1.0, 0.7), (0.0, 0.1),
                                                    (1.0, 0.3), (1.0, 0.3), (None, None), (0.0, 0.3)]


def lora_model(path: str) -> PreTrainedModel:
    """The tiny Qwen3 with a seeded LoRA adapter whose B matrices are not zero (tests/helpers/seeded_lora.py)."""
    return seeded_lora(path)


def nudge(model: torch.nn.Module) -> None:
    """Move the trained adapter (not TRL's "ref" copy) far enough that some ratios clip."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B.default" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.5)


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters()
            if "lora_" in n and ".ref." not in n and p.grad is not None}


def _reward(column: str) -> Any:
    def reward(prompts: list[Any], completions: list[Any], completion_ids: list[Any], **columns: Any) -> list[Any]:
        return columns[column]
    reward.__name__ = column
    return reward


@pytest.fixture(scope="module")
def trl(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[GRPOTrainer, dict[str, Any]]:
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    data = Dataset.from_list([{"prompt": p, "r1": 0.0, "r2": 0.0} for p in PROMPTS])
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=len(COMPLETIONS),
                      num_generations=G, max_completion_length=L, beta=0.04, epsilon=0.2, epsilon_high=0.28,
                      temperature=TEMPERATURE, reward_weights=list(WEIGHTS), use_cpu=True, report_to=[], bf16=False,
                      gradient_checkpointing=False)
    trainer = GRPOTrainer(model=lora_model(models["text"]), reward_funcs=[_reward("r1"), _reward("r2")], args=args,
                          train_dataset=data, processing_class=tokenizer)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(G)]

    def fixed_generation(prompts: list[Any]) -> tuple[Any, ...]:
        texts = tokenizer.batch_decode(COMPLETIONS, skip_special_tokens=True)
        return prompt_ids, [list(c) for c in COMPLETIONS], None, texts, None, {}, None, []

    trainer._generate = fixed_generation  # type: ignore[method-assign]
    trainer.current_gradient_accumulation_steps = 1
    state = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    return trainer, {"prompt_ids": prompt_ids, "tokenizer": tokenizer, "state": state}


def trl_run(trainer: GRPOTrainer, saved: dict[str, Any], settings: GrpoSettings
            ) -> tuple[float, dict[str, torch.Tensor], torch.Tensor, dict[str, float]]:
    """TRL's loss, LoRA gradients, advantages and metrics for the case."""
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if name in saved["state"]:
                param.copy_(saved["state"][name])
    trainer.model.zero_grad(set_to_none=True)
    trainer.loss_type, trainer.scale_rewards, trainer.beta = settings.loss_type, settings.scale_rewards, settings.beta
    trainer.num_iterations, trainer.mask_truncated_completions = (settings.num_iterations,
                                                                   settings.mask_truncated_completions)
    trainer._metrics["train"].clear()
    rows = [{"prompt": p, "r1": r[0], "r2": r[1]} for p, r in zip([p for p in PROMPTS for _ in range(G)], REWARDS,
                                                                   strict=True)]
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(rows)
    assert ("old_per_token_logps" in inputs and inputs["old_per_token_logps"] is not None) == (
        settings.num_iterations > 1)
    nudge(trainer.model)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), lora_grads(trainer.model), inputs["advantages"].detach().clone(), metrics


def padded(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = [([pad] * (width - len(r)) + r) if left else (r + [pad] * (width - len(r))) for r in rows]
    mask = [([0] * (width - len(r)) + [1] * len(r)) if left else ([1] * len(r) + [0] * (width - len(r)))
            for r in rows]
    return torch.tensor(ids), torch.tensor(mask)


@pytest.fixture(scope="module")
def ours(models: dict[str, str]) -> tuple[PreTrainedModel, dict[str, torch.Tensor]]:
    """Our policy (the same tiny Qwen3 and adapter) with the chunked loss head, and its adapter as it entered."""
    model = lora_model(models["text"])
    install_loss_head(model, "chunked", chunk_tokens=5)  # several chunks per batch
    return model, {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def our_run(ours: tuple[PreTrainedModel, dict[str, torch.Tensor]], saved: dict[str, Any], settings: GrpoSettings
            ) -> tuple[float, dict[str, torch.Tensor], torch.Tensor, dict[str, float]]:
    model, entry_state = ours
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in entry_state:
                param.copy_(entry_state[name])
    model.zero_grad(set_to_none=True)
    tokenizer = saved["tokenizer"]
    prompt_ids, prompt_mask = padded(saved["prompt_ids"], tokenizer.pad_token_id, left=True)
    completion_ids, completion_mask = padded(COMPLETIONS, tokenizer.pad_token_id, left=False)
    cut = torch.tensor(truncated(COMPLETIONS, [tokenizer.eos_token_id, tokenizer.pad_token_id]))
    if settings.mask_truncated_completions:
        completion_mask = mask_truncated(completion_mask, cut)
    batch = policy_batch(prompt_ids, prompt_mask, completion_ids, completion_mask)
    per_reward = torch.tensor([[math.nan if v is None else v for v in r] for r in REWARDS])
    advantages, _ = group_advantages(combined_rewards(per_reward, WEIGHTS), G, settings.scale_rewards)
    model.train()
    with torch.no_grad():  # the policy at the stage's entry is the reference, and the rollout's policy
        entry, _ = completion_logps(model, batch, completion_mask, TEMPERATURE)
    nudge(model)
    logps, entropies = completion_logps(model, batch, completion_mask, TEMPERATURE, entropy=True)
    divisor = normaliser(settings.loss_type, tokens=float(completion_mask.sum()), sequences=len(COMPLETIONS),
                         max_completion_length=settings.max_completion_length)
    loss, terms = grpo_loss(logps, completion_mask, advantages, settings, divisor=divisor,
                            old_logps=entry if settings.num_iterations > 1 else None,
                            ref_logps=entry if settings.beta > 0 else None)
    loss.backward()
    sums = metric_sums(terms, advantages, completion_mask, settings, entropies)
    return float(loss), lora_grads(model), advantages, metric_means(sums)


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_gradients_advantages_and_metrics_equal_trl_grpo_trainer(
        trl: tuple[GRPOTrainer, dict[str, Any]], ours: tuple[PreTrainedModel, dict[str, torch.Tensor]], beta: float,
        iterations: int) -> None:
    trainer, saved = trl
    clipped = 0.0
    for i, loss_type in enumerate(("grpo", "bnpo", "dr_grpo", "dapo")):
        for j, scale in enumerate(("group", "batch", "none")):
            for mask in [(i + j + iterations) % 2 == 1]:  # each loss_type with and without, each beta both ways
                settings = GrpoSettings(loss_type=loss_type, num_generations=G, max_completion_length=L,
                                        temperature=TEMPERATURE, beta=beta, epsilon=0.2, epsilon_high=0.28,
                                        scale_rewards=scale, mask_truncated_completions=mask,
                                        num_iterations=iterations)
                case = f"{loss_type}/{scale}/beta {beta}/iterations {iterations}/mask {mask}"
                expected, expected_grads, expected_adv, expected_metrics = trl_run(trainer, saved, settings)
                loss, grads, adv, metrics = our_run(ours, saved, settings)
                torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-6, msg=case)
                assert abs(loss - expected) <= 1e-6, (case, loss, expected)
                assert set(grads) == set(expected_grads) and grads, case
                for name, grad in grads.items():
                    torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-6, msg=f"{case}: {name}")
                assert any(float(g.abs().max()) > 1e-4 for g in grads.values()), case
                for name in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
                    if name in expected_metrics:
                        assert metrics[name] == pytest.approx(expected_metrics[name], abs=1e-6), (case, name)
                assert ("kl" in metrics) == (beta > 0), case
                clipped = max(clipped, metrics["clip_ratio/region_mean"])
    assert (clipped > 0) == (iterations > 1)  # the second iteration's ratios left the clip range


def test_the_run_s_entry_copy_as_reference_gives_trl_s_loss_and_gradients(
        trl: tuple[GRPOTrainer, dict[str, Any]], ours: tuple[PreTrainedModel, dict[str, torch.Tensor]],
        tmp_path: Path) -> None:
    """rl.beta > 0 in a run: the stage's reference is its trainable values copied at the stage's entry
    (toolkit/train/rl_reference.py `entry_reference`, here through a one-process run) and swapped into the moved
    policy for the reference forward (`reference_logps`). With those reference log-probs, the loss, every LoRA
    gradient and `kl` equal TRL's GRPOTrainer's (whose "ref" adapter is its copy of the adapter at the start of
    training) within 1e-6, at beta 0.04."""
    trainer, saved = trl
    model, entry_state = ours
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in entry_state:
                param.copy_(entry_state[name])
    tokenizer = saved["tokenizer"]
    prompt_ids, prompt_mask = padded(saved["prompt_ids"], tokenizer.pad_token_id, left=True)
    completion_ids, completion_mask = padded(COMPLETIONS, tokenizer.pad_token_id, left=False)
    batch = policy_batch(prompt_ids, prompt_mask, completion_ids, completion_mask)
    identity = SimpleNamespace(base_model="tiny", invariants={}, state="s", recipe_hash="h", data_stores=[],
                               stage_batches=[])
    run = SimpleNamespace(accelerator=Accelerator(cpu=True), model=model, recipe=SimpleNamespace(output_dir=tmp_path),
                          identity=identity, resumed_from=None)
    stage = SimpleNamespace(index=0, name="rl", plan=SimpleNamespace(start_step=0),
                            resolved=SimpleNamespace(rl=SimpleNamespace(beta=0.04)))
    values = entry_reference(run, stage, 0)  # the stage's first step: the adapter as it enters
    nudge(model)  # the policy moved during the stage
    (ref,) = reference_logps(run, values, [batch], [completion_mask], TEMPERATURE)
    model.train()
    per_reward = torch.tensor([[math.nan if v is None else v for v in r] for r in REWARDS])
    for loss_type in ("dapo",):  # TRL's default (every loss_type's arithmetic: the test above)
        settings = GrpoSettings(loss_type=loss_type, num_generations=G, max_completion_length=L,
                                temperature=TEMPERATURE, beta=0.04, epsilon=0.2, epsilon_high=0.28)
        expected, expected_grads, _, expected_metrics = trl_run(trainer, saved, settings)
        advantages, _ = group_advantages(combined_rewards(per_reward, WEIGHTS), G, settings.scale_rewards)
        model.zero_grad(set_to_none=True)
        logps, _ = completion_logps(model, batch, completion_mask, TEMPERATURE)
        divisor = normaliser(loss_type, tokens=float(completion_mask.sum()), sequences=len(COMPLETIONS),
                             max_completion_length=L)
        loss, terms = grpo_loss(logps, completion_mask, advantages, settings, divisor=divisor, ref_logps=ref)
        loss.backward()
        assert abs(float(loss) - expected) <= 1e-6, (loss_type, float(loss), expected)
        grads = lora_grads(model)
        assert set(grads) == set(expected_grads) and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-6, msg=f"{loss_type}: {name}")
        kl = metric_means(metric_sums(terms, advantages, completion_mask, settings))["kl"]
        assert kl == pytest.approx(expected_metrics["kl"], abs=1e-6) and kl > 1e-4, loss_type


def test_advantages_scale_by_group_or_batch_and_skip_unscorable() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, math.nan, 2.0])
    group, zero = group_advantages(rewards, 4, "group")
    assert group[:4].tolist() == pytest.approx([0.5 / (math.sqrt(1 / 3) + 1e-4), -0.5 / (math.sqrt(1 / 3) + 1e-4)] * 2)
    assert group[4:].tolist() == [0.0, 0.0, 0.0, 0.0] and zero.tolist() == [False] * 4 + [True] * 4
    none, _ = group_advantages(rewards, 4, "none")
    assert none[:4].tolist() == [0.5, -0.5, 0.5, -0.5]
    batch, _ = group_advantages(rewards, 4, "batch")
    std = float(torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0]).std())
    assert batch[0] == pytest.approx(0.5 / (std + 1e-4)) and batch[6] == 0.0
    weighted = combined_rewards(torch.tensor([[1.0, math.nan], [math.nan, math.nan], [0.0, 2.0]]), [1.0, 0.5])
    assert weighted[0] == 1.0 and math.isnan(weighted[1]) and weighted[2] == 1.0


def test_dynamic_sampling_keeps_groups_with_mixed_correctness() -> None:
    correct = torch.tensor([1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1])
    assert informative_groups(correct, 3).tolist() == [True, False, False, True]


def test_truncation_and_the_token_grid() -> None:
    assert truncated([[5, 2], [5, 6], [], [0]], [2, 0]) == [False, True, True, False]
    mask = mask_truncated(torch.tensor([[1, 1, 0], [1, 1, 1]]), torch.tensor([False, True]))
    assert mask.tolist() == [[1, 1, 0], [0, 0, 0]]
    flat = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    grid = tokens_to_grid(flat, torch.tensor([[1, 1, 0], [0, 1, 0]]))
    assert grid.tolist() == [[1.0, 2.0, 0.0], [0.0, 3.0, 0.0]]
    grid.sum().backward()
    assert flat.grad is not None and flat.grad.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="2 token values for 3"):
        tokens_to_grid(torch.ones(2), torch.tensor([[1, 1, 1]]))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_type": "ppo"}, "rl.loss_type is 'ppo'"), ({"scale_rewards": "mean"}, "rl.scale_rewards is 'mean'"),
    ({"num_generations": 1}, "rl.num_generations is 1"), ({"temperature": 0.0}, "rl.temperature is 0.0"),
    ({"top_p": 0.0}, "rl.top_p is 0.0"), ({"num_iterations": 0}, "rl.num_iterations is 0")])
def test_bad_settings_are_refused_in_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ToolkitError, match=message):
        GrpoSettings(**kwargs)


def test_completion_logps_of_the_chunked_head_equal_full_logits(models: dict[str, str],
                                                                ours: tuple[PreTrainedModel, Any]) -> None:
    """`completion_logps` through the chunked head (the `ours` model) and from full logits (no loss head, the
    user's `model.loss_head: standard`) agree, on left-padded prompts and masked completions."""
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    prompt_ids, prompt_mask = padded([tokenizer(p)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id, left=True)
    completion_ids, completion_mask = padded(COMPLETIONS[:2], tokenizer.pad_token_id, left=False)
    batch = policy_batch(prompt_ids, prompt_mask, completion_ids, completion_mask)
    plain = lora_model(models["text"])
    model, entry = ours
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in entry:
                param.copy_(entry[name])
        chunked, chunked_entropy = completion_logps(model, batch, completion_mask, 0.7, entropy=True)
        full, full_entropy = completion_logps(plain, batch, completion_mask, 0.7, entropy=True)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-5)
    assert full_entropy is not None and chunked_entropy is not None
    torch.testing.assert_close(chunked_entropy, full_entropy, rtol=0, atol=1e-5)
    assert bool((chunked[completion_mask == 0] == 0).all()) and float(chunked.min()) < -1


@pytest.mark.slow
def test_the_pieces_learn_the_letters_task(models: dict[str, str], tmp_path: Path) -> None:
    """The RL pieces in a plain loop (rollout, `contains` reward, group advantages, the dapo loss through the chunked
    head, AdamW on a LoRA adapter with lm_head) raise the tiny random Qwen3's reward on `dummy:letters` from about
    0.25 (chance) to well above it in 40 steps of 8 prompts x 8 completions (3 seeds gave 0.43-0.54; the first
    steps' mean varies by about 0.01 across seeds)."""
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    base = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    install_loss_head(model, "chunked")
    rows = [json.loads(line) for line in write_dummy_letters(tmp_path, 64, seed=0).read_text().splitlines()]
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in rows]
    (reward,) = build_rewards([{"scorer": {"kind": "contains", "lower": True}}], key="rewards", recipe_dir=tmp_path,
                              max_completion_length=4)
    settings = GrpoSettings(num_generations=8, max_completion_length=4)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    curve = []
    for step in range(40):
        pick = [(step * 8 + i) % len(rows) for i in range(8)]
        drawn = rollout(model, [prompts[i] for i in pick], pick, num_generations=8, max_completion_length=4,
                        temperature=1.0, top_p=1.0, seed=0, step=step, eos_ids=[tokenizer.eos_token_id],
                        pad_id=tokenizer.pad_token_id, prompts_per_batch=8)
        references = [rows[i]["reference"] for i in pick for _ in range(8)]
        table, error = score_completions([reward], references, tokenizer.batch_decode(
            drawn.completion_ids, skip_special_tokens=True), drawn.completion_ids, {"reference": references},
            references)
        assert error is None
        rewards = combined_rewards(table, [1.0])
        advantages, _ = group_advantages(rewards, 8, settings.scale_rewards)
        t = drawn.tensors(tokenizer.pad_token_id)
        mask = t["completion_mask"]
        model.train()
        logps, _ = completion_logps(model, policy_batch(t["prompt_ids"], t["prompt_mask"], t["completion_ids"], mask),
                                    mask, settings.temperature)
        divisor = normaliser(settings.loss_type, tokens=float(mask.sum()), sequences=64, max_completion_length=4)
        loss, _ = grpo_loss(logps, mask, advantages, settings, divisor=divisor)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append(float(rewards.mean()))
    first, last = sum(curve[:8]) / 8, sum(curve[-8:]) / 8
    assert first < 0.3 and last > first + 0.12, (first, last)
