"""Stages ordered by models, end to end (recipes/smoke_curriculum_scored.yaml: an SFT stage of 3 steps easy_to_hard
by a separate scorer's loss at step 0, then a stage of 3 steps easy_to_hard by the policy's loss at its entry, step
3, its 3 easiest and 1 hardest of 30 rows dropped by that loss; a checkpoint per step).

One single-process run and 2-process runs under DDP, FSDP2, ZeRO-2, ZeRO-3, ZeRO-3 offload and Ulysses sp_size 2
(same global batches), then resumes of the single run from each of its 6 checkpoints (forked launches,
tests/helpers/relaunch.py), and a run stopped by SIGTERM inside its current-model pass, relaunched. Checked: every run
takes the same scores under the same keys (the separate scorer's too: loaded whole on each process, under ZeRO-3 and
FSDP2 as well) and trains the same losses; the current scores equal a pass recomputed here from the step-3
checkpoint's adapter; the scored stage's batches are its kept rows easiest first (each step's token count is its 4
rows' lengths), the dropped ones never drawn; every resume is exact, the ones inside a scored stage reading the
scores rather than scoring again (nor loading the scorer), and one whose run folder has no scores is refused in one
line; the stopped run keeps the pass's first block, and its relaunch scores the rest and trains as the uninterrupted
run, bit for bit. The recipe also trains under multinode_zero3.yaml (two "machines" on loopback).

`toolkit score` under `accelerate launch -m toolkit` (ZeRO-2; ZeRO-3 offload forked from the relauncher, its
`entry` "toolkit"), 2 processes: the single process's scores bit for bit, one report, and a file training then reads
instead of scoring.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import dummy_run_args, launch_cmd, relaunch, run_launch, train_forked
from tests.e2e.test_resume import EXACT_KEYS, assert_exact_from_every_checkpoint, records
from tests.e2e.test_strategies import two_machines_on_loopback
from toolkit.builtin.models import materialize_builtin
from toolkit.checkpoint.portable import portable_lora_file
from toolkit.commands.score import score
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.plan import KeptRows, load_training_set
from toolkit.evals.scoring import STOP_FAULT_ENV, row_sums
from toolkit.metrics.log import read_metrics
from toolkit.model.load import load_processing
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout
from toolkit.runtime.signals import PREEMPTED_EXIT_CODE
from toolkit.train.setup import build_collator, build_model

pytestmark = pytest.mark.slow

SCORED = "recipes/smoke_curriculum_scored.yaml"
EVERY = ("checkpoint.keep_last=6",)
ROWS = 32
TWO_PROCESSES = ("ddp", "fsdp", "zero2", "zero3", "zero3_offload", "zero3_sp2")
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

    # Stopped by SIGTERM inside the current model's pass (after its first block of 4 rows, STOP_FAULT_ENV), then
    # relaunched: the same command.
    stopped = tmp_path / "stopped"
    cut = train_forked("single", 1, stopped, *EVERY, recipe=SCORED, dummy_samples=ROWS, check=False,
                       env={STOP_FAULT_ENV: "4:the current model"})
    assert cut.returncode == PREEMPTED_EXIT_CODE, cut.stderr[-4000:]
    assert "4/30 rows (13%)" in cut.stderr and "during the scoring pass" in cut.stderr
    (partial,) = [f["done"] for f in scores_of(stopped).values() if not f["done"].all()]
    assert partial.tolist() == [True] * 4 + [False] * 26  # the finished block is kept
    again = train_forked("single", 1, stopped, *EVERY, recipe=SCORED, dummy_samples=ROWS)
    assert "resumed (exact) from" in again.stderr and "30/30 rows (100%)" in again.stderr
    assert "4/30 rows" not in again.stderr  # the kept block is not scored again
    theirs = scores_of(stopped)
    assert sorted(theirs) == sorted(files)
    assert all(np.array_equal(theirs[name][k], mine[k]) for name, mine in files.items() for k in mine)
    assert [[r[k] for k in EXACT_KEYS] for r in records(stopped)] == [[r[k] for k in EXACT_KEYS] for r in ref]
    final, got = (load_file(run / "final" / "adapter_model.safetensors") for run in (one, stopped))
    assert final.keys() == got.keys() and all(torch.equal(final[k], got[k]) for k in final)

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


def test_the_scored_recipe_trains_under_multinode_zero3(tmp_path: Path) -> None:
    """multinode_zero3.yaml as its header says to run it (the same command per machine, its --machine_rank; here
    both on loopback, 1 process each, the file's bf16), a step per stage: the pass runs across machines."""
    out = tmp_path / "multinode"
    two_machines_on_loopback("multinode_zero3", out, mixed_precision=None, recipe=SCORED,
                             overrides=("stages.0.max_steps=1", "stages.1.max_steps=1"))
    assert [r["stage"] for r in read_metrics(out / "metrics.jsonl", "train")] == ["sft", "scored"]
    assert all(f["done"].all() for f in scores_of(out).values())
    assert (out / "final" / "adapter_model.safetensors").is_file()


BASE = ("stages.1.difficulty.model=base", "train.micro_batch_size=1")
"""Stage scored by the base model's loss (scored before training, so `toolkit score` takes training's scores), one
row per forward: each row's sums then come from the same computation on any rank, bit for bit."""


def the_file(run: Path) -> tuple[str, dict[str, np.ndarray]]:
    """The one score file `toolkit score --stage scored` keeps."""
    (path,) = (run / "scores").glob("scores-*.npz")
    with np.load(path) as saved:
        return path.name, {k: saved[k] for k in saved.files}


@pytest.mark.timeout(900)
def test_toolkit_score_under_a_launch_scores_alike_and_training_reads_its_file(tmp_path: Path) -> None:
    one = tmp_path / "one"  # the single-process reference, in this process
    report = score(load_recipe(SCORED, [f"output_dir={one}", *BASE]), stage="scored", out=None, dummy_samples=ROWS)
    assert report is not None and "the scores training takes" in report
    name, single = the_file(one)
    table = pq.read_table(one / "scores" / "scored.parquet")
    for strategy in ("zero2", "zero3_offload"):  # the pass sharded over 2 ranks; under ZeRO-3 the model too
        out = tmp_path / strategy
        argv = ["score", "--config", SCORED, "--stage", "scored", "--num-dummy-samples", str(ROWS),
                f"output_dir={out}", *BASE]
        if strategy == "zero2":  # as a user launches it
            proc = run_launch([*launch_cmd(strategy, 2), "-m", "toolkit", *argv])
            code, output = proc.returncode, proc.stdout + proc.stderr
        else:  # the same, forked from the session's relauncher (accelerate's environment, without the imports)
            (code,) = relaunch(strategy, [(argv, out.with_suffix(".log"))], entry="toolkit")
            output = out.with_suffix(".log").read_text()
        assert code == 0, output[-4000:]
        assert output.count("rows scored by loss") == 1, output  # rank 0 alone reports
        assert f"2 process(es), {strategy}" in output and "hardest 5:" in output
        other, theirs = the_file(out)
        assert other == name, strategy  # training's key: processes and strategy are not part of it
        for k in single:
            np.testing.assert_array_equal(theirs[k], single[k], err_msg=f"{strategy}: {k}")
        got = pq.read_table(out / "scores" / "scored.parquet")
        assert got.drop(["row"]).equals(table.drop(["row"])), strategy
    # Training in the folder a 2-process `toolkit score` wrote reads its scores: no pass (stage sft's separate
    # scorer, which was not asked for, scores as it would).
    trained = train_forked("single", 1, tmp_path / "zero3_offload", *BASE, "stages.0.max_steps=1",
                           "stages.1.max_steps=1", recipe=SCORED, dummy_samples=ROWS)
    assert f"scored by the base model at step 0: read from {tmp_path / 'zero3_offload' / 'scores' / name}" in \
        trained.stderr
    assert "scored by the base model at step 0: 30/30 rows" not in trained.stderr  # the pass's progress line
