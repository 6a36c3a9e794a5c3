"""`toolkit train`: print the canonical launch of a run, then become it.

    toolkit train --config R [--accelerate-config NAME|PATH] [--dry-run] [overrides] [-- accelerate args]

prints `accelerate launch --config_file C [accelerate args] train_curriculum.py --config R [overrides]` and execs it
(`os.execv`): the same process, so its PID, the signals it is sent and its exit code are the launch's. The line is
the whole truth: run it by hand and the same run trains. train_curriculum.py stays the entry; this only finds it and
the shipped configs.

Where they are: in a clone (the package imported from the repository, editable or on PYTHONPATH) the repository's
own `train_curriculum.py`, `accelerate_configs/` and `ds_configs/`; in an installed package the copies its wheel
carries in `toolkit/launch/` (setup.py puts them there at build time). A shipped config names its DeepSpeed JSON
relative to the launch's working directory (`ds_configs/zero3.json`), as accelerate reads it; launched from
anywhere else, the line adds `--deepspeed_config_file` with the JSON beside the config.

Refused in one line before anything starts: an unknown config name, a DeepSpeed config without DeepSpeed
installed, a recipe that does not load or asks for a tracker that is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

from toolkit.errors import ToolkitError

ENTRY = "train_curriculum.py"
CONFIGS = "accelerate_configs"
INSTALLED_LAUNCH_DIR = "launch"
"""The folder of the package that holds the launch files in an installed wheel (setup.py writes it)."""
DEFAULT_CONFIG = "single"


def launch_root(package: Path | None = None) -> Path:
    """The folder holding train_curriculum.py, accelerate_configs/ and ds_configs/ for the toolkit package at
    `package` (default: this one): the clone it sits in, else the copies installed inside it."""
    package = (package or Path(__file__).resolve().parents[1])
    for root in (package.parent, package / INSTALLED_LAUNCH_DIR):
        if (root / ENTRY).is_file() and (root / CONFIGS).is_dir():
            return root
    raise ToolkitError(f"{ENTRY} and {CONFIGS}/ are neither beside {package} (a clone) nor in "
                       f"{package / INSTALLED_LAUNCH_DIR} (an installed wheel): reinstall the toolkit.")


def shipped_configs(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / CONFIGS).glob("*.yaml"))


def looks_like_path(choice: str) -> bool:
    """Whether `--accelerate-config` names a file: it contains a `/` (or the platform's separator) or ends in
    .yaml / .yml. Anything else is a shipped config's name."""
    return "/" in choice or os.sep in choice or choice.endswith((".yaml", ".yml"))


def find_config(choice: str, root: Path) -> Path:
    """The accelerate config `--accelerate-config` names: a file when it looks like a path (looks_like_path), else
    always a shipped config by name (`ddp`, `zero3`, ...), whatever the working folder holds: a file named `ddp`
    there never replaces the shipped ddp.yaml, and a folder named `zero3` never hides the shipped one. A clash (a
    shipped name that is also an entry of the working folder) is named in one line on stderr."""
    names = shipped_configs(root)
    if looks_like_path(choice):
        path = Path(choice)
        if not path.is_file():
            raise ToolkitError(f"--accelerate-config {choice} does not exist (or is not a file): name an accelerate "
                               f"config file, or a shipped config by name ({', '.join(names)}).")
        return path
    shipped = root / CONFIGS / f"{choice}.yaml"
    here = Path(choice)
    if not shipped.is_file():
        local = (f" ./{choice} is here: a file is named as a path (./{choice})." if here.exists() or
                 here.is_symlink() else "")
        raise ToolkitError(f"--accelerate-config {choice} is not a shipped config ({', '.join(names)}).{local} "
                           "An accelerate config file is named by a path: one with a / or ending in .yaml.")
    if here.exists() or here.is_symlink():
        print(f"note: --accelerate-config {choice} is the shipped {CONFIGS}/{choice}.yaml, not ./{choice} in this "
              f"folder: to use that file, write ./{choice}.", file=sys.stderr, flush=True)
    return shipped


def _shown(path: Path) -> str:
    """`path` as the line shows it: relative to the working directory when inside it (a clone's canonical line
    reads `accelerate_configs/ddp.yaml`), else absolute."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def _deepspeed_args(config: Path, launch_args: list[str]) -> list[str]:
    """What the line adds for a DeepSpeed config: nothing, or `--deepspeed_config_file` with the JSON beside the
    config when the path it names does not lead there from the working directory. DeepSpeed must be installed."""
    from toolkit.strategies import deepspeed_of_config

    uses, named = deepspeed_of_config(config)
    if not uses:
        return []
    if importlib.util.find_spec("deepspeed") is None:
        raise ToolkitError(f"{_shown(config)} launches DeepSpeed, which is not installed: pip install "
                           "'curriculum-toolkit[deepspeed]' (or choose a config without DeepSpeed: single, ddp, fsdp).")
    if named is None or Path(named).is_absolute() or Path(named).is_file() or \
            any(a.startswith("--deepspeed_config_file") for a in launch_args):
        return []
    beside = config.resolve().parent.parent / named
    if not beside.is_file():
        raise ToolkitError(f"{_shown(config)} names DeepSpeed config {named}, which exists neither from here "
                           f"({Path.cwd()}) nor beside the config ({beside}).")
    return ["--deepspeed_config_file", _shown(beside)]


def _check_recipe(config: str | None, script_args: list[str]) -> None:
    """Load the recipe with its overrides and check its trackers are installed: bad input is one line here,
    not one per process after the launch."""
    from toolkit.config.load import load_recipe
    from toolkit.metrics.log import check_trackers

    overrides = [a for a in script_args if "=" in a and not a.startswith("-")]
    check_trackers(load_recipe(config, overrides).logging.trackers)


def launch_line(config: str | None, accelerate_config: str, script_args: list[str], launch_args: list[str],
                root: Path | None = None) -> list[str]:
    """The canonical `accelerate launch` line of a run (see the module docstring), checked."""
    root = root or launch_root()
    chosen = find_config(accelerate_config, root)
    extra = _deepspeed_args(chosen, launch_args)
    _check_recipe(config, script_args)
    recipe = ["--config", config] if config is not None else []
    return ["accelerate", "launch", "--config_file", _shown(chosen), *extra, *launch_args, _shown(root / ENTRY),
            *recipe, *script_args]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="toolkit train", allow_abbrev=False,
        description="Print the canonical `accelerate launch ... train_curriculum.py ...` line of a run, then run it "
                    "(exec: same PID, signals and exit code). Arguments it does not know (overrides key.sub=value, "
                    "--create_dummy_data, ...) go to train_curriculum.py; those after `--` to accelerate launch.")
    p.add_argument("--config", help="Recipe YAML (default: the embedded tiny demo recipe).")
    p.add_argument("--accelerate-config", default=DEFAULT_CONFIG,
                   help="A shipped config by name (single, ddp, fsdp, zero2, zero3, zero3_offload, zero3_sp2, ...) or "
                        f"an accelerate config file (default: {DEFAULT_CONFIG}).")
    p.add_argument("--dry-run", action="store_true", help="Print the line and stop.")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`toolkit train`'s arguments: before `--` its own and train_curriculum.py's (kept in their order), after it
    accelerate launch's."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args, script_args = parser().parse_known_intermixed_args(argv[:cut])
    args.script_args, args.launch_args = script_args, argv[cut + 1:]
    return args


def train(args: argparse.Namespace) -> None:
    line = launch_line(args.config, args.accelerate_config, args.script_args, args.launch_args)
    print(shlex.join(line), flush=True)
    if args.dry_run:
        return
    # `accelerate launch` is accelerate's console script for this module: run with this interpreter, the one the
    # toolkit is installed in, whichever `accelerate` comes first on PATH.
    os.execv(sys.executable, [sys.executable, "-m", "accelerate.commands.launch", *line[2:]])
