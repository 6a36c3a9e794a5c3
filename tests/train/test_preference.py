"""The preference losses (toolkit/train/preference.py) against TRL's DPOTrainer, and the per-pair log-probs of the
loss head against full logits.

TRL tokenizes the pairs and builds its batch; our side takes the same token ids as pair-ordered sequences and runs
them through the chunked loss head (several chunks per batch), padded or packed into one row. Both models are the
tiny Qwen3 in fp32 with the same LoRA adapter (B off zero). TRL, handed a PEFT model, keeps a copy of the adapter as
its reference ("ref"): the policy as it entered, our `reference: precompute`, which the scoring pass gives before
the adapter is nudged (both sides the same way) so the policy differs from its reference. TRL is a test dependency
(the `dev` extra): this file fails, it does not skip, without it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from trl import DPOConfig, DPOTrainer

from tests.helpers.seeded_lora import seeded_lora
from toolkit.data.collate import padding_collator, pair_collator, sides_collator
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.packing import PackedCollator
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import forward_sums
from toolkit.model.attention import SDPA_PACKED, register_kernels
from toolkit.model.loss_head import install_loss_head
from toolkit.runtime import process as distributed
from toolkit.train.preference import (
    METRICS,
    PairLogps,
    PreferenceSettings,
    global_normalisers,
    metric_sums,
    pair_counts,
    pair_metrics,
    policy_logps,
    preference_loss,
    preference_terms,
    reference_logps,
)

PAIRS = [("What is 2 + 2?", " 4.", " 5, or maybe 22."),
         ("Name a colour.", " Blue, like the sky over the sea at noon.", " Loud."),
         ("Spell cat.", " c a t", " k a t t"),
         ("Count to five.", " one two three four five", " one two four")]


@pytest.fixture(scope="module")
def tokenizer(models: dict[str, str]) -> Any:
    return AutoTokenizer.from_pretrained(models["text"])


def lora_model(models: dict[str, str], attn: str = "sdpa") -> PreTrainedModel:
    """The tiny Qwen3 with a seeded LoRA adapter whose B matrices are not zero (tests/helpers/seeded_lora.py)."""
    register_kernels()
    return seeded_lora(models["text"], attn)


def nudge(model: torch.nn.Module) -> None:
    """Move the trained adapter's B matrices (not TRL's "ref" copy), the same way on every model."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B.default" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)


# TRL's configs default to bf16 autocast, even on CPU: every TRL trainer here is built with bf16=False, to compare
# with our fp32 losses, and because accelerate's process-wide state, once built with bf16, makes every later
# Accelerator of the test session compute in bf16 (tests/train/test_pair_difficulty.py failed after this file).


def trl_trainer(models: dict[str, str], tokenizer: Any, tmp_path: Any, loss: list[str],
                weights: list[float] | None, label_smoothing: float) -> DPOTrainer:
    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    args = DPOConfig(output_dir=str(tmp_path / "trl"), loss_type=loss, loss_weights=weights, beta=0.1,
                     label_smoothing=label_smoothing, per_device_train_batch_size=len(PAIRS), report_to=[],
                     use_cpu=True, gradient_checkpointing=False, max_length=None, dataset_num_proc=None,
                     bf16=False)  # TRL's default is bf16 autocast (see below)
    return DPOTrainer(model=lora_model(models), args=args, train_dataset=data, processing_class=tokenizer)


def pair_sequences(rows: list[dict[str, Any]], sides: tuple[str, str] = ("chosen_ids", "rejected_ids")
                   ) -> list[dict[str, Any]]:
    """TRL's tokenized rows as our pair-ordered sequences: prompt + each of the two `sides` (a pair's chosen and
    rejected; a KTO row's completion and KL completion), labels on the completion."""
    out = []
    for row in rows:
        for side in sides:
            out.append({"input_ids": row["prompt_ids"] + row[side],
                        "labels": [IGNORE_INDEX] * len(row["prompt_ids"]) + row[side]})
    return out


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters()
            if "lora_" in n and p.grad is not None}


