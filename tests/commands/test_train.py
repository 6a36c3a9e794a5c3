"""Tests for toolkit/commands/train.py: `toolkit train` prints the canonical launch line (what it then execs), and
finds train_curriculum.py and the shipped configs in an installed wheel as in the clone. Its 2-process run, equal
to the canonical launch's, is in tests/e2e/test_launch_configs.py (it shares that file's DDP reference run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.inprocess import Call, invoke, snapshot
from toolkit.commands.train import launch_line, launch_root


def test_dry_run_prints_the_canonical_line_and_nothing_else(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(REPO / "accelerate_configs")
    argv = ["train", "stages.0.max_steps=2", "--config", "recipes/smoke.yaml", "--accelerate-config", "ddp",
            "--create_dummy_data", "--num_dummy_samples", "64", "--dry-run", "--", "--num_processes", "2"]
    rc, stderr = invoke(Call(argv, REPO, tool="toolkit"), REPO, monkeypatch)
    assert rc == 0, stderr
    assert capsys.readouterr().out == (
        "accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 train_curriculum.py "
        "--config recipes/smoke.yaml stages.0.max_steps=2 --create_dummy_data --num_dummy_samples 64\n")
    assert snapshot(REPO / "accelerate_configs") == before



def test_what_is_execd_is_the_printed_line(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Without --dry-run the command execs exactly the line it printed (accelerate launch run by this interpreter),
    not merely prints it: os.execv is caught where it would replace the process."""
    import shlex

    execd: list[tuple[str, list[str]]] = []

    class Execd(Exception):
        pass

    def execv(path: str, argv: list[str]) -> None:
        execd.append((path, list(argv)))
        raise Execd

    monkeypatch.setattr(os, "execv", execv)
    argv = ["train", "stages.0.max_steps=2", "--config", "recipes/smoke.yaml", "--accelerate-config", "ddp",
            "--create_dummy_data", "--", "--num_processes", "2"]
    monkeypatch.chdir(REPO)
    from toolkit.commands import cli

    with pytest.raises(Execd):
        cli.main(argv)
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed[:2] == ["accelerate", "launch"] and "--num_processes" in printed
    assert execd == [(sys.executable, [sys.executable, "-m", "accelerate.commands.launch", *printed[2:]])]


def test_a_bare_word_is_always_a_shipped_config_and_a_clash_is_named(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A file named `ddp` in the working folder never replaces the shipped ddp.yaml (the clash is named in one
    line), a folder named `zero3` never hides the shipped one, and a file is named by a path (./ddp, x.yaml)."""
    from toolkit.commands.train import find_config
    from toolkit.errors import ToolkitError

    root = launch_root()
    os.chdir(tmp_path)
    try:
        (tmp_path / "ddp").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\n")
        (tmp_path / "zero3").mkdir()
        assert find_config("ddp", root) == root / "accelerate_configs" / "ddp.yaml"
        assert capsys.readouterr().err == ("note: --accelerate-config ddp is the shipped accelerate_configs/ddp.yaml, "
                                           "not ./ddp in this folder: to use that file, write ./ddp.\n")
        assert find_config("zero3", root) == root / "accelerate_configs" / "zero3.yaml"
        assert find_config("./ddp", root) == Path("./ddp")
        (tmp_path / "mine").write_text("x")
        with pytest.raises(ToolkitError, match=r"mine is not a shipped config .* \./mine is here: a file is named "
                                               r"as a path"):
            find_config("mine", root)
        with pytest.raises(ToolkitError, match=r"zero3/ does not exist \(or is not a file\)"):
            find_config("zero3/", root)
    finally:
        os.chdir(REPO)

def test_a_deepspeed_config_launched_from_elsewhere_names_its_json(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate reads `ds_configs/zero3.json` from the working directory: from any other folder the line names the
    JSON beside the shipped config, and a path the user gives is left alone."""
    monkeypatch.chdir(tmp_path)
    line = launch_line(None, "zero3", [], [])
    assert line[:4] == ["accelerate", "launch", "--config_file", str(REPO / "accelerate_configs" / "zero3.yaml")]
    assert line[4:6] == ["--deepspeed_config_file", str(REPO / "ds_configs" / "zero3.json")]
    assert line[6:] == [str(REPO / "train_curriculum.py")]
    mine = ["--deepspeed_config_file", str(REPO / "ds_configs" / "zero3_offload.json")]
    assert launch_line(None, "zero3", [], mine)[4:7] == [*mine, str(REPO / "train_curriculum.py")]


def test_a_deepspeed_config_without_deepspeed_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as Python marks a module that cannot be imported
    rc, stderr = invoke(Call(["train", "--accelerate-config", "zero2", "--dry-run"], REPO, tool="toolkit"), REPO,
                        monkeypatch)
    assert rc == 2 and capsys.readouterr().out == ""
    assert stderr.strip() == ("error: accelerate_configs/zero2.yaml launches DeepSpeed, which is not installed: pip "
                              "install 'curriculum-toolkit[deepspeed]' (or choose a config without DeepSpeed: single, "
                              "ddp, fsdp).")


WHEEL_SOURCES = ("toolkit", "train_curriculum.py", "accelerate_configs", "ds_configs", "pyproject.toml", "setup.py",
                 "MANIFEST.in", "README.md")


def test_an_installed_wheel_carries_the_entry_and_the_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wheel `pip install .` builds holds train_curriculum.py, accelerate_configs/ and ds_configs/ as they are
    in the clone, and `toolkit train` of the installed package (the wheel unpacked, no clone around it) launches
    them, from any folder."""
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info beside the sources
    src.mkdir()
    for name in WHEEL_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("curriculum_toolkit-*.whl")
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    installed = site / "toolkit" / "launch"
    assert not (site / "train_curriculum.py").exists()
    for shipped in [REPO / "train_curriculum.py", *(REPO / "accelerate_configs").glob("*.yaml"),
                    *(REPO / "ds_configs").glob("*.json")]:
        assert (installed / shipped.relative_to(REPO)).read_bytes() == shipped.read_bytes(), shipped
    for asset in (REPO / "toolkit" / "metrics" / "report_assets").iterdir():  # the report page's code, inlined
        assert (site / asset.relative_to(REPO)).read_bytes() == asset.read_bytes(), asset

    root = launch_root(site / "toolkit")
    assert root == installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert launch_line(None, "zero3", ["logging.trackers=[]"], [], root=root) == [
        "accelerate", "launch", "--config_file", str(installed / "accelerate_configs" / "zero3.yaml"),
        "--deepspeed_config_file", str(installed / "ds_configs" / "zero3.json"), str(installed / "train_curriculum.py"),
        "logging.trackers=[]"]
    assert launch_root() == REPO  # this package: the clone's own files
