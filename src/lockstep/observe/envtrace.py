"""Trace any run with one variable: LOCKSTEP_TRACE=DIR, and no change to the script.

`attach_trace_from_env(model)` is the last line of the engine's constructor. With
LOCKSTEP_TRACE unset it returns None at once, and the engine does no tracing work.
With it set, it adds an `EnvTracer` as a step observer: at the end of every
synchronised step the engine hands it the `StepStats` it stamped anyway (no new
clock reads), and the tracer keeps them in a `TraceRecorder`. A background thread
writes DIR/trace_rank<R>.json every few seconds when new steps came in, and once
more at exit, so a killed run leaves a readable trace up to its last write.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.env import read_trace_dir, read_trace_flush_s
from lockstep.observe.trace import TraceRecorder, rank_file
from lockstep.runtime import threads
from lockstep.runtime.step_stats import StepStats

DEFAULT_STEPS = 100

# One trace file per process and directory: a second wrapper in the same process
# takes the file over from the first (which writes its last steps and stops).
_active: dict[Path, EnvTracer] = {}


def attach_trace_from_env(model: Any) -> EnvTracer | None:
    """Start tracing `model` when LOCKSTEP_TRACE names a directory; otherwise do nothing.

    Called by `lockstep.DistributedDataParallel` (and any engine with the same
    `add_step_observer(callable)` method) at the end of its constructor.

    Args:
        model: the data-parallel wrapper; it calls the tracer after every synchronised step.

    Returns:
        The tracer, or None when LOCKSTEP_TRACE is unset or empty.

    Raises:
        EnvironmentConfigError: LOCKSTEP_TRACE_FLUSH_S is not a positive number.
        TypeError: `model` has no `add_step_observer`.
    """
    directory = read_trace_dir()
    if directory is None:
        return None
    if not callable(getattr(model, "add_step_observer", None)):
        raise TypeError(
            f"LOCKSTEP_TRACE traces a lockstep engine (it needs add_step_observer); found "
            f"{type(model).__name__}. Wrap the model with lockstep.DistributedDataParallel."
        )
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    world_size = dist.get_world_size() if initialized else 1
    tracer = EnvTracer(directory, rank, world_size, read_trace_flush_s())
    model.add_step_observer(tracer)
    threads.stops_with_group(tracer)  # its writer thread ends with the groups
    weakref.finalize(model, tracer.close)  # and the tracer with the model
    return tracer


def flush_traces() -> None:
    """Write every LOCKSTEP_TRACE file of this process now (before an exit that skips atexit)."""
    for tracer in list(_active.values()):
        try:
            tracer.flush()
        except OSError as error:
            warnings.warn(f"LOCKSTEP_TRACE: cannot write the trace: {error}", stacklevel=2)


class EnvTracer:
    """A step observer that records every synchronised step and writes it in the background.

    Args:
        directory: where `trace_rank{rank}.json` goes.
        rank: the process's global rank (the file's name and the trace's process id).
        world_size: ranks in the job.
        flush_s: seconds between background writes (only when new steps came in).
        max_steps: how many of the last steps the file keeps.
    """

    def __init__(
        self,
        directory: str | Path,
        rank: int,
        world_size: int,
        flush_s: float,
        max_steps: int = DEFAULT_STEPS,
    ) -> None:
        self.directory = Path(directory).resolve()
        self.recorder = TraceRecorder(self.directory, rank, world_size, max_steps)
        self.flush_s = flush_s
        self._feeding = True  # False once a Monitor records into the trace instead
        self._last_end: float | None = None
        self._written = 0
        self._pid = os.getpid()
        self._take_over_file()
        self._thread = threads.LockstepThread("lockstep-trace", self._loop)
        self._thread.start()
        atexit.register(self._at_exit)

    def _take_over_file(self) -> None:
        path = rank_file(self.directory, self.recorder.rank)
        previous = _active.get(path)
        if previous is not None:
            warnings.warn(
                f"LOCKSTEP_TRACE: a second data-parallel model in this process now writes "
                f"{path}; the first one's trace stops here (one trace file per process).",
                stacklevel=5,  # the line that wrapped the second model
            )
            previous.close()
        _active[path] = self

    def __call__(self, stats: StepStats) -> None:
        """Record one synchronised step: the step runs from the previous step's end to its own.

        The gap before the forward (optimizer, zero_grad, data loading) becomes the
        step's `data` slice. The step's end is the engine's own stamp: forward start
        plus forward, backward and the wait for the last collective.
        """
        if not self._feeding:
            return
        end = stats.start + stats.forward_seconds + stats.backward_seconds + stats.exposed_seconds
        begin = stats.start if self._last_end is None else self._last_end
        self.recorder.record_step(stats.step, stats, begin, end)
        self._last_end = end
        if not self._thread.is_alive():  # stopped with a destroyed group (live recovery)
            self._thread = threads.LockstepThread("lockstep-trace", self._loop)
            self._thread.start()

    def hand_over(self, rank: int, max_steps: int) -> TraceRecorder:
        """Give the trace file to a `Monitor`: it records from now on; writes go on as before.

        The Monitor knows more (the optimizer's own time, its step numbers), so the
        engine's steps stop going in; the background writes and the write at exit stay.
        """
        self._feeding = False
        self.recorder = TraceRecorder(self.directory, rank, self.recorder.world_size, max_steps)
        self._written = 0
        return self.recorder

    def flush(self) -> None:
        """Write the file now if steps came in since the last write (this process only)."""
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker) writes nothing
            return
        recorded = self.recorder.recorded
        if recorded == self._written:
            return
        self.recorder.write()
        self._written = recorded

    def _loop(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.flush_s):
            try:
                self.flush()
            except OSError as error:  # a full disk must not end the training run
                warnings.warn(f"LOCKSTEP_TRACE: cannot write the trace: {error}", stacklevel=1)

    def close(self, write: bool = True) -> None:
        """Stop the background writes; write the last steps first unless `write` is False."""
        self._feeding = False
        self._thread.stop()
        if write:
            self.flush()
        atexit.unregister(self._at_exit)
        path = rank_file(self.directory, self.recorder.rank)
        if _active.get(path) is self:
            del _active[path]

    def stop(self) -> None:
        """End the writer thread with the steps so far written (a process group was
        destroyed); the next step starts it again. `close()` ends the tracer."""
        self._thread.stop()
        self.flush()

    def _at_exit(self) -> None:
        if os.getpid() == self._pid:
            self.close()
