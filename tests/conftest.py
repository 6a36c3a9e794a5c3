"""Shared helpers: launching real training runs (accelerate launch, gloo on CPU) in subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 600  # a hung collective fails the test instead of stalling CI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    return env


def launch_cmd(strategy: str, num_processes: int, *, mixed_precision: str = "no",
               extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "accelerate_configs" / f"{strategy}.yaml"),
            "--num_processes", str(num_processes), "--mixed_precision", mixed_precision,
            "--main_process_port", str(free_port()), *(extra or [])]


def train(strategy: str, num_processes: int, out: Path, *overrides: str, recipe: str = "recipes/smoke.yaml",
          mixed_precision: str = "no", dummy_samples: int = 64, check: bool = True) -> subprocess.CompletedProcess:
    """Run train_curriculum.py under `accelerate launch` from the repository root; return the finished process."""
    cmd = [*launch_cmd(strategy, num_processes, mixed_precision=mixed_precision),
           str(REPO / "train_curriculum.py"), "--config", recipe, "--create_dummy_data",
           "--num_dummy_samples", str(dummy_samples), f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    if check and proc.returncode != 0:
        pytest.fail(f"{strategy} x{num_processes} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return proc
