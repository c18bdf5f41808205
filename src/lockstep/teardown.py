"""Process groups end at a known point at exit: after the script, with the GIL released.

A gloo group's destructor joins its worker threads, and a worker thread finishing a
collective may need the GIL (its work holds Python objects). Freed by torch's C++
Reducer when a `DistributedDataParallel` dies, the group is destroyed with the GIL
held: the two threads wait for each other for ever. Freed during interpreter shutdown,
the worker thread is killed where it waits, and the process aborts. So every group
is pinned here when torch makes it, and released by `release()` once the script ended,
unless it was `abandon`ed: a group that may hold work that never ends (the group a live
recovery replaced) goes with the process instead. The same table tells when a group is
destroyed: `on_destroyed` callbacks run then (lockstep's threads end with the groups
they serve: `runtime/threads.py`).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Imported before any group exists, on purpose. This module declares
# `group=group.WORLD` default arguments, evaluated at its first import; torch._dynamo
# imports it, and every optimizer imports torch._dynamo. Imported after the group
# exists, those defaults would hold the group until interpreter shutdown.
import torch.distributed.nn.functional  # noqa: F401

SETTLE_S = 0.05  # GIL released this long before the groups go: worker threads finish
_pins: list[Any] = []
_abandoned: list[Any] = []  # never freed (`abandon`)
_lock = threading.Lock()
_on_destroyed: list[Callable[[], None]] = []


def on_destroyed(callback: Callable[[], None]) -> None:
    """Run `callback()` whenever torch destroys a process group (idempotent)."""
    if callback not in _on_destroyed:
        _on_destroyed.append(callback)


def _destroyed() -> None:
    for callback in list(_on_destroyed):
        callback()


class _PinningMap(dict):
    """torch's table of live groups; each group that enters it is also kept in `_pins`,
    and each that leaves it (`destroy_process_group`) is announced to `on_destroyed`."""

    def __setitem__(self, group: Any, value: Any) -> None:
        with _lock:
            _pins.append(group)
        super().__setitem__(group, value)

    def __delitem__(self, group: Any) -> None:
        super().__delitem__(group)
        _destroyed()

    def clear(self) -> None:
        had_groups = bool(self)
        super().clear()
        if had_groups:
            _destroyed()


def install() -> None:
    """Pin every process group made from now on (and any alive now); release them at exit.

    Idempotent. `release` runs from an atexit handler registered here, that is after
    the handlers a script registers later (atexit runs last-in, first-out).
    """
    if not dist.is_available() or isinstance(c10d._world.pg_map, _PinningMap):
        return
    current = c10d._world.pg_map
    pinning = _PinningMap()
    for group, value in current.items():
        pinning[group] = value
    c10d._pg_map = pinning
    if c10d._world.pg_map is not pinning:  # torch keeps its table elsewhere: do nothing
        c10d._pg_map = current
        return
    atexit.register(_release_at_exit)


def abandon(group: Any) -> None:
    """Never destroy `group`: it goes with the process, its threads and sockets with it.

    For a group torch no longer uses that may hold work which never ends: the default
    group a live recovery replaced, whose collectives each survivor left where it met
    the loss. Two survivors can each have one waiting on the other (a collective one of
    them left before the other reached it), and gloo's destructor waits for its work:
    destroyed at exit, each waited for the other until the launcher's exit watch ended
    both. Its Python handle gets a reference that nothing drops, so not even the
    interpreter's shutdown frees it. Its threads are C++ threads that never take the GIL.
    """
    with _lock:
        _pins[:] = [pin for pin in _pins if pin is not group]
        _abandoned.append(group)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def pinned() -> int:
    """How many groups are pinned (made and not yet released)."""
    return len(_pins)


def release() -> None:
    """Destroy the groups left open, then let the last reference to each go, GIL released.

    Call once the script's own objects are gone (its models, and torch's Reducers with
    them): a garbage collection first frees those held in reference cycles. Each group's
    destructor then runs from its Python handle, which torch frees with the GIL released,
    so its worker threads can finish and be joined.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    time.sleep(SETTLE_S)  # a worker thread retiring its last work takes the GIL
    with _lock:
        groups = list(_pins)
        _pins.clear()
    while groups:
        groups.pop()


def _release_at_exit() -> None:
    """`release` at interpreter exit, unless the script died of an uncaught exception.

    Then a collective may still be in flight and a group's destructor could wait on it;
    the groups stay as they are, as without lockstep.
    """
    if not hasattr(sys, "last_value"):
        release()
