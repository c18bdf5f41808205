"""Adoption: torch's `DistributedDataParallel(...)` builds lockstep's engine in this process.

    LOCKSTEP_ENGINE=lockstep                 read in every process (lockstep-engine.pth)
    lockstep run --nproc-per-node 2 --engine lockstep train.py
    torchrun --nproc-per-node 2 -m lockstep.adopt train.py      # also: accelerate launch -m
    python -m lockstep.adopt train.py

`install()` gives torch's class a `__new__` that returns a `TorchFacedDDP`
(`adopt/torch_face.py`), a subclass of torch's class, so a framework that
imported torch's name long before still gets lockstep's engine, and its
`isinstance` checks hold. `uninstall()` turns it off. Nothing of torch is touched
unless one of the lines above asks for it. The variable reaches processes that never
import lockstep (a framework's relaunched ranks, `mp.spawn`) through the `.pth` file
installed with the package (`src/_lockstep_adopt.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from lockstep.env import read_variable

ENGINE_VARIABLE = "LOCKSTEP_ENGINE"
ENGINES = ("torch", "lockstep", "sharded")


_active = False  # read by _redirected_new on every construction of torch's class


def _redirected_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """torch's class itself becomes lockstep's engine; a user's subclass keeps torch's."""
    if _active and cls is TorchDDP:
        from lockstep.adopt.torch_face import TorchFacedDDP

        cls = TorchFacedDDP
    return object.__new__(cls)


def installed() -> bool:
    """Whether torch's constructor builds lockstep's engine in this process."""
    return _active


def install() -> None:
    """Make `torch.nn.parallel.DistributedDataParallel(...)` build lockstep's engine."""
    global _active
    if TorchDDP.__dict__.get("__new__") is not _redirected_new:
        TorchDDP.__new__ = _redirected_new  # type: ignore[method-assign]
    _active = True


def uninstall() -> None:
    """Give torch's constructor back its own engine.

    The `__new__` stays (CPython cannot delete an assigned `__new__` cleanly); with
    the switch off it builds torch's class, as `object.__new__` does.
    """
    global _active
    _active = False


@contextmanager
def adopted() -> Iterator[None]:
    """Adoption inside the block only (what `lockstep.adopt.accelerate.Accelerator` uses)."""
    was = installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def engine_from_env(environ: Mapping[str, str] | None = None) -> str:
    """LOCKSTEP_ENGINE's value, checked: "torch" (also when unset) or "lockstep".

    Raises:
        NotImplementedError: "sharded" (not yet under a framework's DDP constructor).
        ValueError: any other value.
    """
    value = (read_variable(ENGINE_VARIABLE, environ) or "").strip().lower() or "torch"
    if value == "sharded":
        raise NotImplementedError(
            f"{ENGINE_VARIABLE}=sharded is not supported yet: torch's DistributedDataParallel "
            "keeps whole optimizer states, which the sharded engine splits. Expected "
            f"{ENGINE_VARIABLE}=lockstep (or unset); use lockstep.ShardedDataParallel in code."
        )
    if value not in ENGINES:
        raise ValueError(
            f"{ENGINE_VARIABLE} must be one of 'torch', 'lockstep'; found {value!r} "
            f"(rank {read_variable('RANK', environ) or '?'}). Unset it to keep torch's engine."
        )
    return value


def install_from_env() -> bool:
    """Install when LOCKSTEP_ENGINE=lockstep; returns whether it did."""
    if engine_from_env() == "lockstep":
        install()
        return True
    return False
