"""toolkit/checkpoint/resume.py `restore`, in one process: the bytes checked are the bytes loaded, and nothing in a
checkpoint is unpickled but weights-only, even a file swapped in after its check (issue 39)."""

from __future__ import annotations

import json
import os
import shlex
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import toolkit.checkpoint.resume as resume_mod
from toolkit.checkpoint.manager import META_FILE, CheckpointManager, write_state
from toolkit.checkpoint.resume import restore
from toolkit.errors import ToolkitError


class _Shell:
    """Unpickling this runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def _run(tmp_path: Path) -> tuple[Accelerator, torch.nn.Module, Any, Any, Path]:
    """A prepared model, optimizer and registered LR scheduler as a run has them, one step taken, and its committed
    checkpoint (written as a run writes it)."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    accelerator.register_for_checkpointing(scheduler)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    manager = CheckpointManager(tmp_path / "ck", keep_last=2, best_metric=None, best_mode="min", is_main=True,
                                barrier=lambda: None)
    ckpt = manager.save(1, partial(write_state, accelerator, model, optimizer, adam_steps=None),
                        {"step": 1, "world_size": 1, "strategy": "single"})
    return accelerator, model, optimizer, scheduler, ckpt


def _restore(run: tuple[Accelerator, torch.nn.Module, Any, Any, Path]) -> Any:
    accelerator, model, optimizer, scheduler, ckpt = run
    return restore(accelerator, model, optimizer, scheduler, ckpt, strategy="single", seed=0)


def test_a_committed_checkpoint_restores_exactly(tmp_path: Path) -> None:
    run = _run(tmp_path)
    scheduler = run[3]
    saved = scheduler.state_dict()
    scheduler.step()
    assert _restore(run).how == "exact"
    assert scheduler.state_dict() == saved


def _swap_after_check(monkeypatch: pytest.MonkeyPatch, path: Path, content: Any, *, every: bool = False) -> None:
    """What a second process that can write the checkpoint folder does: replace `path` right after the files'
    verification, or with `every` after the last check (the scheduler state read from bytes checked against its
    digest), so that only weights-only loading stands between the swapped pickle and its code (issue 48: swapped
    any earlier, the digest check refused it and the test passed with weights-only loading off)."""
    name = "_scheduler_state" if every else "verify_checkpoint_files"
    real = getattr(resume_mod, name)

    def check_then_swap(*args: Any) -> Any:
        result = real(*args)
        replacement = path.with_name(path.name + ".new")
        torch.save(content, replacement)
        os.replace(replacement, path)
        return result

    monkeypatch.setattr(resume_mod, name, check_then_swap)


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"])
def test_a_pickle_swapped_in_after_the_check_runs_no_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         name: str) -> None:
    """The hostile pass ran its code 3 times in 3 through accelerate's weights_only=False load of the custom
    state. Every file of the load is weights-only now: a file swapped after every check is refused in one line
    without torch's advice to load with weights_only=False (accelerate gives up on an unreadable RNG state by
    itself), and the scheduler's state comes from the bytes checked against its commit-time digest."""
    run = _run(tmp_path)
    pwned = tmp_path / "pwned"
    _swap_after_check(monkeypatch, run[4] / name, {"last_epoch": _Shell(f"touch {shlex.quote(str(pwned))}")},
                      every=True)
    if name == "random_states_0.pkl":
        _restore(run)
    else:
        with pytest.raises(ToolkitError, match=r"Refusing to load checkpoint") as err:
            _restore(run)
        said = str(err.value)
        assert "global posix.system is not allowed" in said
        assert "weights_only" not in said
        assert "\n" not in str(err.value)
    assert not pwned.exists()


def test_the_scheduler_state_loaded_is_the_one_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A harmless-looking state swapped in after the check (tensors and numbers only) is not loaded either: the
    scheduler's state is read once, its bytes checked against the commit-time digest and loaded from them."""
    run = _run(tmp_path)
    forged = {**run[3].state_dict(), "last_epoch": 1000}
    _swap_after_check(monkeypatch, run[4] / "custom_checkpoint_0.pkl", forged)
    with pytest.raises(ToolkitError, match=r"custom_checkpoint_0\.pkl is not the file committed with it"):
        _restore(run)
    assert run[3].last_epoch != 1000


@pytest.mark.parametrize("recorded", [True, False])
def test_a_fifo_in_a_checkpoint_is_refused_not_waited_on(tmp_path: Path, recorded: bool) -> None:
    """A FIFO where a state file belongs (meta.json with or without its `files`): one line, no hang."""
    run = _run(tmp_path)
    ckpt = run[4]
    if not recorded:  # a checkpoint of an earlier version: no digests to compare
        meta = json.loads((ckpt / META_FILE).read_text())
        del meta["files"]
        (ckpt / META_FILE).write_text(json.dumps(meta))
    (ckpt / "custom_checkpoint_0.pkl").unlink()
    os.mkfifo(ckpt / "custom_checkpoint_0.pkl")
    with pytest.raises(ToolkitError, match=r"custom_checkpoint_0\.pkl is not a regular file") as err:
        _restore(run)
    assert "\n" not in str(err.value)


def test_code_in_an_unrecorded_scheduler_state_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint of an earlier version (no digests): the scheduler's state is still loaded weights-only."""
    run = _run(tmp_path)
    ckpt = run[4]
    meta = json.loads((ckpt / META_FILE).read_text())
    del meta["files"]
    (ckpt / META_FILE).write_text(json.dumps(meta))
    pwned = tmp_path / "pwned"
    _swap_after_check(monkeypatch, ckpt / "custom_checkpoint_0.pkl",
                      {"last_epoch": _Shell(f"touch {shlex.quote(str(pwned))}")})
    with pytest.raises(ToolkitError, match=r"custom_checkpoint_0\.pkl contains pickled objects") as err:
        _restore(run)
    assert "global posix.system is not allowed" in str(err.value) and "weights_only" not in str(err.value)
    assert not pwned.exists()
