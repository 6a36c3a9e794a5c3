"""The output dir: one lock however its path is spelled, and an earlier run's outputs set aside (an interrupted
attempt of the same recipe) or refused (a finished run, another recipe's), never replaced."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env
from toolkit.builtin.models import TINY_MODEL, builtin_dir
from toolkit.config.identity import resume_invariants
from toolkit.config.load import load_recipe, recipe_to_yaml
from toolkit.errors import ToolkitError
from toolkit.runtime.run_dir import CACHE, RunLayout, RunLock, set_aside_earlier_attempt

BUSY = "a live run is writing it"


def take(path: Path) -> RunLock:
    lock = RunLock(RunLayout(path))
    assert lock.acquire() is None
    return lock


@pytest.mark.parametrize("exists", [True, False])
def test_every_spelling_of_one_folder_meets_one_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     exists: bool) -> None:
    """A symlink to the folder or to a folder above it (in another parent folder), `a/../b`, relative or absolute:
    one lock. Also for a folder a live run has not created yet (a symlink may already point at it)."""
    real = tmp_path / "runs" / "exp"
    real.parent.mkdir()
    if exists:
        real.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "exp").symlink_to(real)  # another parent folder: another .toolkit-cache beside it
    (tmp_path / "runs_link").symlink_to(tmp_path / "runs")
    (tmp_path / "runs" / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    holder = take(real)
    for spelling in ("elsewhere/exp", "runs_link/exp", "runs/other/../exp", "runs/exp", str(real)):
        busy = RunLock(RunLayout(spelling)).acquire()
        assert busy is not None and busy.startswith(BUSY) and f"pid {os.getpid()}" in busy, spelling
    assert take(tmp_path / "runs" / "other")  # another folder is free
    holder.release()
    assert take(Path("elsewhere/exp"))  # the lock went with its holder


def test_a_folder_that_is_busy_releases_the_lock_file(tmp_path: Path) -> None:
    """Where the folder's own flock is held (reached by another path, see below) the lock file taken first is let
    go again: the next launch must not find it held by a process that is refusing to start."""
    (tmp_path / "exp").mkdir()
    import fcntl

    fd = os.open(tmp_path / "exp", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run that reached the folder through a bind mount
        busy = RunLock(RunLayout(tmp_path / "exp")).acquire()
        assert busy is not None and busy.startswith(BUSY) and "bind mount" in busy
    finally:
        os.close(fd)
    assert take(tmp_path / "exp")


def unshare_mount() -> bool:
    return shutil.which("unshare") is not None and os.geteuid() == 0 and subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True).returncode == 0


PROBE = """
import sys
from toolkit.runtime.run_dir import RunLayout, RunLock
print("|".join(str(RunLock(RunLayout(path)).acquire()) for path in sys.argv[1:]))
"""


@pytest.mark.skipif(not unshare_mount(), reason="needs root and unshare(1) to make a mount namespace")
def test_lock_holds_through_bind_mounts(tmp_path: Path) -> None:
    """A container's volume: the output dir itself, or a folder above it, mounted at another path. The resolved
    paths differ (and so does the folder beside the first); the folder's flock and the lock file named by the
    folder's name still meet the live run's lock."""
    real = tmp_path / "runs" / "exp"
    real.mkdir(parents=True)
    (tmp_path / "volume").mkdir()
    (tmp_path / "home").mkdir()
    holder = take(real)
    script = ('mount --bind "$1" "$2" && mount --bind "$3" "$4" && exec "$5" -c "$6" "$2" "$4/exp"')
    out = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", str(real), str(tmp_path / "volume"),
                          str(real.parent), str(tmp_path / "home"), sys.executable, PROBE],
                         cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    volume, home = out.stdout.strip().split("|")
    assert volume.startswith(BUSY) and "bind mount" in volume
    assert home.startswith(BUSY) and f"pid {os.getpid()}" in home
    holder.release()


IDENTITY_PROBE = """
import sys
from pathlib import Path
from toolkit.runtime.run_dir import is_within
print(is_within(Path(sys.argv[1]), Path(sys.argv[2])), is_within(Path(sys.argv[3]), Path(sys.argv[2])))
"""


def test_is_within_tells_folders_by_identity(tmp_path: Path) -> None:
    from toolkit.runtime.run_dir import is_within

    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "run")
    assert is_within(tmp_path / "link" / "final" / "not-yet" / "x", tmp_path / "run" / "final")
    assert is_within(tmp_path / "run", tmp_path / "link") and is_within(tmp_path / "run/final/..", tmp_path / "run")
    (tmp_path / "p" / "y" / "z").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "link").symlink_to(tmp_path / "p" / "y" / "z")
    assert is_within(tmp_path / "a" / "link" / ".." / "w", tmp_path / "p")  # the kernel's `..`: p/y/z/.. = p/y
    assert not is_within(tmp_path / "run", tmp_path / "run" / "final")
    assert not is_within(tmp_path / "run", tmp_path / "missing")
    if unshare_mount():  # a bind mount of the run's parent: another path, the same folders
        script = 'mount --bind "$1" "$2" && exec "$3" -c "$4" "$2/run/final/x" "$1/run" "$2/other"'
        (tmp_path / "view").mkdir()
        out = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", str(tmp_path), str(tmp_path / "view"),
                              sys.executable, IDENTITY_PROBE], cwd=REPO, env=run_env(), capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.split() == ["True", "False"], out.stderr[-3000:]


# --- an earlier run's outputs --------------------------------------------------------------------------------------

def earlier_attempt(root: Path, lr: float = 2e-4) -> tuple[RunLayout, dict[str, str]]:
    """An output dir as an attempt of the embedded recipe (optimizer.lr=`lr`) leaves it when killed before its
    first checkpoint: its records, an uncommitted checkpoint folder and the generated data; returns the records."""
    layout = RunLayout(root)
    root.mkdir()
    layout.recipe.write_text(recipe_to_yaml(load_recipe(None, [f"optimizer.lr={lr}"])))
    layout.run_json.write_text(json.dumps({"run_name": "first"}))
    layout.metrics.write_text('{"step": 1, "loss": 7.1}\n{"step": 2, "loss": 7.0}\n')
    (layout.trackers / "first").mkdir(parents=True)
    (layout.trackers / "first" / "events.out").write_text("events")
    (layout.checkpoints / "step-00000005.tmp").mkdir(parents=True)
    layout.dummy_data.mkdir()
    (layout.dummy_data / "easy.jsonl").write_text("{}\n")
    records = {p.name: p.read_text() for p in (layout.recipe, layout.run_json, layout.metrics)}
    return layout, records


def test_interrupted_attempt_of_the_same_recipe_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    layout, records = earlier_attempt(tmp_path / "run")
    invariants = resume_invariants(load_recipe(None, ["optimizer.lr=2e-4", "train.grad_accum=8"]))
    with caplog.at_level(logging.WARNING):
        aside = set_aside_earlier_attempt(layout, invariants)
    assert aside is not None and aside.parent == layout.earlier_attempts
    assert {p.name: p.read_text() for p in aside.iterdir() if p.is_file()} == records  # moved whole
    assert (aside / "trackers" / "first" / "events.out").read_text() == "events"
    assert not any(p.exists() for p in (layout.recipe, layout.run_json, layout.metrics, layout.trackers))
    assert (layout.dummy_data / "easy.jsonl").exists() and (layout.checkpoints / "step-00000005.tmp").exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(aside) in warnings[0] and "starts afresh" in warnings[0]
    assert set_aside_earlier_attempt(layout, invariants) is None  # nothing left to set aside


def test_same_start_second_gets_its_own_folder(tmp_path: Path) -> None:
    """Two attempts killed in a row, started within the same second: a folder each, nothing overwritten."""
    layout, _ = earlier_attempt(tmp_path / "run")
    invariants = resume_invariants(load_recipe(None, ["optimizer.lr=2e-4"]))
    start = layout.recipe.stat().st_mtime
    first = set_aside_earlier_attempt(layout, invariants)
    layout.recipe.write_text(recipe_to_yaml(load_recipe(None, ["optimizer.lr=2e-4"])))
    layout.metrics.write_text("{}\n")
    os.utime(layout.recipe, (start, start))
    second = set_aside_earlier_attempt(layout, invariants)
    assert first is not None and second == first.with_name(f"{first.name}-2")


def refused(layout: RunLayout, invariants: dict[str, object]) -> str:
    before = sorted((str(p), p.stat().st_mtime_ns) for p in layout.root.rglob("*"))
    with pytest.raises(ToolkitError) as e:
        set_aside_earlier_attempt(layout, invariants)
    assert sorted((str(p), p.stat().st_mtime_ns) for p in layout.root.rglob("*")) == before  # nothing moved
    return str(e.value)


def test_another_recipe_a_finished_run_or_an_unknown_one_are_refused(tmp_path: Path) -> None:
    layout, _ = earlier_attempt(tmp_path / "run", lr=2e-4)
    message = refused(layout, resume_invariants(load_recipe(None, ["optimizer.lr=1e-3"])))
    assert "earlier run of another recipe (metrics.jsonl, run.json; its recipe.yaml differs in optimizer.lr)" in \
        message

    same = resume_invariants(load_recipe(None, ["optimizer.lr=2e-4"]))
    layout.recipe.write_text("optimizer: {lr: [1, 2]}\n")
    assert "its recipe.yaml cannot tell whether it was this run" in refused(layout, same)
    layout.recipe.unlink()
    assert "and no recipe.yaml to tell whether it was this run" in refused(layout, same)

    layout.recipe.write_text(recipe_to_yaml(load_recipe(None, ["optimizer.lr=2e-4"])))
    layout.final.mkdir()
    assert "(metrics.jsonl, run.json, final) and no checkpoint to resume from: that run finished" in \
        refused(layout, same)


def test_an_empty_or_new_folder_is_left_alone(tmp_path: Path) -> None:
    invariants = resume_invariants(load_recipe(None))
    assert set_aside_earlier_attempt(RunLayout(tmp_path / "new"), invariants) is None
    (tmp_path / "empty").mkdir()
    assert set_aside_earlier_attempt(RunLayout(tmp_path / "empty"), invariants) is None
    assert not (tmp_path / "new").exists()


def test_what_a_run_writes_before_its_records_is_a_run_of_ours(tmp_path: Path) -> None:
    """A launch stopped before run.json (bad input found late, a kill) leaves generated data, a save being written,
    the shared cache where the user put it, atomic.py's temporaries, its recipe.yaml: the next launch starts."""
    layout = RunLayout(tmp_path / "run")
    (layout.dummy_data).mkdir(parents=True)
    (layout.checkpoints / "step-00000005.tmp").mkdir(parents=True)
    (layout.root / CACHE).mkdir()
    (layout.root / ".run.json.abc123.tmp").write_text("{")
    layout.recipe.write_text(recipe_to_yaml(load_recipe(None)))
    assert set_aside_earlier_attempt(layout, resume_invariants(load_recipe(None))) is None


