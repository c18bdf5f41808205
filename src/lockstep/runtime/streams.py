"""CUDA streams at the end of backward: where the engines' end-of-step work runs, and why.

Each engine queues one callback on autograd's engine per synchronised backward
(the reducer's finalize, the sharded engine's end of backward, static graph's
flush, the delayed all-reduce's wait); `at_backward_end` is the one place that
queues them. Autograd runs queued callbacks under the streams that were current
when the caller entered `backward()`, after making those streams wait on every
stream a gradient was accumulated on (torch's `GraphTask::exec_post_processing`,
Note [Streaming backwards]). So a callback reads every `.grad` safely and what it
writes is ordered before whatever the caller does next on its own stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback` once when autograd has no work left in the current backward.

    No stream of its own is captured: autograd already runs it on the caller's
    streams, synchronised with the gradients' streams. Capturing the stream current
    in a gradient hook (as torch's reducer did before autograd gave this promise)
    would run it on the stream of the last gradient instead, which the caller's
    stream has not waited on after the callback's own work.

    Args:
        callback: called without arguments on autograd's thread; it may queue more.

    Raises:
        RuntimeError: outside a backward (autograd's own error).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream current on `device` for this thread, or None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)
