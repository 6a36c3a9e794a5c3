"""`toolkit export --push-to-hub` (toolkit/commands/export.py:push_to_hub) against a local stand-in for the Hub API
(tests/helpers/hub_server.py, HF_ENDPOINT pointed at it): nothing leaves the machine. The command runs as a user runs
it (a subprocess: huggingface_hub reads HF_ENDPOINT when it is imported) on the suite's finished run (`trained`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_push_publishes_only_what_final_records_never_through_a_link(trained: Path, tmp_path: Path) -> None:
    """Issue 48's first case, as a user runs it: a link in final/ (here to a stand-in for a private key outside the
    run) is refused in one line naming it, and nothing reaches the Hub. (What an accepted push holds, byte for byte:
    the test above; what it would hold with --push-extra: the in-process test below.)"""
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    final = copy / "run" / "final"
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n")
    (final / "notes.txt").symlink_to(secret)
    with HubStandIn() as hub:
        proc = _push(hub, str(copy / "run"), "--push-to-hub", "me/tiny")
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
        assert "notes.txt is a link" in proc.stderr and "not-a-real-key" not in proc.stderr + proc.stdout
        assert hub.repos == {} and hub.unknown == []


def test_a_link_other_bytes_or_a_stray_file_in_final_is_refused(trained: Path, tmp_path: Path) -> None:
    """A file checksums.json records, replaced by a link to identical bytes, is still a link: refused, naming it;
    replaced by other bytes of the same size, it fails its sha256 as the uploader hashes it. A stray file (.env,
    README.md~) is refused unless --push-extra names it, and what is published with it is exactly what
    checksums.json records, the checksums and the card, plus that file. In-process, through the function the CLI
    calls: the refusals come before any request (no stand-in is needed, and none could be reached)."""
    from toolkit.commands.export import _recorded, publishable_files, push_to_hub
    from toolkit.errors import ToolkitError

    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    final = copy / "run" / "final"
    config = final / "adapter_config.json"
    outside = tmp_path / "adapter_config.json"
    outside.write_bytes(config.read_bytes())
    config.unlink()
    config.symlink_to(outside)
    with pytest.raises(ToolkitError, match=r"adapter_config.json is a link"):
        push_to_hub(copy / "run", "me/tiny")
    config.unlink()
    data = outside.read_bytes()
    config.write_bytes(data[:-2] + (b"  " if data[-2:] != b"  " else b"\n\n"))
    with pytest.raises(ToolkitError, match=r"adapter_config.json is not the file recorded"):
        push_to_hub(copy / "run", "me/tiny")
    config.write_bytes(data)
    (final / ".env").write_text("HF_TOKEN=hf_secret\n")
    with pytest.raises(ToolkitError, match=r"\.env is not a file training saved.*--push-extra \.env"):
        push_to_hub(copy / "run", "me/tiny", extra=["notes.md"])
    (final / ".env").unlink()
    with pytest.raises(ToolkitError, match=r"notes.md is missing: it was named by --push-extra"):
        push_to_hub(copy / "run", "me/tiny", extra=["notes.md"])
    (final / "README.md~").write_text("draft\n")
    with pytest.raises(ToolkitError, match=r"README.md~ is not a file training saved"):
        push_to_hub(copy / "run", "me/tiny")
    with pytest.raises(ToolkitError, match=r"--push-extra '../x'"):
        push_to_hub(copy / "run", "me/tiny", extra=["../x"])
    (final / "README.md~").unlink()
    (final / "extra.md").write_text("notes the user chose to publish\n")
    recorded = _recorded(final)
    assert publishable_files(final, recorded=recorded, extra=["extra.md"]) == sorted(
        {*recorded, "checksums.json", "README.md", "extra.md"}) == sorted(_files(final))
