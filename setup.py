"""The wheel's build step beyond pyproject.toml: train_curriculum.py, accelerate_configs/ and ds_configs/ are copied
into the package as toolkit/launch/, so `toolkit train` (toolkit/commands/train.py) finds the entry and the shipped
configs in an installed package. A clone (or an editable install) uses the repository's own files; the copies
exist only in the wheel. MANIFEST.in carries the same files into an sdist, which the wheel may be built from."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

LAUNCH_FILES = ("train_curriculum.py", "accelerate_configs", "ds_configs")


class BuildWithLaunchFiles(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the package is the clone's: toolkit train uses the files where they are
            return
        target = Path(self.build_lib) / "toolkit" / "launch"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for name in LAUNCH_FILES:
            source = Path(__file__).resolve().parent / name
            if source.is_dir():
                shutil.copytree(source, target / name)
            else:
                shutil.copy2(source, target / name)


setup(cmdclass={"build_py": BuildWithLaunchFiles})
