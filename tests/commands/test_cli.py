"""toolkit/commands/cli.py in-process: `tiny-model --out` and `dummy-data --out` follow export's rule (issue 39)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.commands.cli import build_parser
from toolkit.errors import ToolkitError


def _run(*argv: str) -> None:
    args = build_parser().parse_args(list(argv))
    args.func(args)


@pytest.mark.parametrize(("command", "users_file"), [("dummy-data", "stage1.jsonl"), ("tiny-model", "config.json")])
def test_out_is_new_empty_or_an_earlier_output_else_overwrite(tmp_path: Path, command: str, users_file: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A folder of the user's (holding a file of the very name the command writes) is refused in one line naming
    what is there; an earlier output of the same command is replaced; --overwrite replaces the user's folder."""
    small = ["--num-samples", "2"] if command == "dummy-data" else ["--layers", "1", "--hidden", "16"]
    users = tmp_path / "users"
    users.mkdir()
    (users / users_file).write_text("the user's own\n")
    with pytest.raises(ToolkitError, match=f"not an earlier {command} output") as err:
        _run(command, "--out", str(users), *small)
    assert f"(it holds {users_file})" in str(err.value) and "--overwrite" in str(err.value)
    assert (users / users_file).read_text() == "the user's own\n"

    ours = tmp_path / "ours"
    _run(command, "--out", str(ours), *small)
    first = sorted(p.name for p in ours.iterdir())
    _run(command, "--out", str(ours), *small)  # an earlier output of its own: replaced
    assert sorted(p.name for p in ours.iterdir()) == first and users_file in first

    _run(command, "--out", str(users), "--overwrite", *small)
    assert (users / users_file).read_text() != "the user's own\n"
    capsys.readouterr()
