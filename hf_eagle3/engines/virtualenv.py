"""An engine's own virtualenv under the user cache: built by `make engines` from the package registry, and its python
refused (`EngineNotBuilt`) where it is missing."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..utils.cache import cache_dir
from .process import EngineNotBuilt


@dataclass(frozen=True)
class Virtualenv:
    """`engine`'s virtualenv, `name` under the user cache's `engines/`: each of `installs` in turn (`pip install`),
    then `unneeded` uninstalled (the registry's torchvision and kin, which the engines pull and fail with: built
    against another torch than the CPU one, their operators fail to register, and transformers imports torchvision
    whenever it is installed; text models need none of them)."""

    engine: str
    name: str
    installs: list[list[str]]
    unneeded: list[str]

    @property
    def folder(self) -> Path:
        return cache_dir() / "engines" / self.name

    def build(self) -> None:
        """The virtualenv, made on first use."""
        python = self.folder / "bin" / "python"
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(self.folder)], check=True)
            for requirements in self.installs:
                subprocess.run([python, "-m", "pip", "install", "--quiet", *requirements], check=True)
            subprocess.run([python, "-m", "pip", "uninstall", "--yes", "--quiet", *self.unneeded], check=True)

    def python(self) -> Path:
        """The virtualenv's python; `EngineNotBuilt` where it is missing."""
        path = self.folder / "bin" / "python"
        if not path.exists():
            raise EngineNotBuilt(self.engine, path)
        return path