CASES = {"sigmoid": (["sigmoid"], None, 0.0), "ipo": (["ipo"], None, 0.0), "hinge": (["hinge"], None, 0.0),
         "robust": (["robust"], None, 0.2), "sigmoid+sft": (["sigmoid", "sft"], [0.7, 0.3], 0.0)}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_lora_gradients_equal_trl_dpo_trainer(models: dict[str, str], tokenizer: Any, tmp_path: Any,
                                                        case: str, packed: bool) -> None:
    loss_names, weights, smoothing = CASES[case]
    trainer = trl_trainer(models, tokenizer, tmp_path, loss_names, weights, smoothing)
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    batch = trainer.data_collator(rows)
    nudge(trainer.model)
    trainer.model.train()
    expected = trainer.compute_loss(trainer.model, batch)
    expected.backward()
    expected_grads = lora_grads(trainer.model)

    model = lora_model(models, SDPA_PACKED if packed else "sdpa")
    install_loss_head(model, "chunked", chunk_tokens=7)  # several chunks per batch
    sequences = pair_sequences(rows)
    collate = PackedCollator() if packed else padding_collator(tokenizer)
    accelerator = distributed.build_accelerator(1, 10)
    ref_chosen, ref_rejected = reference_logps(accelerator, model, sequences, collate, 3)
    nudge(model)
    model.train()
    chosen, rejected, chosen_tokens, rejected_tokens = policy_logps(model, collate(sequences), len(PAIRS),
                                                                    torch.device("cpu"))
    settings = PreferenceSettings(tuple(loss_names), tuple(weights) if weights else None, 0.1, smoothing)
    terms = preference_terms(settings, PairLogps(chosen, rejected, torch.from_numpy(ref_chosen),
                                                 torch.from_numpy(ref_rejected), chosen_tokens, rejected_tokens))
    ours = preference_loss(settings, terms, len(PAIRS), float(chosen_tokens.sum()))
    ours.backward()
    grads = lora_grads(model)

    # within 1e-6, relative once the loss passes 1: TRL's fp32 loss has a 2e-6 resolution at IPO's ~25
    assert abs(float(ours) - float(expected)) <= 1e-6 * max(1.0, abs(float(expected))), (float(ours), float(expected))
    assert float(expected) != pytest.approx(math.log(2), abs=1e-3)  # the policy is not its reference
    assert set(grads) == set(expected_grads) and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-6, msg=name)
    assert any(float(g.abs().max()) > 1e-4 for g in grads.values())  # gradients that could differ


@torch.no_grad()
def full_logits_logps(model: torch.nn.Module, sample: dict[str, Any]) -> float:
    logp = F.log_softmax(model(input_ids=torch.tensor([sample["input_ids"]])).logits[0].double(), dim=-1)
    targets = torch.tensor(sample["labels"][1:])
    keep = targets != IGNORE_INDEX
    return float(logp[:-1][keep].gather(1, targets[keep].unsqueeze(1)).sum())


def test_pair_logps_equal_full_logits_and_packed_equals_padded(models: dict[str, str], tokenizer: Any,
                                                               tmp_path: Any) -> None:
    rows = [trl_trainer(models, tokenizer, tmp_path, ["sigmoid"], None, 0.0).train_dataset[i]
            for i in range(len(PAIRS))]
    sequences = pair_sequences(rows)
    plain = lora_model(models)
    expected = np.array([full_logits_logps(plain, s) for s in sequences])
    results = {}
    for packed in (False, True):
        model = lora_model(models, SDPA_PACKED if packed else "sdpa")
        install_loss_head(model, "chunked", chunk_tokens=5)
        collate = PackedCollator() if packed else padding_collator(tokenizer)
        ref = reference_logps(distributed.build_accelerator(1, 10), model, sequences, collate, 2)
        # sums of up to ~150 fp32 token log-probs: within 1e-6, or 1e-7 relative (the scoring pass's own bound)
        np.testing.assert_allclose(np.stack(ref, 1).reshape(-1), expected, rtol=1e-7, atol=1e-6)
        chosen, rejected, _, _ = policy_logps(model, collate(sequences), len(PAIRS), torch.device("cpu"))
        (chosen.sum() - 2 * rejected.sum()).backward()
        np.testing.assert_allclose(torch.stack([chosen, rejected], 1).reshape(-1).detach().numpy(), expected,
                                   rtol=1e-7, atol=1e-6)
        results[packed] = lora_grads(model)
    for name, grad in results[True].items():
        torch.testing.assert_close(grad, results[False][name], rtol=0, atol=1e-5, msg=name)


