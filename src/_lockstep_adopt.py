"""Adoption for every Python process of an environment: armed by `lockstep-engine.pth`.

A process that a framework starts itself (Lightning's relaunch of the other ranks,
`ddp_spawn`, `mp.spawn`, a launcher's workers) never runs `python -m lockstep.adopt`
nor imports lockstep, yet inherits LOCKSTEP_ENGINE. The `.pth` file installed with
lockstep runs one line at every interpreter start: when LOCKSTEP_ENGINE asks for an
engine other than torch's, it calls `arm()`, which waits for torch's import to end
and then installs lockstep's adoption (`lockstep.adopt`). Unset, the line reads one
variable and imports nothing; armed, a process that never imports torch pays nothing
more. This module sits outside the `lockstep` package because importing that
package imports torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TARGET = "torch"


class _ThenAdopt(importlib.abc.Loader):
    """torch's own loader, then lockstep's adoption once torch is whole."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader  # torch sees its own loader, as without lockstep
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        from lockstep.adopt import install_from_env

        install_from_env()


class _AwaitTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands torch's spec back with `_ThenAdopt` as its loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # once: the next finders say where torch is
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenAdopt(spec.loader)
                return spec
        return None


def arm() -> None:
    """Install lockstep's adoption when torch has been imported (now, if it is already)."""
    if TARGET in sys.modules:
        from lockstep.adopt import install_from_env

        install_from_env()
    elif not any(isinstance(f, _AwaitTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AwaitTorch())
