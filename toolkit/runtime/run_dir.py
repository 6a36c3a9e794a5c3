"""The output directory: its layout (`RunLayout`, the one place that names a run's paths), one live writer at a
time, and an earlier run's outputs never replaced silently.

The lock is an advisory `flock` held by rank 0 for the life of the process: the kernel releases it when the
process ends, however it ends (SIGKILL included), so a crashed or killed run never blocks the next one, while a
live one (a trainer orphaned by its launcher, a second job on the same folder) makes a new run refuse to start.
It is keyed by the folder itself, not by how the path to it is spelled: a lock file beside the *resolved* output
dir (in the `.toolkit-cache` there, so a run that stops on bad input has written nothing inside the output dir),
named by the folder's name, and, where the folder exists, an flock on the folder itself. A symlink, `a/../b`, a
relative or absolute path, a bind mount of a folder above it or of the folder itself (a container's volume) all
meet the same lock. Where that parent is not writable (a container's writable volume mounted into a read-only
tree), the lock file and the shared cache go to the per-user cache (`user_cache`): a run writes nothing outside its
output dir and that cache.

A fresh start (no committed checkpoint to resume) in a folder holding an earlier run's outputs: an attempt of the
same recipe that stopped before its first checkpoint (a scheduler requeues the same command) has its records
moved aside, into `earlier-attempts/`, and the run starts afresh; a run that finished, or one of another recipe,
is refused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from toolkit.atomic import not_ours, open_own, refuse_not_ours
from toolkit.config.identity import changed_keys, resume_invariants
from toolkit.config.load import load_recipe, recipe_to_yaml
from toolkit.config.schema import path_component  # the recipe's rule, checked at load (unique per stage)
from toolkit.errors import ToolkitError

log = logging.getLogger(__name__)

CACHE = ".toolkit-cache"
CACHE_ENV = "TOOLKIT_CACHE_DIR"
"""The user's own cache folder: built-in models, tokenised data (unless data.cache_dir), and, where an output dir's
parent is not writable, its lock file."""


def user_cache() -> Path:
    """The per-user cache: $TOOLKIT_CACHE_DIR, else $XDG_CACHE_HOME/curriculum-toolkit, else
    ~/.cache/curriculum-toolkit (the XDG base directory default)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "curriculum-toolkit"