def test_at_the_reference_the_sigmoid_loss_is_ln2_and_rewards_are_zero() -> None:
    logps = torch.tensor([-3.0, -7.5], dtype=torch.float64)
    tokens = torch.tensor([3, 5])
    terms = preference_terms(PreferenceSettings(), PairLogps(logps, logps - 1, logps, logps - 1, tokens, tokens))
    assert float(preference_loss(PreferenceSettings(), terms, 2, 6)) == pytest.approx(math.log(2), abs=1e-12)
    assert terms.chosen_rewards.abs().max() == 0 and terms.rejected_rewards.abs().max() == 0


def test_at_a_stage_s_entry_the_step_gives_its_reference_exactly(models: dict[str, str], tokenizer: Any,
                                                                  tmp_path: Any) -> None:
    """The step's collator (`pair_collator`'s sides) and the reference pass's, in micro-batches of 1 to 3 sides
    (other companions, other longest sides: 9 to 30 tokens), give every side bitwise the same log-prob, so at the
    entry the rewards are exactly 0 and `rewards/accuracies` is 0, as TRL's (which scores both in one batch).
    Padded to the longest side only, sides 0 and 2 differ by 4.8e-7 and the accuracy is 0.25."""
    rows = [trl_trainer(models, tokenizer, tmp_path, ["sigmoid"], None, 0.0).train_dataset[i]
            for i in range(len(PAIRS))]
    model = lora_model(models)
    install_loss_head(model, "chunked")
    sequences = pair_sequences(rows)
    collate = pair_collator(padding_collator(tokenizer)).inner  # what the step's micro-batches are padded by
    accelerator = distributed.build_accelerator(1, 10)
    model.train()
    chosen, rejected, c_tokens, r_tokens = policy_logps(model, collate(sequences), len(PAIRS), torch.device("cpu"))
    for micro in (1, 2, 3):
        ref_chosen, ref_rejected = reference_logps(accelerator, model, sequences, sides_collator(padding_collator(
            tokenizer)), micro)
        assert chosen.detach().numpy().tolist() == ref_chosen.tolist(), micro
        assert rejected.detach().numpy().tolist() == ref_rejected.tolist(), micro
        logps = PairLogps(chosen, rejected, torch.from_numpy(ref_chosen), torch.from_numpy(ref_rejected), c_tokens,
                          r_tokens)
        sums = metric_sums(preference_terms(PreferenceSettings(), logps)).tolist()
        assert sums[:4] == [0.0, 0.0, 0.0, 0.0], micro  # rewards, accuracies (a count), margins


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": ("dpo",)}, "names 'dpo'"), ({"loss": ()}, "is empty"), ({"loss": ("sft",)}, "only sft"),
    ({"loss": ("sigmoid", "sigmoid")}, "twice"), ({"loss_weights": (1.0, 2.0)}, "2 weights for 1"),
    ({"beta": 0.0}, "beta is 0.0"), ({"loss": ("robust",), "label_smoothing": 0.5}, "[0, 0.5)"),
    ({"label_smoothing": 0.1}, "only the robust loss"), ({"loss": ("orpo", "sigmoid")}, "takes no reference"),
    ({"loss": ("simpo",), "simpo_gamma": -1.0}, "simpo_gamma is -1.0")])
def test_bad_settings_are_refused_in_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ToolkitError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        PreferenceSettings(**kwargs)


def test_the_base_reference_is_the_model_with_its_adapter_off(models: dict[str, str], tokenizer: Any,
                                                               tmp_path: Any) -> None:
    rows = [trl_trainer(models, tokenizer, tmp_path, ["sigmoid"], None, 0.0).train_dataset[i] for i in range(2)]
    sequences = pair_sequences(rows)
    base = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    expected = np.array([full_logits_logps(base, s) for s in sequences])
    model = lora_model(models)
    install_loss_head(model, "chunked")
    accelerator = distributed.build_accelerator(1, 10)
    off = reference_logps(accelerator, model, sequences, padding_collator(tokenizer), 2, base=True)
    on = reference_logps(accelerator, model, sequences, padding_collator(tokenizer), 2)
    np.testing.assert_allclose(np.stack(off, 1).reshape(-1), expected, rtol=1e-7, atol=1e-6)
    assert np.abs(np.stack(on, 1).reshape(-1) - expected).max() > 1e-3  # the adapter is back on afterwards
    with pytest.raises(ToolkitError, match="full fine-tuning"):
        reference_logps(accelerator, base, sequences, padding_collator(tokenizer), 2, base=True)


