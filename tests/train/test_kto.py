"""The KTO loss (toolkit/train/kto.py) against TRL's KTOTrainer on the same batch, and its KL sides
(toolkit/data/plan.py `kl_partner`) against TRL's rotation of the completions.

TRL tokenizes the unpaired rows and builds its batch (each row's completion and its KL completion, the batch's
completions rotated by one); our side takes the same token ids as pair-ordered sequences (the row, then its KL
side: what `KtoRows` serves) through the chunked loss head, padded or packed. Both models are the tiny Qwen3 in
fp32 with the same LoRA adapter; TRL, handed a PEFT model, keeps a copy of the adapter as its reference ("ref"): the
policy as it entered, our `reference: precompute`, which the scoring pass gives before the adapter is nudged.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from datasets import Dataset
from trl import KTOConfig, KTOTrainer

from tests.data.test_pair_data import stage_of
from tests.train.test_preference import lora_grads, lora_model, nudge, pair_sequences
from toolkit.data.collate import padding_collator
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.plan import PairSides, kl_partner
from toolkit.data.stages import load_stage, run_stores
from toolkit.errors import ToolkitError
from toolkit.model.loss_head import install_loss_head
from toolkit.runtime import process as distributed
from toolkit.train.kto import KTO_SUMS, KtoSettings, kl_baseline, kto_losses, kto_metrics, kto_sums
from toolkit.train.preference import policy_logps, reference_logps

ROWS = [("What is 2 + 2?", " 4.", True), ("Name a colour.", " Loud.", False), ("Spell cat.", " c a t", True),
        ("Count to five.", " one two four", False), ("What is 2 + 2?", " 5, or maybe 22.", False),
        ("Name a colour.", " Blue, like the sky over the sea at noon.", True)]


@pytest.fixture(scope="module")
def tokenizer(models: dict[str, str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["text"])


def trl_trainer(models: dict[str, str], tokenizer: Any, tmp_path: Any, settings: KtoSettings, batch: int
                ) -> KTOTrainer:
    data = Dataset.from_list([{"prompt": p, "completion": c, "label": y} for p, c, y in ROWS])
    args = KTOConfig(output_dir=str(tmp_path / "trl"), beta=settings.beta, desirable_weight=settings.desirable_weight,
                     undesirable_weight=settings.undesirable_weight, per_device_train_batch_size=batch,
                     report_to=[], use_cpu=True, gradient_checkpointing=False, max_length=None,
                     dataset_num_proc=None, bf16=False)  # fp32 (test_preference.py, above trl_trainer)
    return KTOTrainer(model=lora_model(models), args=args, train_dataset=data, processing_class=tokenizer)


def kto_sequences(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's tokenized rows as our pair-ordered sequences: each row (prompt + completion) then its KL side
    (prompt + KL completion), labels on the completions."""
    return pair_sequences(rows, ("completion_ids", "KL_completion_ids"))


def test_kto_loss_and_lora_gradients_equal_trl_kto_trainer(models: dict[str, str], tokenizer: Any, tmp_path: Any
                                                           ) -> None:
    """Padded sides (the packed collator's per-sequence log-probs equal the padded ones: tests/train/
    test_preference.py); the KL sides as TRL rotates them, the weights unequal, the baseline above 0."""
    settings = KtoSettings(beta=0.1, desirable_weight=1.0, undesirable_weight=1.5)  # 3 and 3: weights that differ
    trainer = trl_trainer(models, tokenizer, tmp_path, settings, len(ROWS))
    rows = [trainer.train_dataset[i] for i in range(len(ROWS))]
    for k, row in enumerate(rows):  # our KL sides are TRL's: the same rotation of the completions
        assert row["KL_completion_ids"] == rows[kl_partner(k, len(rows), len(rows))]["completion_ids"], k
    # our data path (a kto store, KtoRows in chunks of the micro-batch) gives TRL's token ids: each row and its KL side
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": c, "label": y}) + "\n" for p, c, y in ROWS))
    stage, recipe = stage_of(tmp_path, models["text"], [path], objective="kto",
                             stage={"micro_batch_size": len(ROWS)})
    parts = load_stage(stage, recipe.data, run_stores([stage], recipe.data, tokenizer, None, tmp_path, None)
                       ).samples.parts
    assert list(PairSides(parts)) == kto_sequences(rows)
    batch = trainer.data_collator(rows)
    nudge(trainer.model)
    trainer.model.train()
    expected = trainer.compute_loss(trainer.model, batch)
    expected.backward()
    expected_grads = lora_grads(trainer.model)
    trl_kl = trainer._metrics["train"]["kl"][-1]

    model = lora_model(models)
    install_loss_head(model, "chunked", chunk_tokens=7)  # several chunks per batch
    sequences = kto_sequences(rows)
    collate = padding_collator(tokenizer)
    accelerator = distributed.build_accelerator(1, 10)
    ref_logps, ref_kl = (torch.from_numpy(x) for x in reference_logps(accelerator, model, sequences, collate, 3))
    nudge(model)
    model.train()
    with torch.no_grad():  # the step's KL sides, before its forward (toolkit/train/objectives.py _KtoLoss)
        _, kl_side, _, _ = policy_logps(model, collate(sequences), len(rows), torch.device("cpu"))
    kl_ratio = kl_side.double() - ref_kl
    kl, count = kl_baseline(accelerator, kl_ratio.sum(), torch.tensor(float(len(rows))), 1)
    logps, _, _, _ = policy_logps(model, collate(sequences), len(rows), torch.device("cpu"))
    desirable = torch.tensor([y for _, _, y in ROWS])
    ours = kto_losses(settings, logps, ref_logps, desirable, kl).sum() / count
    ours.backward()
    grads = lora_grads(model)

    # a baseline that is not clamped to 0; TRL's sums of fp32 log-probs of ~-60 hold ~4e-6 of rounding each
    assert trl_kl > 1e-3 and float(kl) == pytest.approx(trl_kl, abs=1e-5)
    assert abs(float(ours) - float(expected)) <= 1e-6, (float(ours), float(expected))
    assert set(grads) == set(expected_grads) and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-6, msg=name)
    assert any(float(g.abs().max()) > 1e-4 for g in grads.values())  # gradients that could differ
    metrics = kto_metrics(kto_sums(settings, logps, ref_logps, desirable, kl_ratio).tolist())
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert metrics[key] == pytest.approx(trainer._metrics["train"][key][-1], abs=1e-5), key
    assert metrics["kl"] == pytest.approx(trl_kl, abs=1e-5)


