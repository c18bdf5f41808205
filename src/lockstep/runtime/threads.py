"""The threads lockstep starts, and when each one ends: with its group, its owner, or the process.

Lockstep runs a few threads of its own: the stall inspector (`runtime/waits.py`), one
worker per collective that runs in Python (`runtime/transport.py`, PowerSGD, the
sharded engine's reduce-scatter) and the LOCKSTEP_TRACE writer. None outlives what
it serves. Each stops when a process group is destroyed (`lockstep.teardown` says
when), when its owner (a transport, a hook's state, a wrapped model) is collected,
and at exit; the stall inspector also when no wrapped model is left. A stopped
worker starts again at its next task. Every thread is a daemon with a `stop()`
method, which test suites that police leaked threads (Lightning's) call.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, Protocol

from lockstep import teardown

STOP_TIMEOUT_S = 2.0


class Stoppable(Protocol):
    def stop(self) -> None: ...


class LockstepThread(threading.Thread):
    """A daemon thread running `loop(stopping)`; `stop()` sets `stopping` and joins it."""

    def __init__(self, name: str, loop: Callable[[threading.Event], None]) -> None:
        super().__init__(name=name, daemon=True)
        self.stopping = threading.Event()
        self._loop = loop

    def run(self) -> None:
        self._loop(self.stopping)

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(STOP_TIMEOUT_S)


def _serve(tasks: queue.SimpleQueue, stopping: threading.Event) -> None:
    """A worker's loop: run each (future, fn, args) in order until told to stop."""
    while not stopping.is_set():
        item = tasks.get()
        if item is not None:  # None: stop()'s wake-up call
            _run(*item)
        del item  # holds no task (nor its owner) while it waits for the next


def _run(future: Future, fn: Callable[..., Any], args: tuple) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # handed to whoever waits on the future
            future.set_exception(error)


def _stop_thread(box: list[LockstepThread | None], tasks: queue.SimpleQueue) -> None:
    thread, box[0] = box[0], None
    if thread is not None:
        thread.stopping.set()
        tasks.put(None)
        thread.stop()


class Worker:
    """One thread that runs the callables given to it, in order (a thread pool of one).

    Started at the first `submit`; stopped with its group, its `owner`, or when the
    worker itself is collected; started again by the next `submit`.
    """

    def __init__(self, name: str, owner: object | None = None) -> None:
        self.name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._box: list[LockstepThread | None] = [None]  # the thread, shared with finalizers
        self._lock = threading.Lock()
        self.stop = partial(_stop_thread, self._box, self._tasks)  # holds no ref to self
        weakref.finalize(self, self.stop)
        stops_with_group(self, owner)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the worker's thread, after what was submitted before."""
        with self._lock:
            thread = self._box[0]
            if thread is None or not thread.is_alive():
                thread = self._box[0] = LockstepThread(self.name, partial(_serve, self._tasks))
                thread.start()
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future


_with_groups: weakref.WeakSet = weakref.WeakSet()  # stopped when a group is destroyed
_with_models: weakref.WeakSet = weakref.WeakSet()  # also stopped when no wrapped model is left
_wrapped_models = [0]


def stops_with_group(thing: Stoppable, owner: object | None = None) -> None:
    """Stop `thing` when a process group is destroyed, and when `owner` is collected."""
    _with_groups.add(thing)
    if owner is not None:
        weakref.finalize(owner, thing.stop)


def serves_wrapped_models(thing: Stoppable) -> None:
    """Stop `thing` when a group is destroyed or the last wrapped model is collected."""
    _with_groups.add(thing)
    _with_models.add(thing)


def model_wrapped(model: object) -> None:
    """Count `model` (an engine's wrapper) until it is collected."""
    _wrapped_models[0] += 1
    weakref.finalize(model, _model_collected)


def _model_collected() -> None:
    _wrapped_models[0] -= 1
    if _wrapped_models[0] == 0:
        for thing in list(_with_models):
            thing.stop()


def _group_destroyed() -> None:
    for thing in list(_with_groups):
        thing.stop()


teardown.on_destroyed(_group_destroyed)
