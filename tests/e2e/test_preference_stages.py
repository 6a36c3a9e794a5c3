"""SFT then DPO in one launch, end to end (recipes/sft_then_dpo.yaml: a LoRA SFT stage of 3 steps on dummy rows, then
a DPO stage of 3 steps on dummy pairs, its reference the policy as it enters the stage; a checkpoint per step).

One single-process run is the reference. Checked against it:
* the DPO stage's first step: the policy equals its reference, so the sigmoid loss is ln 2 and the rewards are 0,
  although the SFT stage moved the adapter (its lora_B left zero);
* grad_accum 2 vs 1 (micro-batches of 2 vs 4 pairs) and 2 processes under DDP, FSDP2, ZeRO-2, ZeRO-3 (with gradient
  checkpointing) and ZeRO-3 offload: the same reference log-probs, per-step losses, TRL's metrics and final adapter;
  Ulysses (zero3_sp2, each side's tokens split over the 2 processes) too;
* the forgetting matrix over both stages' evals: the DPO stage's eval pairs from its entry on;
* exact resume from each of the 6 checkpoints, under every strategy above, those inside the DPO stage reading the
  reference back;
* a run stopped by SIGTERM inside the reference pass (TOOLKIT_FAULT_STOP_SCORING) keeps its finished block, and its
  relaunch finishes the pass and trains exactly as the uninterrupted run;
* `reference: base` (the adapter switched off) after the LoRA SFT stage starts away from ln 2;
* the DPO stage ordered by the entry policy's margins (`difficulty: {by: margin, model: current}`, a drop): one
  scoring pass, and an exact resume from a checkpoint inside it.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from tests.conftest import REPO, dummy_run_args, free_port, relaunch, run_launch, train_forked
from tests.e2e.test_resume import assert_exact_from_every_checkpoint
from tests.e2e.test_strategies import two_machines_on_loopback
from toolkit.checkpoint.portable import portable_lora_file
from toolkit.evals.scoring import STOP_FAULT_ENV
from toolkit.metrics.log import read_metrics
from toolkit.runtime.signals import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

RECIPE = "recipes/sft_then_dpo.yaml"
EVERY = ("checkpoint.keep_last=6",)
ROWS = 32
LN2 = math.log(2)
TWO_PROCESSES = ("ddp", "fsdp", "zero2", "zero3", "zero3_offload")
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")


def by_step(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl", "train")}


def references(run: Path) -> dict[str, dict[str, np.ndarray]]:
    """The run's score files (name -> arrays): the DPO stage's train and eval reference log-probs."""
    out = {}
    for path in sorted((run / "scores").glob("scores-*.npz")):
        with np.load(path) as saved:
            out[path.name] = {k: saved[k] for k in saved.files}
    return out


def final_adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "adapter_model.safetensors")


def assert_same_training(run: Path, ref: Path, what: str, *, same_recipe: bool = True) -> None:
    """`run` trained as `ref`: its losses, TRL's metrics, reference log-probs and final adapter. The references'
    key holds the recipe (the entry state is a function of it): a run of another recipe keeps them under another
    key (`same_recipe` False), with the same values."""
    got, want = by_step(run), by_step(ref)
    assert sorted(got) == sorted(want), what
    for step, r in want.items():
        assert got[step]["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7), (what, step)
        for key in TRL_METRICS:
            if key in r:
                assert got[step][key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), (what, step, key)
    theirs, mine = references(run), references(ref)
    if same_recipe:  # the same keys: processes, strategy and batch split are not in them
        assert theirs.keys() == mine.keys(), what
    assert len(theirs) == len(mine), what
    for (name, arrays), got in zip(mine.items(), theirs.values(), strict=True):
        assert got["done"].all(), (what, name)
        np.testing.assert_allclose(got["loss"], arrays["loss"], rtol=1e-6, err_msg=f"{what} {name}")
    a, b = final_adapter(run), final_adapter(ref)
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=f"{what}: {k}")


@pytest.mark.timeout(1800)
def test_sft_then_dpo_starts_at_ln2_agrees_across_strategies_and_resumes_exactly(tmp_path: Path) -> None:
    one = tmp_path / "one"
    first = train_forked("single", 1, one, *EVERY, recipe=RECIPE, dummy_samples=ROWS)
    assert "stage 'dpo': entry-policy reference log-probs of" in first.stderr
    steps = by_step(one)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert {steps[s]["stage"] for s in (4, 5, 6)} == {"dpo"}
    entry = steps[4]
    assert entry["loss"] == pytest.approx(LN2, abs=1e-6)  # the policy is its own reference at the stage's entry
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert entry[key] == 0.0, key  # exactly, as TRL's: the step and its reference pass pad sides alike
    assert entry["lr"] > 0  # the recipe's first DPO step trains (no warmup step at lr 0)
    assert steps[5]["loss"] != pytest.approx(LN2, abs=1e-4)  # and then it learns
    assert all(k in steps[5] for k in TRL_METRICS) and all(k not in steps[3] for k in TRL_METRICS)
    evals = [r for r in read_metrics(one / "metrics.jsonl") if "pref_accuracy" in r]
    assert [r["step"] for r in evals] == [6] and 0.0 <= evals[0]["pref_accuracy"] <= 1.0
    sft_adapter = load_file(portable_lora_file(one / "checkpoints" / "step-00000003"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in sft_adapter.items())  # SFT moved the policy
    assert "| dpo | dpo (sigmoid; beta 0.1; reference: the policy at the stage's entry) |" in \
        (one / "final" / "README.md").read_text()

    # 1 micro-batch of 4 pairs per step instead of 2 of 2; and the forgetting matrix over both stages' evals (loss
    # evaluations leave training as it is).
    accum = tmp_path / "accum1"
    train_forked("single", 1, accum, "train.micro_batch_size=4", "train.grad_accum=1", "eval.all_stages=true",
                 "stages.0.eval=[dummy:stage2]", recipe=RECIPE, dummy_samples=ROWS)
    assert_same_training(accum, one, "grad_accum 1", same_recipe=False)
    matrix = [json.loads(line) for line in (accum / "evals" / "matrix.jsonl").read_text().splitlines()]
    cells = {(r["step"], r["eval_stage"], r["metric"]) for r in matrix}
    # At step 3 the DPO stage has no reference yet: only the SFT stage's eval; at 6 both, the pairs' accuracy too.
    assert cells == {(3, "sft", "eval_loss"), (6, "sft", "eval_loss"), (6, "dpo", "eval_loss"),
                     (6, "dpo", "pref_accuracy")}
    for strategy in TWO_PROCESSES:  # the pass sharded over 2 ranks; under ZeRO-3 and FSDP2 the model too
        two = tmp_path / strategy
        # ZeRO-3 with gradient checkpointing and LoRA: two forwards per step fail there (a CheckpointError, seen
        # with TRL); a step here is one forward of both sides, the reference taken by the pass before the stage.
        checkpointed = ("model.gradient_checkpointing=true",) if strategy == "zero3" else ()
        overrides = (*EVERY, "train.grad_accum=1", *checkpointed)
        train_forked(strategy, 2, two, *overrides, recipe=RECIPE, dummy_samples=ROWS)
        assert_same_training(two, one, strategy, same_recipe=not checkpointed)
        assert by_step(two)[4]["loss"] == pytest.approx(LN2, abs=1e-6), strategy
        assert by_step(two)[4]["rewards/accuracies"] == 0.0, strategy
        # Exact resume from each of its 6 checkpoints, under this strategy too.
        argv = dummy_run_args(*overrides, recipe=RECIPE, dummy_samples=ROWS)
        assert_exact_from_every_checkpoint(strategy, two, argv, steps=6, mixed_precision="no")
    # Ulysses: each process trains half of every side's tokens; the group's per-segment sums are added by a
    # differentiable all-reduce. One replica of 2 processes: the same batches as the single process.
    ulysses = tmp_path / "sp2"
    proc = train_forked("zero3_sp2", 2, ulysses, recipe=RECIPE, dummy_samples=ROWS)
    assert "sequence parallelism: Ulysses over 2 processes per row" in proc.stderr
    assert_same_training(ulysses, one, "zero3_sp2")

    argv = dummy_run_args(*EVERY, recipe=RECIPE, dummy_samples=ROWS)
    assert_exact_from_every_checkpoint("single", one, argv, steps=6, mixed_precision="no")
    for step in (4, 5):  # resumed inside the DPO stage: its reference read back, never scored with a later policy
        log = (tmp_path / f"one-from-{step}.log").read_text()
        assert "reference log-probs (the policy at step 3): read from" in log
        assert "rows/s" not in log.split("resumed (exact)")[1]
    assert_a_resume_takes_only_the_scores_its_checkpoint_recorded(one, tmp_path)

    # Stopped by SIGTERM after the reference pass's first block: the block kept, the relaunch goes on from it.
    stopped = tmp_path / "stopped"
    proc = train_forked("single", 1, stopped, *EVERY, recipe=RECIPE, dummy_samples=ROWS, check=False,
                        env={STOP_FAULT_ENV: "16:train reference log-probs"})  # blocks of 16 sides, stopped after one
    assert proc.returncode == PREEMPTED_EXIT_CODE and "during the scoring pass" in proc.stderr, proc.stderr[-3000:]
    (partial,) = [a for a in references(stopped).values() if not a["done"].all()]  # the train pass, cut
    assert partial["done"].sum() == 16
    again = train_forked("single", 1, stopped, *EVERY, recipe=RECIPE, dummy_samples=ROWS)
    assert "resumed (exact)" in again.stderr
    assert_same_training(stopped, one, "stopped in the pass")

    # reference: base after a LoRA SFT stage: the adapter switched off is the base model, not the policy.
    base = tmp_path / "base"
    train_forked("single", 1, base, "stages.1.preference={reference: base}", recipe=RECIPE, dummy_samples=ROWS)
    assert abs(by_step(base)[4]["loss"] - LN2) > 1e-3


def assert_a_resume_takes_only_the_scores_its_checkpoint_recorded(one: Path, tmp_path: Path) -> None:
    """Issue 48: a checkpoint inside the DPO stage records the digests of the reference log-probs it trained with;
    resumed from it (into a new output_dir, so the kept scores are read from the checkpoint's run folder) with those
    files gone, edited (a DPO step's loss came out 1.61 where the uninterrupted run had 0.68) or cut short, the
    launch is refused in one line and never scores them again with the later policy."""
    ckpt = "checkpoints/step-00000005"
    recorded = json.loads((one / ckpt / "meta.json").read_text())["scores"]
    kept = {path.stem.removeprefix("scores-") for path in (one / "scores").glob("scores-*.npz")}
    assert kept and set(recorded) == kept  # the stage's reference log-probs, taken at its entry (step 3)
    said = {"gone": "is missing or incomplete, and this launch resumes past the point those scores were taken",
            "edited": "holds other scores than the checkpoint this launch resumes from was trained with",
            "cut": "cannot be read (BadZipFile"}
    for case, says in said.items():
        copy = tmp_path / f"one-scores-{case}"
        shutil.copytree(one, copy)
        for path in sorted((copy / "scores").glob("scores-*.npz")):
            if case == "gone":
                path.unlink()
            elif case == "edited":
                with np.load(path) as saved:
                    arrays = {k: saved[k] for k in saved.files}
                np.savez(path, **(arrays | {"loss": arrays["loss"] * 1.5}))
            else:
                path.write_bytes(path.read_bytes()[:100])
        out = tmp_path / f"one-scores-{case}-resumed"
        proc = train_forked("single", 1, out, *EVERY, f"checkpoint.resume={copy / ckpt}", recipe=RECIPE,
                            dummy_samples=ROWS, check=False)
        assert proc.returncode == 2, (case, proc.stderr[-3000:])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "reference log-probs (the policy at step 3)" in errors[0], (case, errors)
        assert says in errors[0], (case, errors[0])
        assert "rows/s" not in proc.stderr, case  # never scored again, with the policy of step 5
        assert not [r for r in read_metrics(out / "metrics.jsonl", "train") if r["step"] > 5] \
            if (out / "metrics.jsonl").is_file() else True


def header_launch_line(recipe: str) -> list[str]:
    """The `accelerate launch ...` line a recipe's header gives, as its words."""
    lines = [line.lstrip("#").strip() for line in (REPO / recipe).read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("accelerate launch"))
    words = []
    for line in lines[start:]:
        words += shlex.split(line.rstrip("\\"))
        if not line.endswith("\\"):
            return words
    raise AssertionError(f"{recipe}: the launch line does not end")


@pytest.mark.timeout(900)
def test_the_recipe_s_launch_line_trains_both_stages_and_so_does_multinode_zero3(tmp_path: Path) -> None:
    """recipes/sft_then_dpo.yaml's header line as written (only a free port added: tests run side by side), from a
    folder holding the repository's recipes, configs and entry, so its relative paths and output_dir resolve as
    a user's would; then multinode_zero3.yaml as its header says (2 machines on loopback, the file's bf16)."""
    words = header_launch_line(RECIPE)
    assert words[:2] == ["accelerate", "launch"] and "accelerate_configs/zero3.yaml" in words
    for name in ("recipes", "accelerate_configs", "ds_configs", "train_curriculum.py"):
        (tmp_path / name).symlink_to(REPO / name)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *words[2:]]
    proc = run_launch(cmd, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    steps = by_step(tmp_path / "outputs" / "sft_then_dpo")
    assert [steps[s]["stage"] for s in sorted(steps)] == ["sft"] * 3 + ["dpo"] * 3
    assert steps[4]["loss"] == pytest.approx(LN2, abs=1e-6)  # the recipe's fp32 (--mixed_precision no)

    out = tmp_path / "multinode"
    two_machines_on_loopback("multinode_zero3", out, mixed_precision=None, recipe=RECIPE,
                             overrides=("stages.0.max_steps=1", "stages.1.max_steps=2"))
    steps = by_step(out)
    assert [steps[s]["stage"] for s in sorted(steps)] == ["sft", "dpo", "dpo"]
    assert json.loads((out / "run.json").read_text())["mixed_precision"] == "bf16"
    assert steps[2]["loss"] == pytest.approx(LN2, abs=2e-2)  # bf16: the reference pass and the step round apart
    assert (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.timeout(600)
def test_the_run_page_reads_a_dpo_stage_right(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """report.html of recipes/sft_then_dpo.yaml in headless Chromium (as tests/e2e/test_steering.py): each objective's
    loss on its own axis (SFT's ~7 and DPO's ln 2 in two charts, each over its own stage's steps), TRL's rewards in one
    panel as `toolkit plot` draws them, the pair evals in a chart of their own with no `eval_pairs` count charted, the
    stage table naming each stage's objective with its beta and reference, no dashed planned outline over the next
    stage, the entry's reference pass timed apart from the first step (its own record), and no axis tick labelled
    with float noise (+-1e-20) instead of 0. The screenshot is kept in
    test-artifacts/report-dpo.png."""
    import shutil

    from playwright.sync_api import sync_playwright

    from tests.e2e.test_steering import ARTIFACTS
    from tests.helpers.inprocess import Call, invoke

    chromium = shutil.which("chromium")
    assert chromium is not None, "no chromium on PATH: apt-get install chromium"
    run = tmp_path / "run"
    train_forked("single", 1, run, recipe=RECIPE, dummy_samples=ROWS)
    page_file = tmp_path / "page.html"
    rc, stderr = invoke(Call(["report", str(run), "--out", str(page_file)], page_file, tool="toolkit"), tmp_path,
                        monkeypatch)
    assert rc == 0, stderr
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_file.as_uri())
            page.wait_for_selector("body[data-drawn=true]", timeout=30_000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=ARTIFACTS / "report-dpo.png", full_page=True)
            assert errors == []
            rows = page.locator("table.stages tbody tr").all_inner_texts()
            assert "\tsft\t" in rows[0]
            assert "dpo (sigmoid; beta 0.1; reference: the policy at the stage's entry) · entry scoring pass" in rows[1]
            (entry,) = [r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "stage_entry_pass"]
            assert entry["step"] == 3 and entry["stage"] == "dpo" and entry["seconds"] > 0
            for panel, steps in (("loss", 3), ("loss-dpo", 3)):  # each objective's train loss over its own steps
                d = page.locator(f"[data-panel={panel}] path[data-series='train loss']").get_attribute("d")
                assert d is not None and d.count("L") == steps - 1, (panel, d)
            sft_ticks = page.eval_on_selector_all("[data-panel=loss] text.tick", "ts => ts.map(t => t.textContent)")
            assert sft_ticks and not any(t.startswith("0.69") for t in sft_ticks)  # ln 2 is not on SFT's axis
            rewards = page.locator("[data-panel=rewards] path.series")
            assert sorted(rewards.nth(i).get_attribute("data-series") for i in range(rewards.count())) == [
                "rewards/chosen", "rewards/margins", "rewards/rejected"]
            pair_evals = page.locator("[data-panel=pair-evals] path.series, [data-panel=pair-evals] circle")
            assert pair_evals.count() >= 1
            assert page.locator("[data-series*='eval_pairs']").count() == 0
            assert page.locator("[data-panel=scores]").count() == 0  # no generation evals in this run
            ticks = page.eval_on_selector_all("svg.chart text.tick", "ts => ts.map(t => t.textContent)")
            assert not [t for t in ticks if "e-1" in t or "e-2" in t], ticks  # float noise is labelled 0
            assert page.locator("svg.timeline rect[stroke-dasharray]").count() == 0  # both stages ran their plan
        finally:
            browser.close()


@pytest.mark.timeout(900)
def test_a_dpo_stage_ordered_by_margin_scores_once_and_resumes_exactly(tmp_path: Path) -> None:
    """Issue 51: the DPO stage ordered by the entry policy's margins and the 8 smallest (hardest) dropped, single
    process. The reference pass reads the difficulty's scores (one pass, one file), and a resume from a
    checkpoint inside the stage (into a new output_dir: the scores are the checkpoint run's) trains exactly as the
    uninterrupted run."""
    ordered = ("stages.1.order=easy_to_hard", "stages.1.difficulty={by: margin, model: current}",
               "stages.1.drop={easiest: 0, hardest: 0.25}")
    one = tmp_path / "one"
    proc = train_forked("single", 1, one, *EVERY, *ordered, recipe=RECIPE, dummy_samples=ROWS)
    assert "ordered easy_to_hard by margin of the current model" in proc.stderr, proc.stderr[-3000:]
    assert "dropped the 0 easiest and the 8 hardest of its 32 rows by margin" in proc.stderr
    assert "drop by margin of the current model: 0 easiest and 8 hardest of 32 pairs once scored, 24 kept" \
        in proc.stderr  # the stage's data line, at launch
    assert "reference log-probs (the policy at step 3): read from" in proc.stderr  # no second pass
    assert len(references(one)) == 1  # one scores file: difficulty, reference and eval reference (the same pairs)
    assert by_step(one)[4]["loss"] == pytest.approx(LN2, abs=1e-6)
    resumed = tmp_path / "resumed"
    ckpt = one / "checkpoints/step-00000005"
    again = train_forked("single", 1, resumed, *EVERY, *ordered, f"checkpoint.resume={ckpt}", recipe=RECIPE,
                         dummy_samples=ROWS)
    assert "resumed (exact)" in again.stderr and "rows/s" not in again.stderr  # read back, never scored again
    assert by_step(resumed)[6]["loss"] == pytest.approx(by_step(one)[6]["loss"], rel=1e-5, abs=1e-7)
    a, b = final_adapter(resumed), final_adapter(one)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def vision_pairs(folder: Path) -> list[Path]:
    """The wild vision pairs (TRL's rows, LLaMA-Factory's RLHF-V row by its registry entry) and 5 more pairs in
    TRL's vision shape, each with a small PNG of its own colour: 8 pairs, the data files a vision stage reads."""
    from tests.data.test_pair_data import vision_folder

    wild = vision_folder(folder)
    colours = {"red": (200, 30, 30), "green": (30, 160, 60), "yellow": (220, 200, 40), "purple": (120, 40, 160),
               "orange": (200, 100, 0)}
    rows = []
    for i, (name, rgb) in enumerate(colours.items()):
        Image.new("RGB", (84, 56) if i % 2 else (56, 84), rgb).save(wild / "images" / f"{name}.png")
        rows.append({"images": [f"images/{name}.png"],
                     "prompt": [{"role": "user", "content": [{"type": "image"},
                                                             {"type": "text", "text": "What colour is the square?"}]}],
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": f"It is {name}."}]}],
                     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "It is grey."}]}]})
    (wild / "colours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [wild / "trl_vision_dpo.jsonl", wild / "colours.jsonl", wild]


@pytest.mark.timeout(600)
def test_vision_pairs_train_dpo_orpo_simpo_alike_on_one_and_two_processes(tmp_path: Path) -> None:
    """Issues 50 and 51: preference pairs whose prompt holds an image or a video (a clip, a frame list, an image
    beside a video: tests/data/test_pair_data.py `video_pair_folder`), on the built-in tiny Qwen2.5-VL, in a dpo
    (its reference pass and eval included), an orpo and a simpo stage of one launch. The step passes each pair's
    image and video once (one tower run for both sides) and the reference pass scores each side alone with its
    media: the first dpo step is still ln 2 with rewards exactly 0. 2 processes under DDP (gloo) train as 1: the
    same reference log-probs, losses, TRL's metrics and final adapter (fp32). The stages read the recipe's files
    (no generated data)."""
    from tests.data.test_pair_data import VIDEO_DATA, video_pair_folder

    trl, colours, registry = vision_pairs(tmp_path)
    videos = video_pair_folder(tmp_path)
    data = [str(trl), str(colours), {"dataset": "rlhf_v", "dataset_dir": str(registry)}, str(videos / "trl.jsonl"),
            {"dataset": "video_pairs", "dataset_dir": str(videos)}]
    stage = {"data": data, "max_steps": 1, "lr": 1.0e-3}
    recipe = tmp_path / "vision_pairs.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"}, "lora": {"r": 8, "alpha": 16},
        "data": {"max_seq_len": 128, **VIDEO_DATA},
        "stages": [{"name": "dpo", "objective": "dpo", **stage, "max_steps": 3,  # 12 draws of its 11 pairs
                    "eval": [str(trl), str(videos / "trl.jsonl")]},
                   {"name": "orpo", "objective": "orpo", **stage}, {"name": "simpo", "objective": "simpo", **stage}],
        "schedule": {"warmup_ratio": 0.0}, "train": {"micro_batch_size": 2, "grad_accum": 2, "seed": 7},
        "eval": {"every_steps": 2}, "checkpoint": {"save_steps": 2}, "logging": {"progress_bar": False}}))
    one, two = tmp_path / "one", tmp_path / "two"
    said = train_on_files("single", 1, one, recipe)
    assert "stage 'dpo' data (dpo): 11 pairs, 11 kept" in said, said[-3000:]
    assert "stage 'dpo': entry-policy reference log-probs of 11 pairs and 4 eval pairs" in said, said[-3000:]
    steps = by_step(one)
    assert [steps[s]["stage"] for s in sorted(steps)] == ["dpo", "dpo", "dpo", "orpo", "simpo"]
    assert steps[1]["loss"] == pytest.approx(LN2, abs=1e-12)  # the shared-image step is its per-side reference
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert steps[1][key] == 0.0, key
    assert steps[2]["loss"] != pytest.approx(LN2, abs=1e-5)
    train_on_files("ddp", 2, two, recipe, "train.grad_accum=1")
    assert_same_training(two, one, "ddp x2, vision pairs")


