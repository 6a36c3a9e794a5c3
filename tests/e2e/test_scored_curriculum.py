"""Stages ordered by models, end to end (recipes/smoke_curriculum_scored.yaml: an SFT stage of 3 steps easy_to_hard
by a separate scorer's loss at step 0, then a stage of 3 steps easy_to_hard by the policy's loss at its entry, step
3, its 3 easiest and 1 hardest of 30 rows dropped by that loss; a checkpoint per step).

One single-process run and 2-process runs under DDP, FSDP2, ZeRO-3 and Ulysses sp_size 2 (same global batches),
then resumes of the single run from each of its 6 checkpoints (forked launches, tests/helpers/relaunch.py).
Checked: every run takes the same scores under the same keys (the separate scorer's too: loaded whole on each
process, under ZeRO-3 and FSDP2 as well) and trains the same losses; the current scores equal a pass recomputed
here from the step-3 checkpoint's adapter; the scored stage's batches are its kept rows easiest first (each step's
token count is its 4 rows' lengths), the dropped ones never drawn; every resume is exact, the ones inside a scored
stage reading the scores rather than scoring again (nor loading the scorer), and one whose run folder has no scores
is refused in one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.conftest import dummy_run_args, relaunch, train_forked
from tests.e2e.test_resume import assert_exact_from_every_checkpoint
from toolkit.builtin.models import materialize_builtin
from toolkit.checkpoint.portable import portable_lora_file
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.plan import KeptRows, load_training_set
from toolkit.evals.scoring import row_sums
from toolkit.metrics.log import read_metrics
from toolkit.model.load import load_processing
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout
from toolkit.train.setup import build_collator, build_model

pytestmark = pytest.mark.slow

SCORED = "recipes/smoke_curriculum_scored.yaml"
EVERY = ("checkpoint.keep_last=6",)
ROWS = 32
TWO_PROCESSES = ("ddp", "fsdp", "zero3", "zero3_sp2")
"""Under Ulysses (zero3_sp2) the 2 processes are one data-parallel replica: the single process's batches as they are;
the others take 2 x 1 micro-batches where it takes 1 x 2."""


def scores_of(run: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every score file of the run (the separate scorer's of stage sft, the current model's of stage scored)."""
    out = {}
    for path in sorted((run / "scores").glob("scores-*.npz")):
        with np.load(path) as saved:
            out[path.name] = {k: saved[k] for k in saved.files}
    assert len(out) == 2, sorted(out)
    return out