def test_grad_accumulation_gives_the_global_batch_loss_gradients_and_metrics(models: dict[str, str],
                                                                             tokenizer: Any, tmp_path: Any) -> None:
    rows = [trl_trainer(models, tokenizer, tmp_path, ["sigmoid"], None, 0.0).train_dataset[i]
            for i in range(len(PAIRS))]
    sequences = pair_sequences(rows)
    settings = PreferenceSettings(("sigmoid", "sft"), (1.0, 0.5))
    accelerator = distributed.build_accelerator(1, 10)
    collate = padding_collator(tokenizer)
    results = []
    for split in ([sequences], [sequences[:4], sequences[4:]]):  # one micro-batch of 4 pairs, or 2 of 2
        model = lora_model(models)
        if len(split) == 2:  # as training loads it (toolkit/model/load.py): checkpointing changes no gradient
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        install_loss_head(model, "chunked", chunk_tokens=7)
        ref = reference_logps(accelerator, model, sequences, collate, 4)
        nudge(model)
        model.train()
        batches = [collate(part) for part in split]
        counts = [pair_counts(b) for b in batches]
        pairs, chosen_tokens = global_normalisers(accelerator, sum(c[0] for c in counts),
                                                  sum(c[1] for c in counts), divisor=len(split))
        total, parts, at = 0.0, [], 0
        for batch, (n, _) in zip(batches, counts, strict=True):
            chosen, rejected, c_tokens, r_tokens = policy_logps(model, batch, n, torch.device("cpu"))
            logps = PairLogps(chosen, rejected, torch.from_numpy(ref[0][at:at + n]),
                              torch.from_numpy(ref[1][at:at + n]), c_tokens, r_tokens)
            terms = preference_terms(settings, logps)
            loss = preference_loss(settings, terms, pairs, chosen_tokens) / len(split)  # accelerate's 1/accum
            loss.backward()
            total, at = total + float(loss), at + n
            parts.append((terms, logps))
        assert at == len(PAIRS)
        results.append((total, lora_grads(model), pair_metrics(accelerator, parts), counts))
    (one, grads_one, metrics_one, counts_one), (two, grads_two, metrics_two, counts_two) = results
    chosen_label_tokens = sum(sum(y != IGNORE_INDEX for y in s["labels"][1:]) for s in sequences[0::2])
    assert counts_one == [(4, chosen_label_tokens)] and sum(c[1] for c in counts_two) == chosen_label_tokens
    assert abs(one - two) < 1e-6
    for name, grad in grads_one.items():
        torch.testing.assert_close(grads_two[name], grad, rtol=0, atol=1e-6, msg=name)
    assert set(metrics_one) == set(METRICS)
    for name in METRICS:  # float32 log-probs, summed in another order: to 1e-6, as the gradients
        assert metrics_two[name] == pytest.approx(metrics_one[name], abs=1e-6)
    assert metrics_one["rewards/margins"] == pytest.approx(
        metrics_one["rewards/chosen"] - metrics_one["rewards/rejected"], abs=1e-12)
    assert metrics_one["rewards/chosen"] != 0


def reference_free_settings(objective: str) -> PreferenceSettings:
    """Our side of `reference_free_trainer`: ORPO's beta 0.1 (its NLL compared apart), SimPO's beta 2 and gamma 0.5."""
    return (PreferenceSettings(("orpo",), beta=0.1) if objective == "orpo"
            else PreferenceSettings(("simpo",), beta=2.0, simpo_gamma=0.5))


