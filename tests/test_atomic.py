"""toolkit/atomic.py: files and folders appear whole or not at all, and a folder swap interrupted at any point
leaves the old folder or the new one at the target, never neither and nothing half-written beside it."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from toolkit import atomic
from toolkit.runtime.run_dir import RunLayout


def folder(path: Path, label: str) -> Path:
    """A small complete folder whose every file names `label`."""
    (path / "sub").mkdir(parents=True)
    (path / "a.txt").write_text(f"{label} a")
    (path / "sub" / "b.txt").write_text(f"{label} b")
    return path


def contents(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


OLD = {"a.txt": "old a", "sub/b.txt": "old b"}
NEW = {"a.txt": "new a", "sub/b.txt": "new b"}


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "record.json"
    atomic.write_text_atomic(path, "first ü")
    assert path.read_text(encoding="utf-8") == "first ü"
    plain = tmp_path / "plain.txt"
    plain.write_text("")
    assert path.stat().st_mode == plain.stat().st_mode  # not mkstemp's private 0600

    def half_then_fail(f: Any) -> None:
        f.write(b"half of the sec")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic.write_atomic(path, half_then_fail)
    assert path.read_text(encoding="utf-8") == "first ü"
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]  # no temp file left


def test_exchange_swaps_in_one_step_and_reports_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = folder(tmp_path / "a", "old"), folder(tmp_path / "b", "new")
    if atomic._renameat2() is None:
        pytest.skip("renameat2 is Linux only")
    assert atomic.exchange(a, b) is True
    assert contents(a) == NEW and contents(b) == OLD
    with pytest.raises(FileNotFoundError):
        atomic.exchange(a, tmp_path / "missing")

    def unsupported(*args: Any) -> int:  # what a filesystem without RENAME_EXCHANGE answers
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(atomic, "_renameat2", lambda: unsupported)
    assert atomic.exchange(a, b) is False
    assert contents(a) == NEW and contents(b) == OLD  # nothing moved


def _fail_nth(real: Callable[..., Any], n: int) -> Callable[..., Any]:
    calls = {"n": 0}

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(errno.EIO, "simulated crash")
        return real(*args, **kwargs)

    return wrapped


# Each point of a swap where a crash can happen, with and without RENAME_EXCHANGE, and what `out` must hold.
CRASH_POINTS = {
    "exchange": ("exchange", OLD),            # the exchange itself fails
    "exchange-then-delete": ("exchange", NEW),  # swapped, deleting the old folder fails
    "aside": ("two renames", OLD),            # moving the old folder aside fails
    "rename-in": ("two renames", OLD),        # moved aside, renaming the new one in fails: the old one goes back
    "two-renames-then-delete": ("two renames", NEW),
}


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_build_dir_interrupted_at_each_point_leaves_old_or_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                point: str) -> None:
    mode, expected = CRASH_POINTS[point]
    out = folder(tmp_path / "parent" / "out", "old")
    if mode == "two renames":
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    elif atomic._renameat2() is None:
        pytest.skip("renameat2 is Linux only")
    if point == "exchange":
        monkeypatch.setattr(atomic, "exchange", _fail_nth(atomic.exchange, 1))
    elif point == "aside":
        monkeypatch.setattr(os, "rename", _fail_nth(os.rename, 1))
    elif point == "rename-in":
        monkeypatch.setattr(os, "rename", _fail_nth(os.rename, 2))
    else:
        monkeypatch.setattr(atomic, "remove_tree", _fail_nth(atomic.remove_tree, 1))

    with pytest.raises(OSError, match="simulated crash"):
        atomic.build_dir(out, lambda tmp: folder(tmp, "new"))
    assert contents(out) == expected
    beside = [p for p in out.parent.iterdir() if p != out]
    # Only a deletion cut short may leave something beside `out`, and then only the whole old folder.
    assert all(contents(p) == OLD for p in beside)
    assert len(beside) == (1 if point == "two-renames-then-delete" else 0)


@pytest.mark.parametrize("mode", ["exchange", "two renames"])
def test_replace_dir_and_refused_replacement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    if mode == "two renames":
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    elif atomic._renameat2() is None:
        pytest.skip("renameat2 is Linux only")
    out = tmp_path / "out"
    assert atomic.build_dir(out, lambda tmp: folder(tmp, "old")) is True  # no folder there yet
    assert contents(out) == OLD
    plain = tmp_path.parent / f"{tmp_path.name}-plain"
    plain.mkdir()
    assert out.stat().st_mode == plain.stat().st_mode  # not mkdtemp's private 0700
    atomic.build_dir(out, lambda tmp: folder(tmp, "new"))
    assert contents(out) == NEW and [p.name for p in tmp_path.iterdir()] == ["out"]

    # The folder swapped out is checked before it is deleted; refused, it goes back and the new one goes.
    def refuse(old: Path) -> None:
        assert contents(old) == NEW
        raise PermissionError("not ours")

    with pytest.raises(PermissionError, match="not ours"):
        atomic.build_dir(out, lambda tmp: folder(tmp, "newer"), check_replaced=refuse)
    assert contents(out) == NEW and [p.name for p in tmp_path.iterdir()] == ["out"]

    # First one wins: an existing folder is kept when replace is off (builders of the same content racing).
    assert atomic.build_dir(out, lambda tmp: folder(tmp, "other"), replace=False) is False
    assert contents(out) == NEW and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_build_dir_fixed_temp_name_clears_a_stale_one(tmp_path: Path) -> None:
    out, tmp = tmp_path / "final", tmp_path / "final.tmp"
    folder(tmp, "stale")
    atomic.build_dir(out, lambda t: (t / "x").write_text(str(sorted(p.name for p in t.iterdir()))), tmp=tmp)
    assert contents(out) == {"x": "[]"} and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_run_layout_names_every_path() -> None:
    run = RunLayout("runs/exp1")
    assert run == RunLayout(Path("runs/exp1"))
    assert {name: str(getattr(run, name)) for name in ("checkpoints", "final", "metrics", "run_json", "recipe",
                                                       "trackers", "dummy_data", "plot")} == {
        "checkpoints": "runs/exp1/checkpoints", "final": "runs/exp1/final", "metrics": "runs/exp1/metrics.jsonl",
        "run_json": "runs/exp1/run.json", "recipe": "runs/exp1/recipe.yaml", "trackers": "runs/exp1/trackers",
        "dummy_data": "runs/exp1/dummy_data", "plot": "runs/exp1/training.png"}
    # The shared cache is beside the output dir, not in it: a run stopped on bad input wrote nothing inside. The
    # locks are beside the resolved folder: every spelling of it meets the same one.
    assert (str(run.cache), str(run.tokenized), run.locks) == (
        "runs/.toolkit-cache", "runs/.toolkit-cache/tokenized", Path("runs").resolve() / ".toolkit-cache" / "locks")
    assert run.lock_file.parent == run.locks and str(run.earlier_attempts) == "runs/exp1/earlier-attempts"
    assert RunLayout.of_checkpoint(run.checkpoints / "step-00000004") == run


def test_a_full_disk_is_recognised_however_it_is_wrapped(tmp_path: Path) -> None:
    """toolkit.errors.out_of_space, the one place a full disk becomes an error line: ENOSPC and EDQUOT, bare, chained
    or only in the text a library keeps (safetensors' Rust writer); the innermost writer's path wins; anything
    else is not one."""
    import errno

    import pytest

    from toolkit.atomic import writing
    from toolkit.errors import OutOfSpace, out_of_space

    bare = OSError(errno.ENOSPC, "No space left on device")
    assert str(out_of_space(bare, tmp_path / "m.jsonl")).startswith(
        f"No space left on device writing {tmp_path / 'm.jsonl'}. Free space (or raise the quota) and relaunch")
    quota = out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded", "/q/f"))
    assert quota is not None and (quota.reason, quota.path) == ("Disk quota exceeded", Path("/q/f"))
    wrapped = RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                           "\"No space left on device\" })")
    assert out_of_space(wrapped, "x") is not None
    try:
        try:
            raise bare
        except OSError as e:
            raise ValueError("a library's own error") from e
    except ValueError as chained:
        assert out_of_space(chained, "y") is not None
    assert out_of_space(OSError(errno.EIO, "Input/output error"), "z") is None
    with pytest.raises(OutOfSpace) as err, writing(tmp_path / "outer"), writing(tmp_path / "outer" / "inner"):
        raise bare
    assert err.value.path == tmp_path / "outer" / "inner"


def test_files_built_get_the_umask_mode_safetensors_too(tmp_path: Path) -> None:
    """Under umask 002 a published folder's files are 0664, also those that safetensors writes 0600 (issue 39)."""
    import torch
    from safetensors.torch import save_file

    def build(folder: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
        (folder / "sub").mkdir()
        (folder / "sub" / "notes.txt").write_text("x")

    old = os.umask(0o002)
    try:
        atomic.build_dir(tmp_path / "out", build)
        atomic.write_text_atomic(tmp_path / "one.txt", "x")
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777)
             for p in tmp_path.rglob("*") if p.is_file()}
    assert modes == {"out/model.safetensors": "0o664", "out/sub/notes.txt": "0o664", "one.txt": "0o664"}


def test_a_folder_holding_only_dotfiles_is_not_empty(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 48's mutation audit: an output folder holding only `.git/` and `.env` is the user's, not empty: named
    by not_ours and refused by an output command (tiny-model's --out), its files left as they were."""
    from toolkit.atomic import not_ours
    from toolkit.commands import cli

    out = tmp_path / "mine"
    (out / ".git").mkdir(parents=True)
    (out / ".env").write_text("HF_TOKEN=hf_secret\n")
    assert not_ours(out) == [".env", ".git/"]
    assert cli.main(["tiny-model", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out ") and "it holds .env, .git/" in err
    assert sorted(p.name for p in out.iterdir()) == [".env", ".git"] and (out / ".env").read_text().startswith("HF_")