def writable(folder: Path) -> bool:
    """Whether this process may create `folder`'s entries: the folder, or where it does not exist yet its nearest
    existing ancestor, is a writable folder (access(2): a read-only mount says no, also to root)."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    return existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)


@dataclass(frozen=True)
class RunLayout:
    """Every path of a run, from its output dir (`root`). The shared cache lives beside it, not in it: built-in
    models, tokenised data and run locks are shared by the runs of one parent folder, and a run that stops on bad
    input has then written nothing inside its output dir."""

    root: Path

    def __init__(self, output_dir: str | Path) -> None:
        object.__setattr__(self, "root", Path(output_dir))

    @classmethod
    def of_checkpoint(cls, ckpt: Path) -> RunLayout:
        """The run that holds the checkpoint folder `ckpt` (`<root>/checkpoints/step-N`)."""
        return cls(ckpt.parent.parent)

    @property
    def checkpoints(self) -> Path:
        """Committed checkpoints, `step-N/` (see toolkit/checkpoint/manager.py)."""
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        """The trained adapter or model with its tokenizer / processor, written at the end."""
        return self.root / "final"

    @property
    def metrics(self) -> Path:
        """One JSON record per logged step, stage end and eval (toolkit/metrics/log.py)."""
        return self.root / "metrics.jsonl"

    @property
    def run_json(self) -> Path:
        """The run's identity: strategy, processes, batch, stages, versions."""
        return self.root / "run.json"

    @property
    def recipe(self) -> Path:
        """The resolved recipe the run trained with (export rebuilds the model from it)."""
        return self.root / "recipe.yaml"

    @property
    def trackers(self) -> Path:
        """accelerate's tracker logs (TensorBoard and the like)."""
        return self.root / "trackers"

    @property
    def dummy_data(self) -> Path:
        """Where the `dummy:` data files are generated."""
        return self.root / "dummy_data"

    @property
    def scores(self) -> Path:
        """Model scores of a stage's rows (toolkit/train/stage_scores.py): kept across relaunches, never moved
        aside, so a pass stopped part-way goes on and a resume reads the scores its stage was ordered by."""
        return self.root / "scores"

    def stage_scores(self, stage: str) -> Path:
        """`toolkit score`'s file of one stage, `scores/<stage>.parquet` (the name through path_component)."""
        return self.scores / f"{path_component(stage)}.parquet"

    @property
    def plot(self) -> Path:
        """`toolkit plot`'s picture of metrics.jsonl."""
        return self.root / "training.png"

    @property
    def report(self) -> Path:
        """The run's report page (toolkit/metrics/report.py), rewritten by rank 0 as the run goes."""
        return self.root / "report.html"

    @property
    def model_card(self) -> Path:
        """final/'s model card (toolkit/checkpoint/model_card.py)."""
        return self.final / "README.md"

    @property
    def evals(self) -> Path:
        """Generation-eval completions and the forgetting matrix (toolkit/evals/evaluator.py,
        toolkit/evals/forgetting.py)."""
        return self.root / "evals"

    def completions(self, stage: str, step: int) -> Path:
        """One eval's completions, `evals/<stage>/step-N.jsonl` (N as in checkpoint names)."""
        return self.evals / path_component(stage) / f"step-{step:08d}.jsonl"

    @property
    def rollouts(self) -> Path:
        """RL stages' completions with their rewards, `rollouts/<stage>.jsonl` (toolkit/train/rl_stage.py)."""
        return self.root / "rollouts"

    @property
    def eval_matrix(self) -> Path:
        """The forgetting matrix (eval.all_stages): one record per step, eval set and metric."""
        return self.evals / "matrix.jsonl"

    @property
    def matrix_plot(self) -> Path:
        """`toolkit plot`'s heatmap of the forgetting matrix."""
        return self.root / "forgetting.png"

    @property
    def logs(self) -> Path:
        """Each rank's log, `rank-N.log`: the traceback of an unexpected exception that stopped it (its one-line
        ending is on stderr; toolkit/runtime/exit_lines.py). Created only once the run's outputs are being written."""
        return self.root / "logs"

    def rank_log(self, rank: int, *, outputs_written: bool) -> Path:
        """Rank `rank`'s log file: in `logs`, or, for a run stopped before its outputs were written (its inputs
        still being checked), in the shared cache beside the output dir, which is then left as it was."""
        folder = self.logs if outputs_written else self.cache / "logs" / (self.root.resolve().name or "root")
        return folder / f"rank-{rank}.log"

    @property
    def cache(self) -> Path:
        """The cache shared by the runs beside this one: the built-in models' folders and tokenised data. It stays
        beside the output dir as written (where the user put a symlink, say), not as resolved: its entries are
        content-addressed and published atomically (toolkit/atomic.py), so two spellings of one folder that use two
        caches cost a rebuild, never a wrong or torn entry; and the resolved folder's parent may not be writable.
        Only the lock must be the same for every spelling (`lock_file`). $TOOLKIT_CACHE_DIR, where set, and the
        per-user cache where the parent is not writable, hold it instead (`user_cache`)."""
        beside = self.root.parent / CACHE
        return beside if not os.environ.get(CACHE_ENV) and writable(beside) else user_cache()

    @property
    def tokenized(self) -> Path:
        """The default tokenised-data cache (data.cache_dir)."""
        return self.cache / "tokenized"

    @property
    def locks(self) -> Path:
        """The run locks of the folder that really holds the output dir: beside its *resolved* path, so that every
        spelling of it (a symlink to it or to a folder above it, `a/../b`, relative or absolute) meets one lock; in
        the per-user cache where that parent is not writable (not $TOOLKIT_CACHE_DIR alone: launches that set it
        and launches that do not must meet one lock)."""
        beside = self.root.resolve().parent / CACHE / "locks"
        return beside if writable(beside) else user_cache() / "locks"

    @property
    def lock_file(self) -> Path:
        """The output dir's lock file, named by the resolved folder's name (not its whole path: reached through a
        bind mount of a folder above it, the path differs but the folder of locks is the same one); in the per-user
        cache, which holds the locks of every parent, by its whole resolved path (a folder there exists: its parent
        is not writable; its own flock meets every other spelling, `RunLock`)."""
        resolved, locks = self.root.resolve(), self.locks
        name = resolved.name if locks == resolved.parent / CACHE / "locks" else str(resolved)
        return locks / f"{hashlib.sha256(name.encode()).hexdigest()[:20]}.lock"

    @property
    def earlier_run_files(self) -> tuple[Path, ...]:
        """What a run writes into its output dir once training starts; their presence marks an earlier run."""
        return self.metrics, self.run_json, self.final, self.evals

    @property
    def records(self) -> tuple[Path, ...]:
        """What a run writes about itself into its output dir: its logs and identity (not its checkpoints, final
        model or generated inputs). An attempt that stopped before its first checkpoint has these set aside."""
        return (self.trackers, self.plot, self.matrix_plot, self.report, self.evals, self.metrics, self.run_json,
                self.recipe)  # the recipe last: see set_aside

    @property
    def earlier_attempts(self) -> Path:
        """Where the records of attempts that stopped before their first checkpoint are kept, one folder each."""
        return self.root / "earlier-attempts"


