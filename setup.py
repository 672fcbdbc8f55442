"""Build step that pyproject.toml cannot express: the kernel sources (csrc/) and the C header
(include/) sit at the repository root, shared with CMake, but the wheel must carry them inside
the package (ubnext/_data/), because ubnext compiles its kernels from them at run time."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSources(build_py):
    def run(self):
        super().run()
        for name in ("csrc", "include"):
            target = Path(self.build_lib) / "ubnext" / "_data" / name
            # build/lib outlives a build: without this, a source deleted since the last build
            # would still ship (and the kernel globs would compile it)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(ROOT / name, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so"))


setup(cmdclass={"build_py": BuildPyWithSources})
