"""toolkit/builtin/models.py: built-in model names and their folders in the shared cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.builtin.models import TINY_MODEL, builtin_dir, materialize_builtin
from toolkit.errors import ToolkitError


def test_a_link_planted_at_a_builtin_models_name_is_refused(tmp_path: Path) -> None:
    """The cache beside an output dir is shared: a link at the built-in model's predictable name would make every
    launch load (or build into) a folder of somebody else's choosing (issue 39)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    target = builtin_dir(TINY_MODEL, tmp_path / "cache")
    target.parent.mkdir(parents=True)
    target.symlink_to(elsewhere)
    with pytest.raises(ToolkitError, match="is a symbolic link") as e:
        materialize_builtin(TINY_MODEL, tmp_path / "cache")
    assert str(target) in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["config.json"]