def is_within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies inside it, told by the folders' identity (device and inode), not by how
    the paths are spelled: a symlink, `..` or a bind mount on the way changes the spelling, not the folder. False
    when `folder` does not exist."""
    try:
        target = folder.stat()
    except OSError:
        return False
    spelled, resolved = path.absolute(), path.resolve()  # `..` after a symlink: the kernel's folder is resolve()'s
    for step in (spelled, *spelled.parents, resolved, *resolved.parents):
        try:
            here = step.stat()
        except OSError:  # not created yet
            continue
        if (here.st_dev, here.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def check_output_dir(out: Path) -> None:
    """Fail before any data or model is loaded when `out` cannot hold a run: a file, inside a file, or not
    writable."""
    if out.exists() and not out.is_dir():
        raise ToolkitError(f"output_dir {out} is a file; name a folder (it is created if missing).")
    existing = next(p for p in (out, *out.parents) if p.exists())  # '.' or '/' at the latest
    if not existing.is_dir():
        raise ToolkitError(f"output_dir {out} cannot be created: {existing} is a file.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ToolkitError(f"output_dir {out} is not writable ({existing} does not allow this user to write). "
                           "Choose a folder you can write to.")
    cache = RunLayout(out).cache
    if not writable(cache):
        raise ToolkitError(f"The toolkit's cache {cache} (built-in models, tokenised data, run locks) cannot be "
                           f"written. Set {CACHE_ENV} to a folder you can write to.")


def set_aside_earlier_attempt(layout: RunLayout, invariants: dict[str, Any]) -> Path | None:
    """Ready the output dir for a fresh start (no committed checkpoint to resume) of a run whose resume invariants
    (config.resume_invariants) are `invariants`. Where an earlier run left outputs (`earlier_run_files`):

    * it finished (final/): refused, starting here would replace its model and logs;
    * its recipe.yaml is another recipe's (other invariants), or is missing or unreadable: refused, these are not
      this run's to move;
    * else it is an attempt of this recipe that stopped before its first checkpoint (killed, preempted, crashed: a
      scheduler requeues the same command): its records are moved, not deleted, to
      `earlier_attempts/<its start time>/` with one warning saying where; that folder is returned.

    Where it holds none, it must be new, empty, or hold only what a run of this toolkit writes before its records
    (`not_a_run`): a folder of the user's is refused in one line naming what is there, as `toolkit export` refuses
    its --out (toolkit/atomic.py refuse_not_ours). None where the folder holds no earlier run. Call it on one
    process (rank 0)."""
    out = layout.root
    found = ", ".join(path.name for path in layout.earlier_run_files if path.exists())
    if not found:
        refuse_not_ours(out, not_a_run(layout), label="output_dir", what="a run of this toolkit",
                        then="a fresh start would write among them and could replace them",
                        fix="Choose a new or empty output_dir, or move those files away.")
        return None
    held = f"output_dir {out} holds the outputs of an earlier run ({found}) and no checkpoint to resume from"
    fix = "Use a new output_dir, or delete this one if you no longer need it."
    if layout.final.exists():
        raise ToolkitError(f"{held}: that run finished ({layout.final.name}/ is there) and starting here would "
                           f"replace its outputs. {fix}")
    if not layout.recipe.is_file():
        raise ToolkitError(f"{held}, and no {layout.recipe.name} to tell whether it was this run: starting here "
                           f"would replace them. {fix}")
    try:
        earlier = resume_invariants(load_recipe(layout.recipe))
    except ToolkitError as e:
        raise ToolkitError(f"{held}, and its {layout.recipe.name} cannot tell whether it was this run ({e}). "
                           f"{fix}") from None
    if earlier != invariants:
        keys = changed_keys(earlier, invariants)
        differs = ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
        raise ToolkitError(f"output_dir {out} holds the outputs of an earlier run of another recipe ({found}; its "
                           f"{layout.recipe.name} differs in {differs}) and no checkpoint to resume from: starting "
                           f"here would replace them. {fix}")
    started = time.strftime("%Y%m%d-%H%M%S", time.localtime(layout.recipe.stat().st_mtime))
    aside = layout.earlier_attempts / started
    for n in range(2, 1000):
        if not aside.exists():
            break
        aside = layout.earlier_attempts / f"{started}-{n}"
    aside.mkdir(parents=True)
    moved = []
    for path in layout.records:  # the recipe last: stopped midway, the next launch finds it and moves the rest
        if path.exists():
            path.rename(aside / path.name)
            moved.append(path.name)
    log.warning("output_dir %s: an earlier attempt of this recipe stopped before its first checkpoint; its records "
                "(%s) were moved to %s, and this run starts afresh.", out, ", ".join(moved), aside)
    return aside


_OUR_TEMPORARY = re.compile(r"^\..+\.(tmp|old-[0-9a-f]{8})$")
"""toolkit/atomic.py's temporary files and folders (`.<name>.*.tmp`, `.<name>.old-*`), left by a killed writer."""
_OUR_CHECKPOINT_ENTRY = re.compile(r"^(best\.json|step-\d{8}(\.[0-9a-f]{8})?\.tmp|\..+\.(tmp|old-[0-9a-f]{8}))$")
"""What the checkpoint manager leaves in `checkpoints/` before its first commit: best.json, the folder of a save
being written (`step-N.tmp`) or set aside (`step-N.<hex>.tmp`), atomic.py's temporaries."""


