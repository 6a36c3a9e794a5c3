"""Nothing lost, nothing silently wrong: export that never deletes what it should not, signals to the launcher
alone, one writer per output dir, resume on changed inputs, runs that end in garbage, metrics that survive a
crash."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from tests.conftest import (
    CHAT,
    LAUNCH_TIMEOUT_S,
    REPO,
    as_in_a_terminal,
    base_recipe,
    free_port,
    rank_stderr,
    relaunch,
    run_env,
    run_launch,
    signal_tree,
    start_and_signal,
    toolkit_lines,
    train_cmd,
    wait_until,
    write_jsonl,
)
from tests.helpers.inprocess import Call, invoke, snapshot
from toolkit import atomic
from toolkit.builtin.models import TINY_MODEL, builtin_dir
from toolkit.checkpoint.final import _unsaveable, verify_final
from toolkit.checkpoint.manager import META_FILE, CheckpointManager, read_meta
from toolkit.checkpoint.model_card import MODEL_CARD
from toolkit.commands import export as export_module
from toolkit.commands.export import EXPORT_MARKER, export
from toolkit.errors import ToolkitError
from toolkit.metrics.log import MetricsLog, read_metrics, truncate_after
from toolkit.metrics.plot import plot_run
from toolkit.runtime.run_dir import COMMIT_MARKER, RunLayout, RunLock, committed_checkpoints


def copy_run(trained: Path, dest: Path) -> Path:
    shutil.copytree(trained, dest, dirs_exist_ok=True)
    return dest / "run"


# --- export ------------------------------------------------------------------------------------------------------

def test_export_replaces_only_its_own_earlier_export_and_leaves_nothing_behind(trained: Path, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    run = copy_run(trained, tmp_path)
    out = tmp_path / "exports" / "adapter"
    assert export(run, out) == out
    assert (out / EXPORT_MARKER).is_file() and (out / "adapter_model.safetensors").is_file()
    first = (out / "adapter_model.safetensors").read_bytes()

    # An earlier export is replaced (from another checkpoint: other weights), in one swap.
    export(run / "checkpoints" / "step-00000001", out)
    assert (out / "adapter_model.safetensors").read_bytes() != first
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]  # no .tmp / .old left beside it

    # A failure half-way leaves the earlier export as it was and no temporary folder.
    before = snapshot(out)

    def fail(path: Path) -> None:
        raise ToolkitError("simulated failure after the weights were written")

    monkeypatch.setattr("toolkit.commands.export._no_empty", fail)
    with pytest.raises(ToolkitError, match="simulated failure"):
        export(run, out)
    assert snapshot(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]


def test_export_overwrite_is_explicit_and_never_reaches_the_source(trained: Path, tmp_path: Path) -> None:
    run = copy_run(trained, tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ToolkitError, match="not an earlier export"):
        export(run, mine)
    assert (mine / "notes.txt").read_text() == "keep me"
    export(run, mine, overwrite=True)  # the user said so
    assert (mine / EXPORT_MARKER).is_file() and not (mine / "notes.txt").exists()
    before = snapshot(run)
    for target in (run, tmp_path, run / "final" / "inside"):
        with pytest.raises(ToolkitError, match="is being exported"):
            export(run, target, overwrite=True)
    assert snapshot(run) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    export(run, empty)  # an empty folder holds nothing to lose


def test_export_tells_folders_by_identity_not_spelling(trained: Path, tmp_path: Path) -> None:
    """Symlinks lead to the run: refused however --out is spelled, even with --overwrite. A symlinked --out that
    leads to an earlier export has that export replaced and stays a link (it used to be replaced by a folder); a
    symlink to a run's final/ exports that run (it used to be "neither a checkpoint nor a run")."""
    run = copy_run(trained, tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run").symlink_to(run)
    (tmp_path / "b" / "parent").symlink_to(run.parent)
    before = snapshot(run)
    for target in ("b/run", "b/parent", "b/run/final/inside", "b/parent/run/../run"):
        with pytest.raises(ToolkitError, match="is being exported"):
            export(run, tmp_path / target, overwrite=True)
    assert snapshot(run) == before

    exports = tmp_path / "exports"
    export(run, exports / "v1")
    (tmp_path / "latest").symlink_to(exports / "v1")
    (tmp_path / "final_link").symlink_to(run / "final")
    export(run / "checkpoints" / "step-00000001", tmp_path / "latest")
    assert (tmp_path / "latest").is_symlink() and sorted(p.name for p in exports.iterdir()) == ["v1"]
    assert json.loads((exports / "v1" / EXPORT_MARKER).read_text())["source"].endswith("step-00000001")
    export(tmp_path / "final_link", exports / "v2")
    assert json.loads((exports / "v2" / EXPORT_MARKER).read_text())["source"] == str((run / "final").resolve())


def _fail_call(real: Any, n: int) -> Any:
    """`real`, raising at its n-th call (a crash at that point)."""
    calls = [0]

    def wrapped(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise OSError(5, "simulated crash")
        return real(*args)

    return wrapped


def test_export_swap_interrupted_or_refused_keeps_the_earlier_export(trained: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = copy_run(trained, tmp_path)
    out = tmp_path / "exports" / "adapter"
    export(run / "final", out)  # a run's final/ is a source too
    assert json.loads((out / EXPORT_MARKER).read_text())["source"] == str((run / "final").resolve())
    before = snapshot(out)

    # The swap fails, in one step (RENAME_EXCHANGE) or in the fallback's second rename: the earlier export stays
    # at --out, whole, and nothing is left beside it.
    unsupported = (atomic, "exchange", lambda a, b: False)  # what a filesystem without RENAME_EXCHANGE gives
    for crash in ([(atomic, "exchange", _fail_call(atomic.exchange, 1))],
                  [unsupported, (os, "rename", _fail_call(os.rename, 2))]):
        with monkeypatch.context() as m:
            for owner, name, fake in crash:
                m.setattr(owner, name, fake)
            with pytest.raises(OSError, match="simulated crash"):
                export(run / "checkpoints" / "step-00000001", out)
        assert snapshot(out) == before
        assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]

    # --out became someone else's folder while the export ran: it is swapped back, never deleted.
    def user_takes_out(path: Path) -> None:
        shutil.rmtree(out)
        out.mkdir()
        (out / "notes.txt").write_text("keep me")

    monkeypatch.setattr("toolkit.commands.export._no_empty", user_takes_out)
    with pytest.raises(ToolkitError, match="not an earlier export"):
        export(run, out)
    assert (out / "notes.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]


# --- exporting a run that is still training ----------------------------------------------------------------------

def _rotate_like_a_live_run(run: Path, *, saves: tuple[int, ...] = (4, 5)) -> None:
    """What the training run does meanwhile: commit new checkpoints (copies of step 3's state under later steps)
    and rotate with keep_last 1, through its real CheckpointManager."""
    root, source = run / "checkpoints", run.parent / "state-of-step-3"
    if not source.is_dir():
        shutil.copytree(root / "step-00000003", source)
    mgr = CheckpointManager(root, keep_last=1, best_metric=None, best_mode="min", is_main=True,
                            barrier=lambda: None)
    for step in saves:
        def copy_state(tmp: Path) -> None:
            for f in source.iterdir():
                if f.name not in (META_FILE, COMMIT_MARKER):
                    (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        meta = {k: v for k, v in read_meta(source).items() if k != "files"} | {"step": step}
        mgr.save(step, copy_state, meta)


def _exported_adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter_model.safetensors")


def _portable_adapter(ckpt: Path) -> dict[str, torch.Tensor]:
    state = load_file(ckpt / "portable" / "lora_state.safetensors")
    return {k.removeprefix("param/").replace(".default", ""): v for k, v in state.items() if k.startswith("param/")}


def test_export_of_a_live_run_reads_the_checkpoint_it_chose_while_rotation_runs(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotation runs at the worst moment: after the export read the chosen checkpoint's meta.json, before its
    weights. The export holds a read lease, so rotation leaves that checkpoint for a later rotation."""
    run = copy_run(trained, tmp_path)
    shutil.rmtree(run / "final")  # still training: export takes the newest checkpoint, step 3
    expected = _portable_adapter(run / "checkpoints" / "step-00000003")
    real_verify = export_module.verify_checkpoint_files

    def verify_while_rotating(ckpt: Path) -> None:
        _rotate_like_a_live_run(run)
        real_verify(ckpt)

    monkeypatch.setattr(export_module, "verify_checkpoint_files", verify_while_rotating)
    out = export(run, tmp_path / "adapter")
    assert json.loads((out / EXPORT_MARKER).read_text())["source"] == str((run / "checkpoints" / "step-00000003"
                                                                          ).resolve())
    got = _exported_adapter(out)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    monkeypatch.undo()
    _rotate_like_a_live_run(run, saves=(6,))  # released: the next rotation deletes it
    assert [p.name for p in committed_checkpoints(run / "checkpoints")] == ["step-00000006"]


def test_export_of_a_live_run_whose_chosen_checkpoint_was_rotated_away_takes_the_newest(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotation deletes the checkpoint the export chose before the export could hold it: an export of the run
    folder takes the run's newest checkpoint; an export of that checkpoint by name says what happened."""
    run = copy_run(trained, tmp_path)
    shutil.rmtree(run / "final")
    real_list = export_module.committed_checkpoints
    calls = []

    def listed_then_rotated(root: Path) -> list[Path]:
        found = real_list(root)
        calls.append(1)
        if len(calls) == 1:
            _rotate_like_a_live_run(run)  # step 3, just listed, is deleted; step 5 is the newest
        return found

    monkeypatch.setattr(export_module, "committed_checkpoints", listed_then_rotated)
    out = export(run, tmp_path / "adapter")
    assert json.loads((out / EXPORT_MARKER).read_text())["source"] == str((run / "checkpoints" / "step-00000005"
                                                                          ).resolve())
    assert "Exported at step 5." in (out / "README.md").read_text()

    gone = run / "checkpoints" / "step-00000005"
    real_acquire = export_module.ReadLease.acquire

    def rotated_first(path: Path) -> Any:
        _rotate_like_a_live_run(run, saves=(6,))
        return real_acquire(path)

    monkeypatch.setattr(export_module.ReadLease, "acquire", rotated_first)
    with pytest.raises(ToolkitError, match="was deleted") as err:
        export(gone, tmp_path / "other")
    assert f"Export {run} for its newest checkpoint" in str(err.value)
    assert not (tmp_path / "other").exists()


def test_export_of_a_checkpoint_whose_files_changed_is_refused(trained: Path, tmp_path: Path) -> None:
    run = copy_run(trained, tmp_path)
    ckpt = run / "checkpoints" / "step-00000002"
    shutil.copy2(run / "checkpoints" / "step-00000003" / "portable" / "lora_state.safetensors",
                 ckpt / "portable" / "lora_state.safetensors")  # another step's state, same size
    with pytest.raises(ToolkitError, match=r"does not hold what was committed: portable/lora_state\.safetensors"):
        export(ckpt, tmp_path / "adapter")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupt_same_size(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-64:] = bytes(255 - b for b in raw[-64:])  # tensor bytes: the file still loads, with other weights
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [_truncate, _corrupt_same_size])
def test_export_of_a_damaged_final_is_refused_in_one_line(trained: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, damage: Any) -> None:
    """Issue 31: a truncated adapter in final/ gave `toolkit export` a 31-line traceback, and a same-size corruption
    was exported with exit 0. final/ records its files' sizes and sha256 (checksums.json), checked before loading:
    one line naming the file, nothing written."""
    run = copy_run(trained, tmp_path)
    assert "adapter_model.safetensors" in json.loads((run / "final" / "checksums.json").read_text())["files"]
    damage(run / "final" / "adapter_model.safetensors")
    for merge in ([], ["--merge"]):
        rc, stderr = invoke(Call(["export", str(run), "--out", str(tmp_path / "out"), *merge], tmp_path / "out",
                                 tool="toolkit"), tmp_path, monkeypatch)
        assert rc == 2 and stderr.count("\n") == 1, stderr[-3000:]
        assert stderr.startswith(f"error: {run / 'final'} does not hold what training saved: "
                                 "adapter_model.safetensors ")


def test_a_final_without_checksums_still_exports_unverified(trained: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A final/ written by an earlier version (no checksums.json) is exported as before, with a warning that it is
    unverified."""
    run = copy_run(trained, tmp_path)
    (run / "final" / "checksums.json").unlink()
    out = export(run, tmp_path / "adapter")
    assert (out / "adapter_model.safetensors").is_file()
    assert (f"{run / 'final'} has no checksums.json (written by an earlier version): loading it unverified"
            in caplog.text)


def test_final_holds_a_model_card_that_loads(trained: Path, tmp_path: Path) -> None:
    """Issue 32: final/README.md is the run's model card, loaded as the Hub loads one: its front matter (a LoRA
    adapter for text generation; the tiny base model is a local folder, no Hub id) and its body (the stage with its
    data, the chat template, the results). It is not in checksums.json: a user who edits it, even in a final/ of an
    earlier version that recorded PEFT's placeholder card, leaves final/ verified and exportable."""
    run = copy_run(trained, tmp_path)
    final = run / "final"
    card = ModelCard.load(final / MODEL_CARD)
    assert (card.data.base_model, card.data.library_name, card.data.pipeline_tag) == (None, "peft", "text-generation")
    assert card.data.tags == ["curriculum-toolkit", "curriculum-learning", "lora"]
    base = yaml.safe_load((trained / "recipe.yaml").read_text())["model"]["name_or_path"]  # an absolute path
    base = os.path.relpath(base, trained)  # the card's paths are relative to the recipe's folder (issue 39)
    assert str(trained) not in card.text and not base.startswith("/")
    assert f"A LoRA adapter (PEFT) for `{base}`" in card.text and "Trained with the recipe `recipe.yaml`." in card.text
    assert "| 1 | only | sft | `data.jsonl` | 16 | 3 | 12 |" in card.text and "| `lora` (" in card.text
    assert "## Chat template\n\nqwen3 (the base model's own)." in card.text
    losses = read_metrics(run / "metrics.jsonl", "train")
    assert (f"- Steps: 3 (0 skipped)\n- Tokens trained: {losses[-1]['tokens']:,}\n- Final training loss: "
            f"{losses[-1]['loss']:.4g}") in card.text
    assert MODEL_CARD not in json.loads((final / "checksums.json").read_text())["files"]

    (final / MODEL_CARD).write_text(str(card) + "\nMy notes.\n")
    verify_final(final)
    checksums = json.loads((final / "checksums.json").read_text())
    checksums["files"][MODEL_CARD] = {"bytes": 1, "sha256": "0" * 64}  # as an earlier version recorded PEFT's card
    (final / "checksums.json").write_text(json.dumps(checksums))
    verify_final(final)
    assert (export(run, tmp_path / "adapter") / "adapter_model.safetensors").is_file()


def test_a_resumed_run_writes_the_same_model_card(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A run stopped after its step-2 checkpoint and relaunched with the same command writes the card the
    uninterrupted run wrote (it holds no timestamps; its numbers come from metrics.jsonl, redone after the resume)."""
    run = copy_run(trained, tmp_path)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints" / "step-00000003")
    rc, stderr = invoke(Call(["--config", "recipe.yaml"], run), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert "resumed (exact) from" in caplog.text and "step-00000002" in caplog.text
    card = (run / "final" / MODEL_CARD).read_text()
    assert "## Curriculum" in card and card == (trained / "run" / "final" / MODEL_CARD).read_text()


def test_export_of_a_builtin_model_run_from_another_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of `builtin:tiny-qwen3` launched from one folder (relative output_dir, as the README's recipes are),
    exported from another: the base model is the one training built in the run's cache, not a hub id."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    work.mkdir()
    write_jsonl(work / "data.jsonl", [CHAT] * 8)
    recipe = base_recipe("builtin:tiny-qwen3") | {"output_dir": "runs/tiny"}
    recipe["stages"][0]["max_steps"] = 2
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rc, stderr = invoke(Call(["--config", "recipe.yaml"], work / "runs"), work, monkeypatch)
    assert rc == 0, stderr[-3000:]
    run = work / "runs" / "tiny"
    monkeypatch.chdir(elsewhere)
    for source in (Path("../work/runs/tiny"), Path("../work/runs/tiny/checkpoints/step-00000002")):
        out = export(source, Path("adapter"), overwrite=True)
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
            builtin_dir(TINY_MODEL, work / "runs" / ".toolkit-cache").resolve())
    merged = export(Path("../work/runs/tiny"), Path("merged"), merge=True)
    assert (merged / "model.safetensors").is_file()
    assert run.is_dir()


# --- the token store ---------------------------------------------------------------------------------------------

def _reverse_first_rows_ids(root: Path) -> Path:
    """The one token store under `root`'s cache, its first row's token ids reversed in place (the file keeps its
    size, so only a checksum can tell); returns the store's folder."""
    import pyarrow as pa

    (store,) = [p for p in (root / ".toolkit-cache" / "tokenized" / "stores").iterdir()
                if p.is_dir() and not p.name.startswith(".")]
    data = store / "data.arrow"
    ids = pa.ipc.open_stream(data.read_bytes()).read_all().column("input_ids")[0].values.to_numpy()
    raw = data.read_bytes()
    at = raw.find(ids.tobytes())
    data.write_bytes(raw[:at] + (ids[::-1].copy()).tobytes() + raw[at + ids.nbytes:])  # same size, other ids
    return store


def test_a_damaged_token_store_is_prepared_again_and_trains_as_undamaged(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 31: token ids overwritten in place in the store (same size) changed the step-3 loss, exit 0, and a
    resume would have said "resumed (exact)". The next launch finds the damage, prepares the store again (a warning
    says so) and trains the undamaged losses; its checkpoints record the store's checksum for resumes to compare."""
    run = copy_run(trained, tmp_path)
    store = _reverse_first_rows_ids(tmp_path)
    rc, stderr = invoke(Call(["--config", "recipe.yaml", "output_dir=run2"], tmp_path / "run2"), tmp_path,
                        monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert f"stores/{store.name} is damaged (data.arrow's sha256 is" in caplog.text
    losses = [[r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")] for out in (run, tmp_path / "run2")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    checksum = json.loads((store / "meta.json").read_text())["sha256"]
    assert read_meta(tmp_path / "run2" / "checkpoints" / "step-00000003")["data_stores"] == {"data.jsonl": checksum}


# --- every rank ends with one line ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_failure_on_one_rank_ends_every_rank_with_one_line(tmp_path: Path) -> None:
    """A bug that strikes rank 1 alone, at step 3 of a DDP x 2 run (tests/helpers/crash_rank.py): rank 1 says what
    failed,
    rank 0 names rank 1 and where its traceback is; each rank's traceback is in its own log file, not on stderr.
    (A rank killed outright: tests/e2e/test_resume.py::test_sigkill_and_resume_is_exact.)"""
    out, rank_logs = tmp_path / "run", tmp_path / "rank-logs"
    cmd = train_cmd("ddp", 2, out, "stages.0.max_steps=4", "stages.1.max_steps=1", "checkpoint.save_steps=2",
                    rank_logs=rank_logs, script=REPO / "tests" / "helpers" / "crash_rank.py")
    proc = run_launch(cmd, env=run_env() | {"TOOLKIT_TEST_CRASH": "1:3"})
    assert proc.returncode != 0
    ckpt, logs = out / "checkpoints" / "step-00000002", {r: out / "logs" / f"rank-{r}.log" for r in (0, 1)}
    last_words = {}
    for rank in (0, 1):
        stderr = rank_stderr(rank_logs, rank)
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert "Traceback" not in stderr and len(errors) == 1, stderr[-4000:]
        assert toolkit_lines(stderr)[-1] == errors[0]
        last_words[rank] = errors[0]
    assert last_words[1] == (f"error: rank 1 failed: RuntimeError: injected failure on rank 1 at step 3 (its "
                             f"traceback is in {logs[1]}). Relaunch the same command to resume from {ckpt}. If it "
                             "fails the same way, report it with that traceback.")
    assert last_words[0].startswith("error: rank 0 stopped: rank 1 (pid ")
    assert last_words[0].endswith(f"failed (RuntimeError: injected failure on rank 1 at step 3; its traceback is in "
                                  f"{logs[1]}), and this rank stopped with it. Relaunch the same command to resume "
                                  f"from {ckpt}. The traceback of rank 0 is in {logs[0]}.")
    assert "in run_step" in logs[1].read_text() and "injected failure" in logs[1].read_text()
    assert "gloo" in logs[0].read_text()
    assert last_words[1] in proc.stderr  # the launcher's failure summary ends with the ranks' own lines


# --- signals and the run lock ------------------------------------------------------------------------------------

def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        records = read_metrics(out / "metrics.jsonl", "train") if (out / "metrics.jsonl").is_file() else []
        if records and records[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended (rc={proc.returncode}) before step {step}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no step {step} after {timeout} s")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize(("config", "processes", "sig"), [("ddp", 2, signal.SIGUSR1), ("single", 1, signal.SIGTERM)])
def test_signal_to_the_launcher_alone_stops_every_trainer_with_a_checkpoint(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str, processes: int,
        sig: signal.Signals) -> None:
    """The README's launch line, the signal sent to the `accelerate launch` process only (as `kill PID` of the
    launcher does): no trainer may keep running, and a second run on the same output dir meanwhile is refused."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "run")
    recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    recipe["stages"][0]["max_steps"] = 10_000  # long enough to be interrupted
    recipe["checkpoint"] = {"save_steps": 10_000}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / f"{config}.yaml"), "--num_processes", str(processes),
           "--mixed_precision", "no", "--main_process_port", str(free_port()),
           str(REPO / "train_curriculum.py"), "--config", "recipe.yaml"]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_step(tmp_path / "run", 3, launcher)
        # The trainers, not their DataLoader workers (forked from a trainer: the same command line).
        runs = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                if "train_curriculum.py" in " ".join(p.cmdline())]
        trainers = [p for p in runs if p.ppid() not in {q.pid for q in runs}]
        assert len(trainers) == processes

        second = invoke(Call(["--config", "recipe.yaml"], tmp_path / "run"), tmp_path, monkeypatch)
        assert second[0] == 2 and "a live run is writing it" in second[1], second[1]

        launcher.send_signal(sig)  # the launcher alone
        _, alive = psutil.wait_procs(trainers, timeout=120)
        assert not alive, f"trainers still running after the launcher got {sig.name}: {alive}"
    finally:
        for p in [*psutil.Process(launcher.pid).children(recursive=True), psutil.Process(launcher.pid)] \
                if psutil.pid_exists(launcher.pid) else []:
            p.kill()
        output = launcher.communicate(timeout=60)[0]
    # The trainers' own log (they are not this test's children, so their exit codes cannot be read here).
    assert "checkpoint saved; resume with the same command" in output, output[-3000:]
    saved = committed_checkpoints(tmp_path / "run" / "checkpoints")
    assert saved and int(saved[-1].name.removeprefix("step-")) >= 3
    assert read_metrics(tmp_path / "run" / "metrics.jsonl", "train")[-1]["step"] == int(
        saved[-1].name.removeprefix("step-"))  # nothing trained after the save

    # The lock went with the run: the next launch on this output dir may start.
    assert RunLock(RunLayout(tmp_path / "run")).acquire() is None


def test_ctrl_c_stops_with_one_line(trained: Path, tmp_path: Path) -> None:
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "run")
    recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text()) | {"checkpoint": {"save_steps": 2}}
    recipe["stages"][0]["max_steps"] = 10_000
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = subprocess.Popen([sys.executable, str(REPO / "train_curriculum.py"), "--config", "recipe.yaml"],
                            cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_in_a_terminal)
    try:
        _wait_for_step(tmp_path / "run", 3, proc)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("interrupted (Ctrl-C)")
    assert committed_checkpoints(tmp_path / "run" / "checkpoints")  # still there to resume from


def test_requeue_after_a_kill_before_the_first_checkpoint_starts_afresh(trained: Path, tmp_path: Path) -> None:
    """A run SIGKILLed before its first checkpoint, then the same command again (a scheduler's requeue): it used
    to be refused as "an earlier run". It trains to the end from step 1; the killed attempt's records are set
    aside, not deleted, and one warning line says where. On dummy data: the recipe the attempt saved names the
    generated files, and the relaunch must still be told the same recipe."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "run")
    run = tmp_path / "run"
    recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    recipe |= {"output_dir": str(run), "checkpoint": {"save_steps": 1000}}  # the end of the stage is the first
    recipe["stages"][0]["max_steps"] = 40
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, str(REPO / "train_curriculum.py"), "--config", str(tmp_path / "recipe.yaml"),
           "--create_dummy_data", "--num_dummy_samples", "16"]
    proc = start_and_signal(cmd, run, at_step=2, sig=signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not committed_checkpoints(run / "checkpoints") and not (run / "final").exists()
    killed = {name: (run / name).read_text() for name in ("metrics.jsonl", "run.json", "recipe.yaml")}
    assert 2 <= len(read_metrics(run / "metrics.jsonl", "train")) < 40

    again = run_launch(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    (aside,) = (run / "earlier-attempts").iterdir()
    assert {p.name: p.read_text() for p in aside.iterdir()} == killed
    said = [line for line in again.stderr.splitlines() if "earlier attempt" in line]
    assert len(said) == 1 and str(aside) in said[0] and "WARNING" in said[0], said
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl", "train")] == list(range(1, 41))
    assert (run / "final").is_dir() and committed_checkpoints(run / "checkpoints")


# --- stop signals before the first step ----------------------------------------------------------------------------

_HELD_IN_NATIVE_CODE = """
import sys
from datetime import timedelta
import torch.distributed as dist
from toolkit.runtime.signals import PreemptionFlag
from pathlib import Path
from toolkit.atomic import build_dir
flag = PreemptionFlag()
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=120))

def build(folder):
    (folder / "half.arrow").write_bytes(b"half")
    print("blocked", flush=True)
    store.get("a key nobody sets")  # held in C++ (as in a collective whose peer is gone): no Python handler runs

build_dir(Path(sys.argv[1]) / "store", build)  # a token store being built when the signal comes
"""


def test_a_stop_before_the_first_step_ends_in_one_line_and_writes_no_run(tmp_path: Path, models: dict[str, str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop-before-first-step path in this process (the launches below send real signals to real launches, in
    minutes): a SIGTERM that arrives while the model is built stops the run at once (`Stopped`), with its one line
    and exit 75, and no run outputs written (recipe.yaml, run.json, metrics.jsonl come only after the model)."""
    import train_curriculum

    write_jsonl(tmp_path / "data.jsonl", [CHAT] * 8)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(base_recipe(models["text"])))
    build_model = train_curriculum.build_model

    def signalled_while_building(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs in this (the main) thread before the next bytecode
        return build_model(*args, **kwargs)

    monkeypatch.setattr(train_curriculum, "build_model", signalled_while_building)
    rc, stderr = invoke(Call(["--config", "recipe.yaml"], tmp_path / "run"), tmp_path, monkeypatch)
    assert rc == 75, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ("stopped by SIGTERM before training began: nothing to save. No "
                                               "checkpoint was committed yet: relaunch the same command to start "
                                               "again."), stderr[-3000:]
    assert "Traceback" not in stderr
    written = [name for name in ("recipe.yaml", "run.json", "metrics.jsonl", "checkpoints")
               if (tmp_path / "run" / name).exists()]
    assert not written, written


@pytest.mark.parametrize(("sig", "code", "line"), [
    (signal.SIGTERM, 75, "stopped by SIGTERM before training began: nothing to save. Relaunch the same command."),
    (signal.SIGINT, 130, "interrupted (Ctrl-C): stopped without saving")])
def test_a_stop_signal_ends_a_process_held_in_native_code(sig: signal.Signals, code: int, line: str,
                                                          tmp_path: Path) -> None:
    """The hostile pass saw a run hung before its first step outlive SIGTERM by 10 minutes, until SIGKILL: the
    handler only set a flag that the loop reads. A main thread held in native code runs no Python handler at all;
    the watcher thread ends the process within STOP_GRACE_S, with one line and the signal's exit code, and deletes
    the folder the main thread was building (its `finally` never runs: CI once found a half-built token store
    left behind by a rank that unwound too slowly)."""
    from toolkit.runtime.signals import STOP_GRACE_S

    proc = subprocess.Popen([sys.executable, "-c", _HELD_IN_NATIVE_CODE, str(tmp_path)], cwd=REPO, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_in_a_terminal)
    try:
        assert proc.stdout.readline() == "blocked\n"
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=STOP_GRACE_S + 20)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == code, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), stderr[-3000:]
    assert took < STOP_GRACE_S + 10
    assert list(tmp_path.iterdir()) == []  # neither the store nor its half-built temporary folder


def _rank_stderrs(rank_logs: Path) -> list[str]:
    return [path.read_text() for path in sorted(rank_logs.glob("*/attempt_*/*/stderr.log"))]


def _stop_after(proc: subprocess.Popen, sig: signal.Signals, timeout: float = 30) -> float:
    """Send `sig` to `proc` and return how long it took to end (failing the test past `timeout`)."""
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_tree(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running {timeout} s after {sig.name}")
    return time.monotonic() - sent


@pytest.mark.slow
def test_stop_signals_before_the_first_step_end_every_rank_at_once(tmp_path: Path) -> None:
    """SIGTERM to the launcher of a DDP x 2 run while one rank tokenises a large file on a process pool and the
    other polls for that token store: each rank ends within seconds with one line (preemption exit code), nothing
    of the store is kept (no half-written store, no pool worker left). Then SIGINT to a run waiting for a store
    whose lock another process holds (a rank of another launch preparing it): one line, 130, within seconds. The
    same command relaunched trains to the end, with the losses of an uninterrupted run."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i % 97}? Say it in full, step by step."},
                          {"role": "assistant", "content": f"{i} + {i % 97} = {i + i % 97}. " * 3}]}
            for i in range(40_000)]
    write_jsonl(tmp_path / "big.jsonl", rows)
    overrides = (f"stages=[{{name: only, data: [{tmp_path / 'big.jsonl'}], max_steps: 3}}]", "data.num_proc=2",
                 f"data.cache_dir={tmp_path / 'cache'}", "checkpoint.save_steps=10")
    rank_logs, out = tmp_path / "rank-logs", tmp_path / "run"
    cmd = [a for a in train_cmd("ddp", 2, out, *overrides, rank_logs=rank_logs)
           if a not in ("--create_dummy_data", "--num_dummy_samples", "64")]
    stores = tmp_path / "cache" / "stores"

    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_until("store preparation with a rank waiting for it", lambda: list(stores.glob(".*.tmp")) and any(
            "data: waiting for" in text for text in _rank_stderrs(rank_logs)), proc)
        time.sleep(0.3)  # into the preparation (40k rows: tens of seconds here, a few on a fast machine)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        took = _stop_after(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)
    assert took < 20, took
    _, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, f"left running: {alive}"  # ranks and their tokenising workers
    for stderr in _rank_stderrs(rank_logs):
        ending = [line for line in stderr.splitlines() if "before training began" in line or "error" in line]
        assert ending == ["stopped by SIGTERM before training began: nothing to save. No checkpoint was committed "
                          "yet: relaunch the same command to start again."], stderr[-3000:]
        assert "Traceback" not in stderr
    assert not [p for p in stores.iterdir() if not p.name.endswith(".lock")]  # no store, no temporary folder
    assert not out.exists() or not any(p.name in ("metrics.jsonl", "checkpoints") for p in out.iterdir())

    # A run waiting for a store whose lock another process holds, then Ctrl-C.
    import fcntl

    (lock,) = stores.glob("*.lock")
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        single = subprocess.Popen([sys.executable, *cmd[cmd.index(str(REPO / "train_curriculum.py")):]],
                                  cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, preexec_fn=as_in_a_terminal)
        said: list[str] = []

        def waiting() -> bool:
            said.append(single.stdout.readline())
            return "data: waiting for" in said[-1]

        wait_until("a wait for the held store", waiting, single)
        took = _stop_after(single, signal.SIGINT)
        said.extend(single.stdout.read().splitlines())
    assert single.returncode == 130 and took < 10, said[-20:]
    assert [line for line in said if line.strip()][-1].startswith("interrupted (Ctrl-C)"), said[-20:]

    # The same command again, and an uninterrupted run of it (its store is ready now; forked from the session's
    # relauncher, conftest.relaunch: the reference needs no launch of its own).
    again = run_launch(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    argv = cmd[cmd.index(str(REPO / "train_curriculum.py")) + 1:]
    (code,) = relaunch("ddp", [([*argv, f"output_dir={tmp_path / 'fresh'}"], tmp_path / "fresh.log")])
    assert code == 0, (tmp_path / "fresh.log").read_text()[-3000:]
    losses = [[(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl", "train")]
              for run in (out, tmp_path / "fresh")]
    assert losses[0] == losses[1] and [s for s, _ in losses[0]] == [1, 2, 3]


# --- resume on changed inputs ------------------------------------------------------------------------------------

def test_a_resume_over_other_tokens_of_the_same_data_is_refused(trained: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A resume compares the token stores' checksums (docs/reliability.md): the finished run's store made to hold
    other tokens of the same data file, consistently (its meta.json's sha256 is the new file's, as a store prepared
    by another library version is), so the store is used as it is. Relaunching the same command is refused, naming
    the store's entry; forced, it resumes and says so."""
    import hashlib

    copy_run(trained, tmp_path)
    store = _reverse_first_rows_ids(tmp_path)
    data = store / "data.arrow"
    meta = json.loads((store / "meta.json").read_text())
    (store / "meta.json").write_text(json.dumps(meta | {"sha256": hashlib.sha256(data.read_bytes()).hexdigest()}))
    rc, stderr = invoke(Call(["--config", "recipe.yaml"], tmp_path / "run"), tmp_path, monkeypatch)
    assert rc == 2, stderr[-3000:]
    assert "token stores whose tokens differ from the checkpoint's (same data files, other tokens: prepared by " \
           "other library versions, or edited): data.jsonl" in stderr, stderr[-3000:]
    rc, stderr = invoke(Call(["--config", "recipe.yaml", "checkpoint.resume_force=true"], tmp_path / "run"),
                        tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert "resumed despite token stores whose tokens differ" in caplog.text


def test_resume_force_says_what_differs(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    copy_run(trained, tmp_path)
    with (tmp_path / "data.jsonl").open("a") as f:
        f.write(json.dumps(CHAT) + "\n")
    rc, stderr = invoke(Call(["--config", "recipe.yaml", "checkpoint.resume_force=true", "optimizer.lr=1e-3",
                              "optimizer.weight_decay=0.1"], tmp_path / "run"), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert "resumed (exact, forced past differences)" in caplog.text
    assert "resumed (exact) from" not in caplog.text
    assert "resumed despite changed settings: optimizer.lr, optimizer.weight_decay" in caplog.text
    assert "resumed despite data files whose content changed since the checkpoint: data.jsonl" in caplog.text


def test_a_begun_stage_cannot_be_forced_to_another_length(trained: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The hostile pass lengthened the finished run's only stage (stages.0.max_steps 3 -> 4) with resume_force: it
    said the change was accepted, trained no step and ended 'done' (the checkpoint's stage lengths won). A stage the
    checkpoint has begun keeps its length: refused before training, naming the stage and both lengths; the run's
    folder stays as it was (`Call.watch`)."""
    run = copy_run(trained, tmp_path)
    for ckpt in ("", "checkpoint.resume=run/checkpoints/step-00000001"):  # the finished stage, and mid-stage
        rc, stderr = invoke(Call(["--config", "recipe.yaml", "checkpoint.resume_force=true", "stages.0.max_steps=4",
                                  *([ckpt] if ckpt else [])], run), tmp_path, monkeypatch)
        assert rc == 2, stderr[-3000:]
        (line,) = [x for x in stderr.splitlines() if x.startswith("error: ")]
        assert "stage 0 was planned for 3 steps and this run plans 4 steps" in line, line
        assert "even with checkpoint.resume_force" in line


def test_a_forced_resume_into_another_model_or_trainable_set_is_refused_in_one_line(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hostile pass forced resumes past a changed model.name_or_path and train.trainable: a raw RuntimeError
    (`Error(s) in loading state_dict`) and "report it". Each is refused before the weights load, in one line naming
    the key and both values, and the run's folder stays as it was (`Call.watch`)."""
    run = copy_run(trained, tmp_path)
    recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    model = Path(recipe["model"]["name_or_path"])
    shutil.copytree(model, tmp_path / "other-model")  # the same architecture and shapes, another model
    for override, said in [
            (f"model.name_or_path={tmp_path / 'other-model'}",
             f'model.name_or_path ("{model}" -> "{tmp_path / "other-model"}") changed, and its state holds the '
             "weights of the model it trained"),
            ("train.trainable=[lora,model.norm]",
             'trainable (null -> ["lora", "model.norm"]) changed, and its weights and its Adam state do not fit'),
            ("lora.r=8", "lora.r (16 -> 8) changed, and its weights do not fit")]:
        rc, stderr = invoke(Call(["--config", "recipe.yaml", "checkpoint.resume_force=true", override], run),
                            tmp_path, monkeypatch)
        assert rc == 2, stderr[-3000:]
        (line,) = [x for x in stderr.splitlines() if x.startswith("error: ")]
        assert said in line and "even with checkpoint.resume_force" in line, line
        assert "report it" not in stderr and "Traceback" not in stderr

    # A checkpoint of an earlier version records no state signature: its load says what it is, in one line.
    meta = read_meta(run / "checkpoints" / "step-00000003")
    del meta["state"]
    (run / "checkpoints" / "step-00000003" / META_FILE).write_text(json.dumps(meta))
    rc, stderr = invoke(Call(["--config", "recipe.yaml", "checkpoint.resume_force=true", "lora.r=8"], run),
                        tmp_path, monkeypatch)
    (line,) = [x for x in stderr.splitlines() if x.startswith("error: ")]
    assert rc == 2 and "does not fit this run's model (Error(s) in loading state_dict" in line, stderr[-3000:]
    assert "report it" not in stderr and "Traceback" not in stderr


def test_a_forced_lr_applies_from_the_first_resumed_step(trained: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced past a changed lr mid-stage, step 3 trains at the new recipe's lr, as a fresh run of it does: the
    optimizer held the lr the checkpointed recipe had set for step 3, and the hostile pass saw that one used."""
    run = copy_run(trained, tmp_path)
    shutil.rmtree(run / "final")
    rc, stderr = invoke(Call(["--config", "recipe.yaml", "checkpoint.resume_force=true", "optimizer.lr=1e-3",
                              "checkpoint.resume=run/checkpoints/step-00000002", "output_dir=again"],
                             tmp_path / "again"), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    rc, stderr = invoke(Call(["--config", "recipe.yaml", "optimizer.lr=1e-3", "output_dir=fresh"],
                             tmp_path / "fresh"), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    forced, fresh = (read_metrics(tmp_path / name / "metrics.jsonl", "train") for name in ("again", "fresh"))
    assert [(r["step"], r["lr"]) for r in forced] == [(r["step"], r["lr"]) for r in fresh if r["step"] >= 3]


def test_forced_weight_decay_and_betas_apply_after_a_resume(trained: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer's state restores the checkpointed recipe's weight decay, betas and eps with its moments: a
    forced change of them was said to be accepted and silently ignored (the step trained as without it)."""
    run = copy_run(trained, tmp_path)
    adapters = {}
    for name, forced in (("as-saved", []), ("decayed", ["checkpoint.resume_force=true", "optimizer.weight_decay=0.5",
                                                         "optimizer.betas=[0.5,0.5]"])):
        rc, stderr = invoke(Call(["--config", "recipe.yaml", "checkpoint.resume=run/checkpoints/step-00000002",
                                  f"output_dir={name}", *forced], tmp_path / name), tmp_path, monkeypatch)
        assert rc == 0, stderr[-3000:]
        adapters[name] = load_file(tmp_path / name / "final" / "adapter_model.safetensors")
    assert run.is_dir() and adapters["as-saved"].keys() == adapters["decayed"].keys()
    assert any(not torch.equal(adapters["as-saved"][k], adapters["decayed"][k]) for k in adapters["as-saved"])


# --- runs that end in garbage do not succeed -------------------------------------------------------------------

def test_run_that_diverges_at_its_end_fails_and_writes_no_final(models: dict[str, str], tmp_path: Path) -> None:
    """lr=1e30: the first update blows the weights up, every later loss is non-finite and skipped; fewer than
    max_consecutive_skips remain, so only the end-of-run check can catch it (it used to exit 0 with the garbage
    in final/)."""
    write_jsonl(tmp_path / "data.jsonl", [CHAT] * 16)
    recipe = base_recipe(models["text"]) | {"optimizer": {"lr": 1e30}}
    recipe["stages"][0]["max_steps"] = 4
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, str(REPO / "train_curriculum.py"), "--config", "recipe.yaml"],
                          cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    skipped = [r["skipped"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")]
    trailing = len(skipped) - max(i + 1 for i, s in enumerate(skipped) if not s)
    assert skipped[0] == 0 and 1 <= trailing < 5, skipped  # fewer than max_consecutive_skips: no early stop
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"Training ended with its last {trailing} step(s) skipped (non-finite loss)" in errors[0]
    assert "final/ was not written" in errors[0] and "step-00000004" in errors[0]
    assert not (tmp_path / "run" / "final").exists()


def test_non_finite_or_empty_final_weights_are_refused() -> None:
    good = {"a": torch.ones(2), "step": 3}
    assert _unsaveable(good, Path("final")) is None
    assert "not finite" in _unsaveable({"a": torch.tensor([1.0, math.inf])}, Path("final"))
    assert "not finite" in _unsaveable({"a": torch.tensor([math.nan], dtype=torch.bfloat16)}, Path("final"))
    assert "empty" in _unsaveable({"a": torch.ones(0)}, Path("final"))
    assert _unsaveable({"ids": torch.tensor([1, 2])}, Path("final")) is None  # integer buffers are fine


# --- metrics.jsonl ---------------------------------------------------------------------------------------------

def test_metrics_are_standard_json_and_survive_a_cut_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, enabled=True)
    for step in (1, 2, 3):
        log.write({"step": step, "stage": "s", "stage_index": 0, "loss": math.nan if step == 2 else 1.0 / step,
                   "lr": 1e-3, "grad_norm": math.inf if step == 2 else 0.5, "tokens_per_sec": 10.0})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert [json.loads(line)["loss"] for line in text.splitlines()] == [1.0, None, 1 / 3]

    with path.open("a") as f:
        f.write('{"step": 4, "loss": 0.2')  # the process died mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert plot_run(tmp_path).is_file()
    truncate_after(path, 2)  # what a resume from step 2 does
    assert path.read_text().splitlines() == text.splitlines()[:2]

    path.write_text(text.replace('"step": 2', '"step": 2 oops', 1))  # damage in the middle is not a crash
    with pytest.raises(ToolkitError, match=r"metrics\.jsonl:2 is not a JSON record"):
        read_metrics(path)


# --- a full disk anywhere (issue 31) -------------------------------------------------------------------------------
# Each writer on a small tmpfs (tests/conftest.py mounted_tmpfs; skipped with the reason where mounting is not
# allowed): one OutOfSpace line naming what was being written, nothing half-written left, and the same call with
# space succeeds.

def _fill(disk: Path) -> None:
    """Fill a tmpfs up to its last byte."""
    with (disk / "filler").open("wb", buffering=0) as f, pytest.raises(OSError, match="No space left"):
        while True:
            f.write(b"\0" * 4096)


def _grow(disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)


def test_a_full_disk_while_the_builtin_model_is_written_is_one_line(tmp_path: Path) -> None:
    from tests.conftest import mounted_tmpfs
    from toolkit.builtin.models import materialize_builtin
    from toolkit.errors import OutOfSpace

    with mounted_tmpfs(tmp_path / "cache", "256k") as cache:
        with pytest.raises(OutOfSpace) as err:
            materialize_builtin(TINY_MODEL, cache)
        assert str(err.value).startswith(f"No space left on device writing {builtin_dir(TINY_MODEL, cache)}. Free "
                                         "space")
        assert "\n" not in str(err.value) and list(cache.iterdir()) == []  # no half-built model, no temporary
        _grow(cache)
        assert (Path(materialize_builtin(TINY_MODEL, cache)) / "config.json").is_file()


def test_a_full_disk_while_a_token_store_is_written_is_one_line(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import toolkit.data.store as store_module
    from tests.conftest import mounted_tmpfs
    from toolkit.builtin.text_model import build_tokenizer
    from toolkit.data.encoding import TextEncoder
    from toolkit.data.sources import Entry, resolve_source
    from toolkit.data.store import open_store
    from toolkit.errors import OutOfSpace

    data = write_jsonl(tmp_path / "a.jsonl", [{"text": f"row {i} " + "the quick brown fox " * 20} for i in range(400)])
    encoder, source = TextEncoder(build_tokenizer(), train_on="all"), resolve_source(Entry(str(data)), tmp_path)
    with mounted_tmpfs(tmp_path / "cache", "96k") as cache:
        with pytest.raises(OutOfSpace, match=rf"^No space left on device writing {cache}/stores/[0-9a-f]{{32}}\. "):
            open_store(source, encoder, cache, num_proc=1)
        assert [p.name for p in (cache / "stores").iterdir() if p.is_dir()] == []  # no store, no temporary
        failed = next((cache / "stores").glob("*.failed"), None)  # what ranks waiting on it read, if it fit
        assert failed is None or "No space left on device writing" in failed.read_text()
        _grow(cache)
        monkeypatch.setattr(store_module, "_process_start", time.time)  # a relaunch: the failure was before it
        assert len(open_store(source, encoder, cache, num_proc=1)) == 400


def test_a_full_disk_while_final_is_written_is_one_line(tmp_path: Path, models: dict[str, str]) -> None:
    from tests.conftest import mounted_tmpfs
    from toolkit.checkpoint.final import save_final
    from toolkit.errors import OutOfSpace
    from toolkit.model.load import load_model, load_processing, setup_lora
    from toolkit.runtime import process as distributed

    accelerator = distributed.build_accelerator(1, 10)
    model = setup_lora(load_model(models["text"], dtype=torch.float32, attn_implementation="sdpa",
                                  trust_remote_code=False, vision=False),
                       r=4, alpha=8, dropout=0.0, target_modules="all-linear", modules_to_save=[],
                       exclude_modules=None, stage_trainable=[None], trainable_keys=["lora"])
    tokenizer = load_processing(models["text"], vision=False, trust_remote_code=False, chat_template=None)[1]
    with mounted_tmpfs(tmp_path / "out", "64k") as out:
        with pytest.raises(OutOfSpace, match=rf"^No space left on device writing {out / 'final'}\. Free space"):
            save_final(accelerator, model, tokenizer, out / "final")
        assert list(out.iterdir()) == []  # no final/, no final.tmp
        _grow(out)
        save_final(accelerator, model, tokenizer, out / "final")
        assert (out / "final" / "checksums.json").is_file()


def test_a_full_disk_while_metrics_are_written_is_one_line(tmp_path: Path) -> None:
    from tests.conftest import mounted_tmpfs
    from toolkit.errors import OutOfSpace

    with mounted_tmpfs(tmp_path / "run", "64k") as run:
        log = MetricsLog(run / "metrics.jsonl", enabled=True)
        log.write({"step": 1, "loss": 2.0})
        _fill(run)
        with pytest.raises(OutOfSpace, match=rf"^No space left on device writing {run / 'metrics.jsonl'}\. "):
            log.write({"step": 2, "loss": 1.5, "note": "x" * 8192})
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]  # a cut last line is left out


def test_a_run_whose_disk_fills_at_final_ends_in_one_line_and_a_relaunch_finishes_it(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: the disk fills just before final/ is written (the hostile pass's case: a traceback and "report
    it"). One `error:` line naming final/, exit 2, no final/ nor its temporary; relaunched with space, the run
    resumes from its last checkpoint and writes the adapter an uninterrupted run writes."""
    import train_curriculum
    from tests.conftest import mounted_tmpfs

    shutil.copy2(trained / "recipe.yaml", tmp_path / "recipe.yaml")
    shutil.copy2(trained / "data.jsonl", tmp_path / "data.jsonl")
    real_save_final = train_curriculum.save_final

    def disk_fills_first(*args: Any, **kwargs: Any) -> Path:
        _fill(tmp_path / "run")
        return real_save_final(*args, **kwargs)

    with mounted_tmpfs(tmp_path / "run", "8m") as run:
        monkeypatch.setattr(train_curriculum, "save_final", disk_fills_first)  # as the run calls it
        rc, stderr = invoke(Call(["--config", "recipe.yaml"], run), tmp_path, monkeypatch)
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
        assert lines[0].startswith(f"error: No space left on device writing {Path('run') / 'final'}. Free space")
        assert not (run / "final").exists() and not (run / "final.tmp").exists()
        (run / "filler").unlink()
        monkeypatch.setattr(train_curriculum, "save_final", real_save_final)
        gc.collect()  # the first call's frames (its run lock among them) are in a reference cycle with its error
        rc, stderr = invoke(Call(["--config", "recipe.yaml"], run), tmp_path, monkeypatch)
        assert rc == 0, stderr[-3000:]
        got = load_file(run / "final" / "adapter_model.safetensors")
    rc, stderr = invoke(Call(["--config", "recipe.yaml", "output_dir=ref"], tmp_path / "ref"), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]  # the uninterrupted run, in this process as the others (threads, kernels)
    want = load_file(tmp_path / "ref" / "final" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
