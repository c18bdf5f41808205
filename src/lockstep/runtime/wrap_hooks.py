"""Callbacks run when an engine has wrapped a model: how upper layers attach to both engines.

An engine calls `wrapped(model)` at the end of its constructor (and after
unpickling); a layer above the engines registers what should happen then with
`on_wrap`, so no engine imports that layer. `lockstep/observe/trace_hook.py` registers
the LOCKSTEP_TRACE tracer this way when `lockstep` is imported, and live
recovery (`lockstep.live`) attaches its part of each engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from lockstep.runtime.threads import model_wrapped

WrapCallback = Callable[[Any], None]
_callbacks: list[tuple[WrapCallback, bool]] = []


def on_wrap(callback: WrapCallback, copies: bool = True) -> None:
    """Run `callback(model)` whenever an engine has wrapped a model (idempotent); with
    `copies=False` not for a wrapper unpickled or deep-copied from another."""
    if all(known is not callback for known, _ in _callbacks):
        _callbacks.append((callback, copies))


def wrapped(model: Any, copy: bool = False) -> None:
    """Called by an engine once its model is ready to train (`copy`: made by unpickling).

    lockstep's process-wide threads (the stall inspector) end when the last model
    wrapped is collected (`runtime/threads.py`).
    """
    model_wrapped(model)
    for callback, copies in _callbacks:
        if copies or not copy:
            callback(model)


def weakly(method: Callable[..., Any]) -> Callable[..., None]:
    """`method` (bound to a wrapper), called only while the wrapper lives.

    What a hook on the model's parameters holds must not hold the wrapper: the model
    may outlive it (a LightningModule does), and a wrapper kept alive keeps its threads.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call