@torch.no_grad()
def recomputed(run: Path, ckpt: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loss sums, token counts, lengths) of the scored stage's kept rows under the checkpoint's adapter: the
    recipe's model built as training builds it, the adapter loaded from the checkpoint's portable file."""
    recipe = load_recipe(SCORED, [f"output_dir={run}"])
    model_path = materialize_builtin(recipe.model.name_or_path, RunLayout(run).cache)
    _, tokenizer = load_processing(model_path, vision=False, trust_remote_code=False, chat_template=None)
    model, _ = build_model(recipe, resolve_stages(recipe), model_path, vision=False)
    with safe_open(portable_lora_file(ckpt), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    loaded = 0
    for name, param in model.named_parameters():
        if f"param/{name}" in stored:
            param.copy_(stored[f"param/{name}"])
            loaded += 1
    assert loaded > 0
    data = recipe.data
    rows = load_training_set([run / "dummy_data" / "stage2.jsonl"], tokenizer, max_seq_len=data.max_seq_len,
                             overlength=data.overlength, train_on=data.train_on, thinking=data.thinking,
                             packing=False, needs_difficulty=False)
    kept = KeptRows(rows.samples.parts)
    sums = row_sums(distributed.build_accelerator(1, 10), model, kept,
                    build_collator(recipe, model_path, tokenizer, vision=False), 2)
    return sums.loss, sums.tokens, np.asarray(rows.lengths)


@pytest.mark.timeout(1200)
def test_a_stage_ordered_by_current_loss_scores_alike_follows_the_policy_at_entry_and_resumes_exactly(
        tmp_path: Path) -> None:
    one = tmp_path / "one"
    first = train_forked("single", 1, one, *EVERY, recipe=SCORED, dummy_samples=ROWS)
    assert "stage 'scored': ordered easy_to_hard by loss of the current model (30 rows" in first.stderr
    assert "stage 'scored': dropped the 3 easiest and the 1 hardest of its 30 rows by loss of the current model " \
           "(26 kept)" in first.stderr
    assert "stage 'sft': ordered easy_to_hard by loss of the scorer builtin:tiny-qwen3" in first.stderr
    assert "loaded whole on each process" in first.stderr
    files = scores_of(one)
    assert all(f["done"].all() for f in files.values())
    ref = read_metrics(one / "metrics.jsonl", "train")
    for strategy in TWO_PROCESSES:  # the pass sharded over 2 ranks; under ZeRO-3 and FSDP2 the model too
        two = tmp_path / strategy
        split = () if strategy.endswith("_sp2") else ("train.grad_accum=1",)
        train_forked(strategy, 2, two, *split, recipe=SCORED, dummy_samples=ROWS)
        theirs = scores_of(two)
        assert sorted(theirs) == sorted(files), strategy  # the same keys: processes, strategy, batch split are not
        for key, mine in files.items():
            assert theirs[key]["done"].all()
            np.testing.assert_array_equal(theirs[key]["tokens"], mine["tokens"])
            np.testing.assert_allclose(theirs[key]["loss"], mine["loss"], rtol=1e-6, err_msg=f"{strategy} {key}")
        got = read_metrics(two / "metrics.jsonl", "train")
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5), strategy

    loss, tokens, lengths = recomputed(one, one / "checkpoints" / "step-00000003")
    single = next(f for f in files.values() if np.array_equal(f["tokens"], tokens))  # the scored stage's file
    np.testing.assert_allclose(loss, single["loss"], rtol=1e-6)
    easiest_first = np.argsort(loss / tokens, kind="stable")
    kept = easiest_first[3:-1]  # 10% of 30 rows dropped at the easy end (3), 5% at the hard end (1)
    cumulative = {r["step"]: r["tokens"] for r in ref}
    for k, step in enumerate((4, 5, 6)):  # global batch 4: the stage's k-th batch is the next 4 easiest kept rows
        assert cumulative[step] - cumulative[step - 1] == int(lengths[kept[4 * k:4 * k + 4]].sum())

    argv = dummy_run_args(*EVERY, recipe=SCORED, dummy_samples=ROWS)
    assert_exact_from_every_checkpoint("single", one, argv, steps=6, mixed_precision="no")
    for step in (2, 4, 5):  # resumed inside a scored stage, into a new output_dir: the scores taken at 0 and 3
        log = (tmp_path / f"one-from-{step}.log").read_text()
        assert "stage 'sft' scored by the scorer builtin:tiny-qwen3 at step 0: read from" in log
        assert step == 2 or "scored by the current model at step 3: read from" in log
        assert "rows/s" not in log.split("resumed (exact)")[1]  # nothing scored again
        assert "loaded whole on each process" not in log  # nor the scorer loaded

    # A checkpoint inside the stage whose run folder holds no scores: refused, not scored with the later policy.
    orphan = tmp_path / "elsewhere" / "checkpoints" / "step-00000005"
    shutil.copytree(one / "checkpoints" / "step-00000005", orphan)
    out = tmp_path / "orphan"
    (code,) = relaunch("single", [([*argv, f"output_dir={out}", f"checkpoint.resume={orphan}"],
                                   out.with_suffix(".log"))], mixed_precision="no")
    assert code == 2
    assert "resumes past the point those scores were taken" in out.with_suffix(".log").read_text()
