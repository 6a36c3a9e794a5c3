"""Tests for toolkit/commands/cli.py: the commands that read a recipe resolve built-in model names (`builtin:...`) as
training does, from any working directory (export's own case is in tests/e2e/test_nothing_lost.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import CHAT, REPO, as_in_a_terminal, base_recipe, write_jsonl
from tests.helpers.inprocess import Call, invoke
from toolkit.builtin.models import TINY_MODEL, TINY_QWEN3_VL_MODEL


def _recipe(folder: Path, model: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "data.jsonl", [CHAT] * 4)
    recipe = base_recipe(model, str(folder / "data.jsonl")) | {"output_dir": str(folder / "runs" / "r")}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


@pytest.mark.parametrize("model", [TINY_MODEL, TINY_QWEN3_VL_MODEL])
def test_preflight_and_inspect_data_resolve_builtin_models_from_any_folder(
        model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    recipe = _recipe(tmp_path / "recipes", model)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # a shipped config by name, as toolkit train takes it; its DeepSpeed JSON is found beside it from any folder
    preflight = ["preflight", "--config", str(recipe), "--accelerate-config", "zero3"]
    rc, stderr = invoke(Call(preflight, tmp_path, tool="toolkit"), elsewhere, monkeypatch)
    assert rc == 0, stderr[-3000:]
    shown = capsys.readouterr().out
    assert f"model {model}:" in shown and "recommended:" in shown
    assert f"selected by {REPO / 'accelerate_configs' / 'zero3.yaml'}: zero3" in shown
    if model == TINY_MODEL:  # the data scan tokenises with the built-in model's tokenizer
        assert "only: 4 rows" in shown
        rc, stderr = invoke(Call(["inspect-data", "--config", str(recipe), "--rows", "1"], tmp_path, tool="toolkit"),
                            elsewhere, monkeypatch)
        assert rc == 0, stderr[-3000:]
        # Qwen3's template (the built-in model's): the last answer trains with an empty think block.
        assert "[[<think>\n\n</think>\n\n4.<|im_end|>]]" in capsys.readouterr().out
    assert sorted(p.name for p in elsewhere.iterdir()) == []  # nothing written where the command ran


@pytest.mark.parametrize(("sig", "code", "line"), [("SIGINT", 130, "interrupted (Ctrl-C)"),
                                                  ("SIGTERM", 75, "stopped by SIGTERM")])
def test_a_stop_during_inspect_data_is_one_line_and_keeps_nothing_half_written(tmp_path: Path, sig: str, code: int,
                                                                               line: str) -> None:
    """Ctrl-C or SIGTERM while inspect-data tokenises a store: one line and its exit code (Ctrl-C was a
    KeyboardInterrupt traceback, SIGTERM a silent death that left the half-prepared store for the next launch to
    clear), and no half-prepared store is left in the cache (stores are built aside and renamed in)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import run_env

    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}? " * 8},
                          {"role": "assistant", "content": f"{2 * i}."}]} for i in range(40000)]
    (tmp_path / "big.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = base_recipe(TINY_MODEL, str(tmp_path / "big.jsonl")) | {"output_dir": str(tmp_path / "run")}
    recipe["data"] = {**recipe.get("data", {}), "num_proc": 1}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.commands.cli", "inspect-data", "--config",
                             str(tmp_path / "recipe.yaml")], cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_in_a_terminal)
    stores = tmp_path / ".toolkit-cache" / "tokenized" / "stores"
    deadline = time.monotonic() + 120
    while not (stores.is_dir() and any(p.name.endswith(".tmp") for p in stores.iterdir())):  # tokenising now
        assert proc.poll() is None and time.monotonic() < deadline, "inspect-data never began tokenising"
        time.sleep(0.1)
    proc.send_signal(getattr(signal, sig))
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith(line)
    assert [p.name for p in stores.iterdir() if not p.name.endswith(".lock")] == []


def test_python_dash_m_toolkit_is_the_toolkit_command() -> None:
    """`python -m toolkit` runs the command where its console script is not on PATH (a worktree, a bare venv)."""
    import subprocess
    import sys

    from tests.conftest import run_env

    proc = subprocess.run([sys.executable, "-m", "toolkit", "--help"], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "{train,dummy-data,tiny-model,export,preflight,inspect-data,score,plot,report}" in proc.stdout
