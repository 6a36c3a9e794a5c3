"""toolkit/runtime/exit_lines.py: a rank's log is never written through a link planted in the shared cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.runtime.exit_lines import LastWords
from toolkit.runtime.run_dir import RunLayout


def test_a_rank_log_link_planted_in_the_shared_cache_is_not_written_through(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run stopped before its outputs keeps its rank log in the cache beside the output dir, at a predictable
    name: a link there must not make the traceback land in the user's file (issue 39); it goes to stderr."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    words = LastWords()
    words.layout = RunLayout(tmp_path / "runs" / "exp")
    log = words.layout.rank_log(words.rank, outputs_written=False)
    log.parent.mkdir(parents=True)
    log.symlink_to(victim)
    try:
        raise RuntimeError("the failure")
    except RuntimeError as e:
        assert words._write_traceback(e) is None
    assert victim.read_text() == "the user's own file\n"
    err = capsys.readouterr().err
    assert f"{log} is a symbolic link" in err and "RuntimeError: the failure" in err