def train_on_files(strategy: str, num_processes: int, out: Path, recipe: Path, *overrides: str) -> str:
    """`train_forked` on the recipe's own data files (no `--create_dummy_data`, which would put the generated text
    pairs in place of a preference stage's files); the run's whole output."""
    log = out.with_name(f"{out.name}.log")
    (code,) = relaunch(strategy, [(["--config", str(recipe), f"output_dir={out}", *overrides], log)],
                       mixed_precision="no", num_processes=num_processes)
    output = log.read_text()
    assert code == 0, f"{strategy} failed (rc={code}):\n{output[-6000:]}"
    return output


KTO_RECIPE = "recipes/sft_then_kto.yaml"
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins")


@pytest.mark.timeout(600)
def test_a_kto_stage_trains_alike_on_1_and_2_processes(tmp_path: Path) -> None:
    """Issue 51: recipes/sft_then_kto.yaml, SFT then KTO (on `dummy:kto`: TRL's unpaired rows, two desirable in
    three, standard and conversational; undesirable_weight 1.5). The KL baseline is the global batch's,
    all-reduced before the step's first forward: one process with 2 micro-batches per step and 2 processes under
    DDP with one each give the same reference, losses, KL, TRL's metrics and final adapter (without the all-reduce
    each rank would take its own micro-batch's baseline, and they differ). The stage's first step is the policy at
    its reference: every reward is 0, and the loss is the batch's mean weight over 2."""
    one, two = tmp_path / "one", tmp_path / "ddp"
    first = train_forked("single", 1, one, recipe=KTO_RECIPE, dummy_samples=16)
    assert "stage 'kto': entry-policy reference log-probs of 16 pairs" in first.stderr
    train_forked("ddp", 2, two, "train.grad_accum=1", recipe=KTO_RECIPE, dummy_samples=16)
    got, want = by_step(two), by_step(one)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4, 5, 6]
    entry = want[4]
    assert entry["rewards/chosen"] == entry["rewards/rejected"] == entry["kl"] == 0.0
    assert entry["loss"] in {w / 2 for w in (1.0, 1.125, 1.25, 1.375, 1.5)}  # 4 rows of weight 1 or 1.5, halved
    assert any(want[s]["kl"] > 0 for s in (5, 6))  # a baseline that is not clamped to 0 takes part
    for step, r in want.items():
        assert got[step]["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7), step
        for key in KTO_METRICS:
            if key in r:
                assert got[step][key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), (step, key)
    for name, arrays in references(one).items():
        for key, value in arrays.items():
            np.testing.assert_allclose(references(two)[name][key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    a, b = final_adapter(two), final_adapter(one)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)
    assert "| kto | kto (beta 0.1; desirable x1, undesirable x1.5; reference: the policy at the stage's entry) |" \
        in (one / "final" / "README.md").read_text()
