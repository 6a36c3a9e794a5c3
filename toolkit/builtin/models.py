"""The built-in models: `builtin:NAME` values of model.name_or_path, built locally on first use."""

from __future__ import annotations

from pathlib import Path

from toolkit.atomic import build_dir, refuse_link
from toolkit.errors import ToolkitError

TINY_MODEL = "builtin:tiny-qwen3"
"""`model.name_or_path` value that builds the tiny random Qwen3 locally (tests, demo, laptops)."""
TINY_VL_MODEL = "builtin:tiny-qwen2.5-vl"
"""`model.name_or_path` value that builds the tiny random Qwen2.5-VL (and its processor) locally."""
TINY_QWEN3_VL_MODEL = "builtin:tiny-qwen3-vl"
"""The same for a tiny random Qwen3-VL."""


BUILTIN_BUILD = 3  # 3: the tiny Qwen3-VL's processor is Qwen3VLImageOnlyProcessor (video timestamps)
"""The version of what the built-in models' builders write, in their cache folder's name, so that a cache holding an
earlier build is never reused: bump it whenever toolkit/builtin/text_model.py or toolkit/builtin/vl_model.py change
their output (2: each carries its family's stock chat template, and the tokenizer Qwen's think and tool tokens)."""


def builtin_dir(name_or_path: str, cache_dir: Path) -> Path:
    """Where `materialize_builtin` builds the built-in model `name_or_path` (`builtin:NAME`) under `cache_dir`."""
    return cache_dir / f"{name_or_path.removeprefix('builtin:')}-build{BUILTIN_BUILD}"


def materialize_builtin(name_or_path: str, cache_dir: Path) -> str:
    """Turn `builtin:tiny-qwen3` / `builtin:tiny-qwen2.5-vl` / `builtin:tiny-qwen3-vl` into a real model directory
    (built once, then loaded like any checkpoint)."""
    builtins = (TINY_MODEL, TINY_VL_MODEL, TINY_QWEN3_VL_MODEL)
    if name_or_path.startswith("builtin:") and name_or_path not in builtins:
        raise ToolkitError(f"model.name_or_path '{name_or_path}' is not a built-in model; the built-in ones are "
                           f"{', '.join(builtins)}.")
    if name_or_path not in builtins:
        return name_or_path
    target = builtin_dir(name_or_path, cache_dir)
    refuse_link(target, "a built-in model")  # a shared cache: its predictable name never leads elsewhere
    refuse_link(target / "config.json", "a built-in model's config")
    if not (target / "config.json").is_file():
        # The test-model builders are imported only here, when a built-in model is first built: loading any model
        # (a built one included) never imports them.
        from toolkit.builtin.text_model import write_tiny_qwen3
        from toolkit.builtin.vl_model import write_tiny_qwen2_5_vl, write_tiny_qwen3_vl

        write = {TINY_MODEL: write_tiny_qwen3, TINY_VL_MODEL: write_tiny_qwen2_5_vl,
                 TINY_QWEN3_VL_MODEL: write_tiny_qwen3_vl}[name_or_path]
        # Built aside, then renamed in: processes on several nodes may share this directory; the first copy in
        # stays (the others are identical).
        build_dir(target, write, replace=False)
    return str(target)
