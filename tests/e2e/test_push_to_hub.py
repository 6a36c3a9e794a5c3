"""`toolkit export --push-to-hub` (toolkit/commands/export.py:push_to_hub) against a local stand-in for the Hub API
(tests/helpers/hub_server.py, HF_ENDPOINT pointed at it): nothing leaves the machine. The command runs as a user runs
it (a subprocess: huggingface_hub reads HF_ENDPOINT when it is imported) on the suite's finished run (`trained`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, run_env
from tests.helpers.hub_server import HubStandIn
from toolkit.commands.export import EXPORT_MARKER


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _push(hub: HubStandIn, *argv: str) -> subprocess.CompletedProcess:
    env = run_env() | {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_stand_in",
                       "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "toolkit.commands.cli", "export", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_push_uploads_final_as_it_is_or_the_merged_export(trained: Path, tmp_path: Path) -> None:
    """Without --merge the repo holds final/'s files byte for byte (adapter, tokenizer, checksums, the model card
    training wrote), created private with --private; with --merge it holds the merged export written to --out, all
    but its export marker."""
    run = trained / "run"
    with HubStandIn() as hub:
        proc = _push(hub, str(run), "--push-to-hub", "me/tiny-adapter", "--private")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == f"{hub.endpoint}/me/tiny-adapter/commit/{1:040d}"
        adapter = hub.repos["me/tiny-adapter"]
        assert adapter.private and adapter.files == _files(run / "final")
        assert {"adapter_model.safetensors", "README.md", "checksums.json"} <= set(adapter.files)
        assert hub.cards == [adapter.files["README.md"].decode()]  # its metadata block was checked first

        merged = tmp_path / "merged"
        proc = _push(hub, str(run), "--merge", "--out", str(merged), "--push-to-hub", "me/tiny-merged")
        assert proc.returncode == 0, proc.stderr[-3000:]
        exported = _files(merged)
        assert EXPORT_MARKER in exported and "model.safetensors" in exported
        del exported[EXPORT_MARKER]
        assert not hub.repos["me/tiny-merged"].private and hub.repos["me/tiny-merged"].files == exported
        assert hub.unknown == []


def test_a_damaged_final_is_refused_before_anything_is_sent(trained: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    weights = copy / "run" / "final" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with HubStandIn() as hub:
        proc = _push(hub, str(copy / "run"), "--push-to-hub", "me/tiny")
        assert proc.returncode == 2
        assert proc.stderr.startswith("error: ") and "does not hold what training saved" in proc.stderr
        assert hub.repos == {} and hub.unknown == []