def _our_recipe(path: Path) -> bool:
    """Whether `path` is a recipe.yaml as a run writes it: the full dump of a recipe (toolkit/config/load.py
    recipe_to_yaml), byte for byte. A recipe the user wrote names only some keys."""
    try:
        return recipe_to_yaml(load_recipe(path)) == path.read_text(encoding="utf-8")
    except (ToolkitError, OSError, UnicodeDecodeError):
        return False


def not_a_run(layout: RunLayout) -> list[str]:
    """What in the output dir no run of this toolkit wrote (`toolkit/atomic.py not_ours`), for a folder holding no
    earlier run's records: a run writes only the layout's own names into it (`recipe.yaml` only as its full dump),
    the shared cache where the user set it there, atomic.py's temporaries, and in `checkpoints/` the manager's own
    names; anything else is the user's. An uncommitted `checkpoints/step-N/` is not the manager's (it commits a
    folder whole, marker included): a save of that step would replace it."""
    names = {p.name for p in (layout.checkpoints, layout.final, layout.metrics, layout.run_json, layout.trackers,
                              layout.dummy_data, layout.plot, layout.evals, layout.matrix_plot, layout.logs,
                              layout.earlier_attempts, layout.scores)} | {f"{layout.final.name}.tmp", CACHE}

    def ours(path: Path) -> bool:
        if path.name == layout.recipe.name:
            return _our_recipe(path)
        return (path.name in names or bool(_OUR_TEMPORARY.match(path.name))) and not path.is_symlink()

    found = not_ours(layout.root, ours=ours)
    if "checkpoints/" in found or not layout.checkpoints.is_dir():
        return found
    return found + [f"checkpoints/{name}" for name in not_ours(
        layout.checkpoints, ours=lambda p: bool(_OUR_CHECKPOINT_ENTRY.match(p.name)) and not p.is_symlink())]


