"""The collective a complete bucket runs, as a small strategy object.

The backward driver knows when a bucket is complete; the strategy decides what happens
to it then, and whether the engine averages the gradients on their way into the
bucket (`averaging(dtype)`: the 1/N rule, decided here once) or leaves them
unscaled for the strategy to average itself, as torch's communication hooks do.

| strategy | averaging | launch | inline |
|---|---|---|---|
| `AllReduceMean` | by the engine: scaled while copied, or per bucket | SUM all-reduce | native |
| `CommHookCollective` | by the hook | `hook(state, GradBucket) -> Future` | no |

"Inline" (`issues_inline`): `launch` issues every collective of the bucket before it returns,
on the calling thread. Only then may the driver issue the step fingerprint right
after the last bucket; otherwise (a hook chaining collectives in callbacks, an
algorithm on the communication thread) the ranks could issue them in different
orders, so the fingerprint waits for the buckets.

The sharded engine adds a reduce-scatter (`sharded/reduce_scatter.py`) beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lockstep.runtime.averaging import Averaging
from lockstep.runtime.bucket import Bucket, GradBucket
from lockstep.runtime.handles import CollectiveHandle, HookHandle
from lockstep.runtime.transport import Transport

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class BucketCollective(Protocol):
    """What the backward driver asks of a bucket's collective."""

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        """How the engine scales gradients of `dtype` into a bucket; None: it does not."""
        ...

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        """Start the collective of a complete bucket."""
        ...

    def sent_bytes(self) -> int | None:
        """Bytes handed to collectives since the last call, if not the buffers themselves."""
        ...

    def issues_inline(self) -> bool:
        """Whether `launch` issues all of a bucket's collectives before returning (this thread)."""
        ...


class AllReduceMean:
    """The default: gradients averaged by the engine, then one SUM all-reduce per bucket."""

    def __init__(self, transport: Transport, world_size: int, batched: bool = False) -> None:
        self.transport = transport
        self.world_size = world_size
        self.batched = batched  # torch's batched_grad_copy: plain copies, one division

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        if self.world_size == 1:
            return None
        return Averaging.for_dtype(self.world_size, dtype, self.batched)

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        bucket.divide_found_in_place()
        return self.transport.all_reduce(bucket.buffer)

    def sent_bytes(self) -> int | None:
        return None

    def issues_inline(self) -> bool:
        return self.transport.inline


class CommHookCollective:
    """A communication hook with torch's contract: it averages, the engine does not."""

    def __init__(self, hook: CommHook, state: Any) -> None:
        self.hook = hook
        self.state = state
        # A hook that compresses reports what it really sent (lockstep's HookState).
        self._take_sent: Callable[[], int] | None = getattr(state, "take_sent_bytes", None)

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        return None

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        return HookHandle(self.hook(self.state, GradBucket(bucket, is_last)), bucket.buffer)

    def sent_bytes(self) -> int | None:
        return self._take_sent() if self._take_sent is not None else None

    def issues_inline(self) -> bool:
        return False  # torch's PowerSGD hook issues its second all-reduce in a callback


class _Skipped:
    """The handle of a collective that did not need to run: done at once."""

    def __init__(self) -> None:
        self.done_at = time.perf_counter()

    def poll(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class SkipUnusedBuckets:
    """skip_all_reduce_unused_params: a bucket none of whose parameters got a gradient
    this step is not reduced (its zeros stay zeros), as torch does; the user promises
    that every rank leaves the same parameters unused.
    """

    def __init__(self, inner: BucketCollective) -> None:
        self.inner = inner

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        return self.inner.averaging(dtype)

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        if all(p.grad is None for p in bucket.params):
            return _Skipped()
        return self.inner.launch(bucket, is_last)

    def sent_bytes(self) -> int | None:
        return self.inner.sent_bytes()

    def issues_inline(self) -> bool:
        return self.inner.issues_inline()
