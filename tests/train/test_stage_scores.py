"""Scores taken at a point of the run (toolkit/train/stage_scores.py): scored once where the key says, read back
afterwards without a forward, refused past that point when missing; the scorer's identity moves with what decides
its weights only."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.data.collate import padding_collator
from toolkit.data.encoding import encode_row
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import row_sums, sums_digest
from toolkit.model.loss_head import install_loss_head
from toolkit.runtime import process as distributed
from toolkit.train.stage_scores import scorer_identity, stage_entry_scores

ROWS = [("What is 2 + 2?", "4."), ("Name a colour.", "Blue, like the sky."), ("Spell cat.", "c a t")]


def test_scores_are_taken_once_where_the_key_says_and_read_back_after(tmp_path: Path,
                                                                      models: dict[str, str]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    samples: list[dict[str, Any]] = []
    for i, (q, a) in enumerate(ROWS):
        ids, labels = encode_row({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]},
                                 tokenizer, "assistant", f"rows.jsonl:{i + 1}")
        samples.append({"input_ids": ids, "labels": labels})
    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    head = install_loss_head(model, "chunked")
    assert head is not None
    accelerator, collate = distributed.build_accelerator(1, 10), padding_collator(tokenizer)
    with pytest.raises(ToolkitError, match="resumes past the point those scores were taken"):
        stage_entry_scores(accelerator, model, samples, collate, 2, folder=tmp_path, key="k", may_score=False,
                           what="stage 'b'")
    taken = stage_entry_scores(accelerator, model, samples, collate, 2, folder=tmp_path, key="k", may_score=True,
                               what="stage 'b'")
    np.testing.assert_array_equal(taken.loss, row_sums(accelerator, model, samples, collate, 2).loss)
    with torch.no_grad():  # the model moves on: a later launch reads the scores, it does not score again
        for p in model.parameters():
            p.add_(0.1)
    calls = head.calls
    again = stage_entry_scores(accelerator, model, samples, collate, 2, folder=tmp_path, key="k", may_score=False,
                               what="stage 'b'")
    assert head.calls == calls
    np.testing.assert_array_equal(again.loss, taken.loss)
    assert (tmp_path / "scores-k.npz").is_file()

    # What a checkpoint records of them (issue 48): a kept file edited after the run is refused, never used; one cut
    # short is refused in one line past the point (not "BadZipFile"), and scored again at it.
    digests: dict[str, str] = {}
    stage_entry_scores(accelerator, model, samples, collate, 2, folder=tmp_path, key="k", may_score=False,
                       what="stage 'b'", digests=digests)
    assert digests == {"k": sums_digest(taken)}
    path = tmp_path / "scores-k.npz"
    with np.load(path) as saved:
        kept = {k: saved[k] for k in saved.files}
    np.savez(path, **(kept | {"loss": kept["loss"] * 2}))  # edited: still a complete, readable file
    with pytest.raises(ToolkitError, match=r"stage 'b': .*scores-k.npz holds other scores than the checkpoint this "
                                           r"launch resumes from was trained with") as err:
        stage_entry_scores(accelerator, model, samples, collate, 2, folder=tmp_path, key="k", may_score=False,
                           what="stage 'b'", recorded=digests)
    assert head.calls == calls and "\n" not in str(err.value)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ToolkitError, match=r"scores-k.npz cannot be read \(BadZipFile: .*\), and this launch resumes "
                                           r"past the point those scores were taken"):
        stage_entry_scores(accelerator, model, samples, collate, 2, folder=tmp_path, key="k", may_score=False,
                           what="stage 'b'", recorded=digests)
    assert head.calls == calls
    rescored = stage_entry_scores(accelerator, model, samples, collate, 2, folder=tmp_path, key="k", may_score=True,
                                  what="stage 'b'")
    assert head.calls > calls and sums_digest(rescored) != digests["k"]  # the model moved: other scores, scored now


def test_the_current_scorer_is_the_run_at_a_step_and_the_base_scorer_is_not() -> None:
    run = SimpleNamespace(base_model="m", invariants={"model": {"name_or_path": "m"}}, state={"a": "1"},
                          recipe_hash="r", data_stores={"s": "x"}, stage_batches=[4, 4])
    assert scorer_identity(run, "current", 3) != scorer_identity(run, "current", 4)
    assert scorer_identity(run, "base", 3) == scorer_identity(run, "base", 0)
    other = SimpleNamespace(**{**vars(run), "recipe_hash": "r2"})
    assert scorer_identity(other, "current", 3) != scorer_identity(run, "current", 3)
    assert scorer_identity(other, "base", 0) == scorer_identity(run, "base", 0)  # the base model did not change


def test_fp32_and_bf16_passes_never_share_a_scores_file() -> None:
    """Issue 51: the launch's mixed precision is part of the scorer's identity (a bf16 pass sums other numbers),
    for both scorers; an fp32 launch's identity is the one it had before the precision was added (its files stay)."""
    run = SimpleNamespace(base_model="m", invariants={"model": {"name_or_path": "m"}}, state={"a": "1"},
                          recipe_hash="r", data_stores={"s": "x"}, stage_batches=[4, 4])
    for scorer in ("base", "current"):
        fp32 = scorer_identity(run, scorer, 3)
        assert scorer_identity(run, scorer, 3, precision="no") == fp32 and "precision" not in fp32
        assert scorer_identity(run, scorer, 3, precision="bf16") != fp32
        assert scorer_identity(run, scorer, 3, precision="bf16") != scorer_identity(run, scorer, 3, precision="fp16")