class RunLock:
    """Exclusive, process-lifetime lock on an output dir (see the module docstring). Hold the object."""

    def __init__(self, layout: RunLayout) -> None:
        self.path = layout.lock_file
        self.out = layout.root
        self._file: IO[str] | None = None
        self._folder: weakref.finalize | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns None, or why it cannot be taken (who holds it)."""
        busy = self._lock_file()
        if busy is None:
            busy = self._lock_folder()
            if busy is not None:
                self.release()  # the lock file too: a launch that refuses to start holds nothing
        return busy

    def release(self) -> None:
        """Let the lock go now (the end of the process, or of the object, does it too)."""
        if self._folder is not None:
            self._folder()
            self._folder = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _lock_file(self) -> str | None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Never through a link, nor truncating a file found there before it is known to be a lock (open_own).
            f = os.fdopen(open_own(self.path, os.O_RDWR | os.O_CREAT), "r+", encoding="utf-8")
        except ToolkitError as e:
            return f"its lock file cannot be used: {str(e).rstrip('.')}"
        except OSError as e:
            return f"its lock file {self.path} cannot be opened ({e.strerror})"
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            try:
                who = json.loads(holder)
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["since"]))
                desc = f"pid {who['pid']} on {who['host']}, started {since}"
            except (ValueError, KeyError, TypeError):
                desc = "another process"
            return (f"a live run is writing it ({desc}; lock {self.path}). Wait for it to end or stop it; a run "
                    "stopped by a signal saves and exits within a step")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                            "output_dir": str(self.out.resolve())}))
        f.flush()
        self._file = f  # open for the life of the process; closing it would release the lock
        return None

    def _lock_folder(self) -> str | None:
        """The output dir's own flock, where it exists: one inode however it is reached, also through a bind mount
        of the folder itself (a container's volume), whose lock file would be beside another parent. A folder not
        created yet is reached through its parent, whose lock file every path meets."""
        try:
            fd = os.open(self.out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:  # not created yet, or not readable: the lock file guards it
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return ("a live run is writing it (a process that reached the folder by another path: a bind mount or a "
                    "container's volume). Wait for it to end or stop it; a run stopped by a signal saves and exits "
                    "within a step")
        except OSError:  # a file system without flock on folders (NFS): the lock file guards it
            os.close(fd)
            return None
        self._folder = weakref.finalize(self, os.close, fd)  # open for the life of the object (the process)
        return None


COMMIT_MARKER = "COMMITTED"


_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def committed_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first. Temporary and unmarked directories are ignored."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / COMMIT_MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)