@pytest.mark.parametrize("users", ["notes.txt", "recipe.yaml", "checkpoints/step-00000099", "checkpoints/backup.tmp"])
def test_a_folder_of_the_users_is_refused_naming_what_is_there(tmp_path: Path, users: str) -> None:
    """A fresh start in a folder holding no run of ours would have overwritten the user's recipe.yaml, and saving
    (or rotating) would have replaced their `checkpoints/step-00000099/` (issue 39): refused, one line, as export
    refuses its --out."""
    layout = RunLayout(tmp_path / "mine")
    path = layout.root / users
    if users.startswith("checkpoints/"):
        path.mkdir(parents=True)
        (path / "weights.bin").write_bytes(b"mine")
    else:
        layout.root.mkdir()
        path.write_text("model: {name_or_path: my/model}\n" if users == "recipe.yaml" else "the user's\n")
    message = refused(layout, resume_invariants(load_recipe(None)))
    assert message.startswith(f"output_dir {layout.root} is a non-empty folder that is not a run of this toolkit "
                              f"(it holds {users + ('/' if users.startswith('checkpoints/') else '')})")
    assert "\n" not in message


# --- an output dir whose parent is read-only (a container's volume in a read-only tree) -------------------------

def in_read_only_tree(tmp_path: Path, script: str, *, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the shell `script` with `tmp_path/tree` read-only and `tmp_path/tree/out` a writable folder mounted on it
    (a container's volume), in a mount namespace of its own (the mounts go with it, whatever happens). HOME and
    XDG_CACHE_HOME point into tmp_path. Skips where this machine allows no such mounts. Even root cannot write to a
    read-only mount, unlike a chmod 0555 folder."""
    tree, volume = tmp_path / "tree", tmp_path / "volume"
    (tree / "out").mkdir(parents=True)
    volume.mkdir()
    mounts = (f"mount --bind {tree} {tree} && mount -o remount,bind,ro {tree} && mount --bind {volume} {tree}/out "
              f"&& ! touch {tree}/x 2>/dev/null && touch {tree}/out/x && rm {tree}/out/x")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mounts],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a private mount namespace with bind mounts (unshare, mount): {probe.stderr.strip()}")
    env = run_env() | {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop("TOOLKIT_CACHE_DIR", None)
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{mounts} && {script}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


_LAYOUT_CHECK = """
import json, os, sys
from pathlib import Path
from toolkit.runtime.run_dir import RunLayout, RunLock, check_output_dir
out = Path(sys.argv[1])
check_output_dir(out)
layout = RunLayout(out)
first, second = RunLock(layout), RunLock(RunLayout(str(out) + "/../out"))
print(json.dumps({"cache": str(layout.cache), "tokenized": str(layout.tokenized), "lock": str(layout.lock_file),
                  "first": first.acquire(), "second": second.acquire(),
                  "env": str(RunLayout(out).cache) if os.environ.setdefault("TOOLKIT_CACHE_DIR", "/srv/c") else ""}))
"""


def test_a_read_only_parent_puts_the_cache_and_the_lock_in_the_user_cache(tmp_path: Path) -> None:
    """The hostile pass's container layout: the run lock and the built-in model cache always went to
    `<parent>/.toolkit-cache`, so an output dir on a writable volume in a read-only tree could not be used. They go
    to $XDG_CACHE_HOME/curriculum-toolkit (or $TOOLKIT_CACHE_DIR) then; the lock still keeps a second writer out."""
    out = tmp_path / "tree" / "out"
    proc = in_read_only_tree(tmp_path, f"{sys.executable} -c '{_LAYOUT_CHECK}' {out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    user = tmp_path / "xdg" / "curriculum-toolkit"
    assert seen["cache"] == str(user) and seen["tokenized"] == str(user / "tokenized")
    assert Path(seen["lock"]).parent == user / "locks" and seen["first"] is None
    assert seen["second"] is not None and seen["second"].startswith(BUSY)
    assert seen["env"] == "/srv/c"  # the user's own cache folder, where set
    # A writable parent keeps today's layout (existing runs, caches and resume hashes as they were).
    assert RunLayout(tmp_path / "volume").cache == tmp_path / CACHE


def test_the_smoke_recipe_trains_into_a_volume_in_a_read_only_tree(tmp_path: Path) -> None:
    """A real run of recipes/smoke.yaml (its built-in model) into that output dir finishes; it used to fail on the
    lock, and on the built-in model's cache with a crash "to report". Its cache is the user's."""
    out, user = tmp_path / "tree" / "out", tmp_path / "xdg" / "curriculum-toolkit"
    proc = in_read_only_tree(tmp_path, f"{sys.executable} train_curriculum.py --config recipes/smoke.yaml "
                                       f"--create_dummy_data --num_dummy_samples 16 output_dir={out} "
                                       "stages.0.max_steps=2 stages.1.max_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "volume" / "final" / "adapter_model.safetensors").is_file()  # what the run saw as out/final
    assert sorted(p.name for p in (tmp_path / "tree").iterdir()) == ["out"]
    assert (builtin_dir(TINY_MODEL, user) / "config.json").is_file() and list((user / "tokenized").iterdir())
    assert [p.suffix for p in (user / "locks").iterdir()] == [".lock"]


@pytest.mark.parametrize("planted", ["symlink", "fifo", "hardlink"])
def test_a_lock_file_planted_in_the_shared_folder_is_refused_and_never_written(tmp_path: Path,
                                                                                planted: str) -> None:
    """The run lock's name is predictable and its folder shared (`.toolkit-cache/locks`): a link planted there by
    anyone who can write the folder must not make the launch write lock JSON into the user's file (issue 39)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    layout = RunLayout(tmp_path / "runs" / "exp")
    layout.lock_file.parent.mkdir(parents=True)
    {"symlink": lambda p: p.symlink_to(victim), "fifo": os.mkfifo,
     "hardlink": lambda p: os.link(victim, p)}[planted](layout.lock_file)
    busy = RunLock(layout).acquire()
    assert busy is not None and str(layout.lock_file) in busy and "\n" not in busy
    assert ("symbolic link" if planted == "symlink" else "regular file" if planted == "fifo" else "hard links") in busy
    assert victim.read_text() == "the user's own file\n"


def test_a_name_becomes_one_path_component_never_a_step_out() -> None:
    """path_component: the one way a stage, run or eval name becomes part of a path (evals/, scores/, trackers/)."""
    from toolkit.runtime.run_dir import RunLayout, path_component

    for name in ("../../mine", "..", ".", "/etc/passwd", "a/../../b", ".hidden", "", "x\x00y", "C:\\x"):
        part = path_component(name)
        assert part and "/" not in part and "\\" not in part and not part.startswith(".") and "\x00" not in part
    assert path_component("stage-1.v2") == "stage-1.v2"
    layout = RunLayout(Path("/r"))
    assert layout.stage_scores("../../mine") == Path("/r/scores/_._.._mine.parquet")
    assert layout.completions("../x", 3).parent == Path("/r/evals/_._x")