def reference_free_trainer(models: dict[str, str], tokenizer: Any, objective: str, **args: Any) -> Any:
    """TRL 1.16's ORPOTrainer, or CPOTrainer as SimPO (loss_type simpo, cpo_alpha 0), on PAIRS with the seeded LoRA
    of `lora_model`, the settings of `reference_free_settings`. Both live in `trl.experimental` (`from trl import
    ORPOTrainer` fails in TRL 1.16)."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    common = {"report_to": [], "use_cpu": True, "gradient_checkpointing": False, "bf16": False} | args
    if objective == "orpo":
        return ORPOTrainer(model=lora_model(models), args=ORPOConfig(beta=0.1, **common), train_dataset=data,
                           processing_class=tokenizer)
    return CPOTrainer(model=lora_model(models), args=CPOConfig(loss_type="simpo", beta=2.0, simpo_gamma=0.5,
                                                               cpo_alpha=0.0, **common),
                      train_dataset=data, processing_class=tokenizer)


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_orpo_and_simpo_end_to_end_equal_trl_s_trainers(models: dict[str, str], tokenizer: Any, tmp_path: Any,
                                                        objective: str) -> None:
    """Beside DPO's: TRL's ORPOTrainer (its full loss: the chosen NLL plus the odds-ratio term) and CPOTrainer with
    loss_type simpo (cpo_alpha 0: SimPO alone), each tokenising the same pairs and computing `compute_loss` on its
    own collated batch, against ours on TRL's tokens (its `chosen_input_ids` / `chosen_labels` as our sides): the
    loss and LoRA gradients within 1e-6. One difference is named, not hidden: TRL's ORPOTrainer takes its NLL over the
    chosen prompt and completion (its code: "orpo chosen nll loss is computed over the full prompt and response"),
    our `sft` term over the completion, as TRL's DPO `sft`; ORPO's pair term is compared with that NLL added."""
    settings = reference_free_settings(objective)
    trainer = reference_free_trainer(models, tokenizer, objective, output_dir=str(tmp_path / objective),
                                     per_device_train_batch_size=len(PAIRS))
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    nudge(trainer.model)
    trainer.model.train()
    expected = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
    expected.backward()
    expected_grads = lora_grads(trainer.model)

    model = lora_model(models)
    nudge(model)
    install_loss_head(model, "chunked", chunk_tokens=7)
    model.train()
    sequences = [{"input_ids": row[f"{side}_input_ids"], "labels": row[f"{side}_labels"]}
                 for row in rows for side in ("chosen", "rejected")]
    chosen, rejected, c_tokens, r_tokens = policy_logps(model, padding_collator(tokenizer)(sequences), len(PAIRS),
                                                        torch.device("cpu"))
    zeros = torch.zeros_like(chosen)
    terms = preference_terms(settings, PairLogps(chosen, rejected, zeros, zeros, c_tokens, r_tokens))
    ours = preference_loss(settings, terms, len(PAIRS), float(c_tokens.sum()))
    if objective == "orpo":  # TRL's NLL: every chosen token after the first, prompt included
        whole = [{"input_ids": row["chosen_input_ids"], "labels": row["chosen_input_ids"]} for row in rows]
        sums, tokens = forward_sums(model, padding_collator(tokenizer)(whole), torch.device("cpu"))
        ours = ours + sums.sum() / tokens.sum()
    ours.backward()
    grads = lora_grads(model)
    assert abs(float(ours) - float(expected)) <= 1e-6 * max(1.0, abs(float(expected))), (float(ours),
                                                                                        float(expected))
    assert set(grads) == set(expected_grads) and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-6, msg=name)
    assert any(float(g.abs().max()) > 1e-4 for g in grads.values())  # gradients that could differ


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_orpo_and_simpo_train_step_by_step_as_trl_s_trainers(models: dict[str, str], tokenizer: Any, tmp_path: Any,
                                                             objective: str) -> None:
    """A few optimizer steps, not one loss: TRL's own `train()` (ORPOTrainer; CPOTrainer as SimPO) on the 4 pairs in
    order (sequential sampler), 2 pairs a step, 4 steps (two epochs), AdamW at a constant lr 5e-3, clipping at 0.25,
    fp32 (`bf16=False`: TRL's configs default to bf16 autocast, on the CPU too), against our pair losses on TRL's
    tokens from the same LoRA with torch's AdamW and the same clipping. Per step: the loss, grad norm and TRL's
    logged metrics (`pair_metrics`; for ORPO and SimPO TRL logs the average log-probs as `logps/*`, beta times them
    as the rewards) within 1e-6 relative, the margin on its rewards' scale (fp32 averages of up to 30 token
    log-probs: a few 1e-7 apart by summation order), then the trained adapter within 1e-6. ORPO adds TRL's NLL over
    the chosen prompt and completion to our pair term, the one definition that differs (docs/preference.md)."""
    steps, pairs_per_step, lr, clip = 4, 2, 5e-3, 0.25
    trainer = reference_free_trainer(models, tokenizer, objective, output_dir=str(tmp_path / objective),
                                     per_device_train_batch_size=pairs_per_step, max_steps=steps, learning_rate=lr,
                                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                                     optim="adamw_torch", max_grad_norm=clip, bf16=False, logging_steps=1,
                                     save_strategy="no", train_sampling_strategy="sequential", seed=0)
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    trained = {n.replace(".default", ""): p.detach().clone() for n, p in trainer.model.named_parameters()
               if "lora_" in n}

    settings = reference_free_settings(objective)
    model = lora_model(models)
    install_loss_head(model, "chunked", chunk_tokens=7)
    model.train()
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    accelerator = distributed.build_accelerator(1, 10)
    collate = padding_collator(tokenizer)
    ours = []
    for step in range(steps):
        at = step * pairs_per_step % len(PAIRS)
        part = rows[at:at + pairs_per_step]
        sequences = [{"input_ids": row[f"{side}_input_ids"], "labels": row[f"{side}_labels"]}
                     for row in part for side in ("chosen", "rejected")]
        chosen, rejected, c_tokens, r_tokens = policy_logps(model, collate(sequences), len(part), torch.device("cpu"))
        zeros = torch.zeros_like(chosen)
        logps = PairLogps(chosen, rejected, zeros, zeros, c_tokens, r_tokens)
        terms = preference_terms(settings, logps)
        loss = preference_loss(settings, terms, len(part), float(c_tokens.sum()))
        if objective == "orpo":  # TRL's NLL: every chosen token after the first, prompt included
            whole = [{"input_ids": row["chosen_input_ids"], "labels": row["chosen_input_ids"]} for row in part]
            sums, tokens = forward_sums(model, collate(whole), torch.device("cpu"))
            loss = loss + sums.sum() / tokens.sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad()
        metrics = pair_metrics(accelerator, [(terms, logps)])
        ours.append({"loss": float(loss.detach()), "grad_norm": float(norm)} | metrics)

    assert len(logged) == steps
    for step, (mine, theirs) in enumerate(zip(ours, logged, strict=True)):
        for key in ("loss", "grad_norm", *METRICS):
            # the margin is a difference of the rewards: its error is theirs, so it is measured on their scale
            # (SimPO's beta 2 makes them about -6 and the margin about 0.5: CI once saw it 1.25e-6 apart at step 2)
            scale = max(abs(theirs[k]) for k in ("rewards/chosen", "rewards/rejected")) \
                if key == "rewards/margins" else abs(theirs[key])
            assert abs(mine[key] - theirs[key]) <= 1e-6 * max(1.0, scale), (step, key, mine[key], theirs[key])
    assert min(step["grad_norm"] for step in ours) > clip  # the clipping acts, so it is compared too
    assert abs(ours[-1]["loss"] - ours[1]["loss"]) > 1e-3  # the steps moved the adapter: rows 2-3 again, lower
    for name, value in model.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(value.detach(), trained[name.replace(".default", "")], rtol=0, atol=1e-6,
                                       msg=name)


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_reference_free_losses_equal_trl_orpo_and_cpo_simpo(models: dict[str, str], tokenizer: Any, tmp_path: Any,
                                                            objective: str) -> None:
    """ORPO and SimPO take no reference: their formulas against TRL's own ORPOTrainer.odds_ratio_loss and
    CPOTrainer.cpo_loss (loss_type simpo) on the same per-pair average log-probs, the loss and its LoRA gradients;
    the log-probs themselves are the ones proven above."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    rows = [trl_trainer(models, tokenizer, tmp_path, ["sigmoid"], None, 0.0).train_dataset[i]
            for i in range(len(PAIRS))]
    sequences = pair_sequences(rows)
    settings = (PreferenceSettings(("orpo", "sft"), beta=0.1) if objective == "orpo"
                else PreferenceSettings(("simpo",), beta=2.0, simpo_gamma=0.5))
    assert settings.reference_free
    grads, losses = [], []
    for side in ("trl", "ours"):
        model = lora_model(models)
        install_loss_head(model, "chunked", chunk_tokens=7)
        model.train()
        chosen, rejected, c_tokens, r_tokens = policy_logps(model, padding_collator(tokenizer)(sequences),
                                                            len(PAIRS), torch.device("cpu"))
        if side == "trl":
            trl_self = type("TrlSelf", (), {"beta": settings.beta, "alpha": 0.0, "loss_type": "simpo",
                                            "simpo_gamma": settings.simpo_gamma, "label_smoothing": 0.0,
                                            "accelerator": type("Acc", (), {"device": torch.device("cpu")})()})()
            c_mean, r_mean = chosen / c_tokens, rejected / r_tokens
            if objective == "orpo":
                ratio_losses = ORPOTrainer.odds_ratio_loss(trl_self, c_mean, r_mean)[0]
                loss = -chosen.sum() / c_tokens.sum() - ratio_losses.mean()  # ORPOTrainer: nll - mean(beta ratio)
            else:
                loss = CPOTrainer.cpo_loss(trl_self, c_mean, r_mean)[0].mean()
        else:
            zeros = torch.zeros_like(chosen)
            terms = preference_terms(settings, PairLogps(chosen, rejected, zeros, zeros, c_tokens, r_tokens))
            loss = preference_loss(settings, terms, len(PAIRS), float(c_tokens.sum()))
            assert torch.allclose(terms.chosen_rewards, settings.beta * (chosen / c_tokens).detach())
        loss.backward()
        losses.append(float(loss))
        grads.append(lora_grads(model))
    assert abs(losses[0] - losses[1]) < 1e-6, losses
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_the_pair_loss_normaliser_is_the_global_batch_s_over_2_processes(models: dict[str, str], tokenizer: Any,
                                                                        tmp_path: Any) -> None:
    """Issue 48's mutation audit: the grad-accumulation test above runs one process, so it cannot tell a per-rank
    normaliser from a global one. Two real processes (gloo) hold uneven shares of a global batch of 4 pairs (1 and
    3, unequal chosen-token counts too); with each micro-batch's loss divided by `global_normalisers` and the
    gradients averaged as DDP averages them, the gradients are the one-process global batch's (sigmoid + sft, so
    both the pair and the chosen-token normaliser count)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, free_port, run_env

    rows = [{"prompt_ids": tokenizer(p)["input_ids"], "chosen_ids": tokenizer(c)["input_ids"],
             "rejected_ids": tokenizer(r)["input_ids"]} for p, c, r in PAIRS]  # plain ids: no trainer needed
    sequences = pair_sequences(rows)
    settings = PreferenceSettings(("sigmoid", "sft"), (1.0, 0.5))
    accelerator = distributed.build_accelerator(1, 10)
    collate = padding_collator(tokenizer)
    model = lora_model(models)
    install_loss_head(model, "chunked", chunk_tokens=7)
    ref = reference_logps(accelerator, model, sequences, collate, 4)
    nudge(model)
    model.train()
    lora = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    batch = collate(sequences)
    n, tokens = pair_counts(batch)
    chosen, rejected, c_tokens, r_tokens = policy_logps(model, batch, n, torch.device("cpu"))
    logps = PairLogps(chosen, rejected, torch.from_numpy(ref[0]), torch.from_numpy(ref[1]), c_tokens, r_tokens)
    preference_loss(settings, preference_terms(settings, logps), float(n), float(tokens)).backward()
    expected = lora_grads(model)

    given, out = tmp_path / "given.pt", tmp_path / "grads.pt"
    torch.save({"sequences": sequences, "lora": lora, "ref_chosen": torch.from_numpy(ref[0]),
                "ref_rejected": torch.from_numpy(ref[1])}, given)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.pair_normaliser", models["text"], str(given),
                               str(out)], cwd=REPO, env=run_env() | {
                                   "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ACCELERATE_USE_CPU": "true"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    got = torch.load(out)
    assert got.keys() == expected.keys() and os.path.getsize(out) > 0
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=name)