def test_the_kl_sides_rotate_within_each_batch_as_trl_s(models: dict[str, str], tokenizer: Any, tmp_path: Any) -> None:
    """TRL rotates the completions within each chunk of per_device_train_batch_size rows (4 and 2 of 6 here):
    `kl_partner` with the stage's micro_batch_size picks the same rows. On conversational rows, with
    data.completion_newline our data path gives TRL's token ids and labels exactly, each row and its KL side;
    without it, only each side's last label differs (the newline after <|im_end|>, untrained: docs/preference.md)."""
    conversational = [{"prompt": [{"role": "user", "content": p}],
                       "completion": [{"role": "assistant", "content": c.strip()}], "label": y} for p, c, y in ROWS]
    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     gradient_checkpointing=False, max_length=None, dataset_num_proc=None, bf16=False)
    rows = KTOTrainer(model=lora_model(models), args=args, train_dataset=Dataset.from_list(conversational),
                      processing_class=tokenizer).train_dataset
    partners = [kl_partner(k, len(rows), 4) for k in range(len(rows))]
    assert partners == [3, 0, 1, 2, 5, 4]
    for k, j in enumerate(partners):
        assert rows[k]["KL_completion_ids"] == rows[j]["completion_ids"], k
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in conversational))
    theirs = kto_sequences(list(rows))
    for newline in (True, False):
        stage, recipe = stage_of(tmp_path, models["text"], [path], objective="kto", completion_newline=newline,
                                 stage={"micro_batch_size": 4, "objective": "kto"})
        ours = list(PairSides(load_stage(stage, recipe.data, run_stores([stage], recipe.data, tokenizer, None,
                                                                         tmp_path, None)).samples.parts))
        assert [s["input_ids"] for s in ours] == [s["input_ids"] for s in theirs]
        if newline:
            assert ours == theirs
        else:
            assert all(o["labels"][:-1] == t["labels"][:-1] and o["labels"][-1] == IGNORE_INDEX
                       and tokenizer.decode(t["labels"][-1]) == "\n" for o, t in zip(ours, theirs, strict=True))


def test_at_the_reference_each_row_loses_half_its_weight_and_the_baseline_is_clamped() -> None:
    """At the stage's entry (policy = reference) every reward is 0: each row's loss is its weight x (1 - sigmoid(0));
    a negative KL estimate counts as 0, and the baseline carries no gradient."""
    settings = KtoSettings(desirable_weight=2.0, undesirable_weight=0.5)
    logps = torch.tensor([-3.0, -5.0], dtype=torch.float64, requires_grad=True)
    desirable = torch.tensor([True, False])
    accelerator = distributed.build_accelerator(1, 10)
    kl, rows = kl_baseline(accelerator, torch.tensor(-4.0, dtype=torch.float64), torch.tensor(2.0), 1)
    assert float(kl) == 0.0 and float(rows) == 2.0
    losses = kto_losses(settings, logps, logps.detach(), desirable, kl)
    assert losses.tolist() == [1.0, 0.25]
    kl, _ = kl_baseline(accelerator, torch.tensor(3.0, dtype=torch.float64, requires_grad=True), torch.tensor(2.0), 1)
    assert float(kl) == 1.5 and not kl.requires_grad
    assert len(KTO_SUMS) == 8
    with pytest.raises(ToolkitError, match="beta is 0"):
        KtoSettings(beta=0)


def test_a_kto_stage_under_ulysses_is_refused_before_the_data_work() -> None:
    """Its KL sides are not summed over a sequence-parallel group's slices: one line, before any model or data."""
    from types import SimpleNamespace

    from toolkit.config.load import load_recipe
    from toolkit.config.stages import resolve_stages
    from toolkit.train.setup import check_sequence_parallel

    recipe = load_recipe(None, ["stages.0.objective=kto"])
    accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=2), num_processes=2, process_index=0)
    with pytest.raises(ToolkitError, match=r"objective kto\) under Ulysses sequence parallelism is not supported"):
        check_sequence_parallel(accelerator, resolve_stages(recipe), "unread", vision=False, trust_remote_code=False)
    plain = SimpleNamespace(parallelism_config=None, num_processes=2, process_index=0)
    assert check_sequence_parallel(plain, resolve_stages(recipe), "unread", vision=False,
                                   trust_remote_code=False) is None
