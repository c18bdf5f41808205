"""Non-finite gradients caught at the step where they appear, before the average spreads them.

Just before a bucket's collective starts, its local gradients are summed (one read
of the bucket: a NaN or an infinity anywhere makes the sum non-finite; only then
are its parameters looked at one by one). When the step's collectives are done,
one all-reduce of a single integer tells every rank whether any rank found one.
Only then does more happen: the ranks exchange what they found, every gradient is
dropped (`.grad = None`) and the step ends as the mode says: "raise" (default)
raises `NonFiniteGradientError` on every rank, naming the rank(s), the step and
the parameter; "skip" lets the run go on, its optimizer step doing nothing, and
counts the skip; "off" checks nothing. Both engines wrap their bucket collective.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep.errors import NonFiniteGradientError
from lockstep.runtime import waits
from lockstep.runtime.averaging import Averaging
from lockstep.runtime.bucket import Bucket
from lockstep.runtime.bucket_collective import BucketCollective
from lockstep.runtime.handles import CollectiveHandle, WorkHandle

# A bucket's parameters: (name, this rank's gradient of it inside the bucket's buffer).
Locate = Callable[[Bucket], Iterator[tuple[str, torch.Tensor]]]


class NonFinite(str, enum.Enum):
    """What a step whose gradients hold NaN or inf on some rank does."""

    RAISE = "raise"  # drop the gradients, raise NonFiniteGradientError on every rank
    SKIP = "skip"  # drop the gradients (the optimizer's step does nothing), count it
    OFF = "off"  # no check (torch's behaviour; what torch.amp.GradScaler expects)

    @classmethod
    def parse(cls, value: str | NonFinite) -> NonFinite:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"nonfinite must be one of {choices}; found {value!r}") from None


@dataclass(frozen=True)
class Finding:
    """A parameter whose local gradient held a non-finite value on this rank."""

    rank: int
    name: str
    kind: str  # "NaN" or "inf"


def _fp16_autocast() -> bool:
    """Whether fp16 autocast is on for CUDA or the CPU (where GradScaler's inf is expected)."""
    return any(
        torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16
        for device in ("cuda", "cpu")
    )


def _kind(grad: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(grad).any()) else "inf"


class FiniteGuard:
    """The check of one engine: wraps its bucket collective, ends each synchronised step.

    Args:
        mode: "raise", "skip" or "off".
        process_group: the replicas' group.
        rank: this rank in `process_group`.
        locate: a bucket's (name, local gradient) pairs, for the slow path only.
        drop_grads: sets every gradient the engine leaves to None.

    Attributes:
        steps: synchronised steps checked so far (the step number in messages).
        skipped: steps skipped in "skip" mode.
        last_step_skipped: whether the last synchronised step was skipped.
    """

    def __init__(
        self,
        mode: str | NonFinite,
        process_group: dist.ProcessGroup | None,
        rank: int,
        locate: Locate,
        drop_grads: Callable[[], None],
    ) -> None:
        self.mode = NonFinite.parse(mode)
        self.group, self.rank = process_group, rank
        self.locate, self.drop_grads = locate, drop_grads
        self.steps = 0
        self.skipped = 0
        self.last_step_skipped = False
        self._found: dict[str, Finding] = {}  # by name: a bucket launched again adds nothing
        self._device = torch.device("cpu")
        self.scaler_owns = False  # the step's forward ran under fp16 autocast

    def note_forward(self) -> None:
        """A synchronised forward ran: under fp16 autocast a gradient scaler owns overflow.

        torch.amp.GradScaler scales fp16 losses until gradients overflow to inf, on
        purpose, and skips those steps itself; such a step is left to it (checked
        nothing, raised nothing), whatever the mode.
        """
        self.scaler_owns = _fp16_autocast()

    def wrap(self, collective: BucketCollective) -> BucketCollective:
        """`collective`, checking each bucket before it starts (itself when the mode is off)."""
        if self.mode == NonFinite.OFF:
            return collective
        return CheckedCollective(collective, self)

    def check_bucket(self, bucket: Bucket) -> None:
        """Before the bucket's collective: note its non-finite local gradients, if any."""
        buffer = bucket.buffer
        self._device = buffer.device
        if self.scaler_owns:
            return
        total = buffer.sum(dtype=torch.float64 if buffer.dtype == torch.float64 else torch.float32)
        if math.isfinite(total.item()):
            return
        for name, grad in self.locate(bucket):  # slow path: which parameter, NaN or inf
            if not bool(torch.isfinite(grad).all()):
                self._found[name] = Finding(self.rank, name, _kind(grad))

    def end_step(self) -> None:
        """After the step's collectives, on every rank: agree, then raise or skip if any found.

        The agreement is one of the step's collectives: its wait is the engine's (stall
        report, live recovery's interruption), and a rank lost in it leaves this guard
        as it was before the step's end, so the step can be finished again.

        Raises:
            NonFiniteGradientError: in "raise" mode, on every rank, when any rank found one.
            RuntimeError: the agreement failed (a rank was lost).
        """
        if self.mode == NonFinite.OFF:
            return
        step = self.steps + 1
        found = list(self._found.values())
        count = torch.tensor([len(found)], dtype=torch.int64, device=self._device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            work = dist.all_reduce(count, group=self.group, async_op=True)
            waits.wait(WorkHandle(work), "non-finite check", step, -1, self.group)
        self.steps, self._found = step, {}
        self.last_step_skipped = bool(count.item())
        if not self.last_step_skipped:
            return
        everyone = self._gather(found)
        self.drop_grads()
        if self.mode == NonFinite.SKIP:
            self.skipped += 1
            return
        raise NonFiniteGradientError(describe(everyone, self.steps, self.rank))

    def _gather(self, found: list[Finding]) -> list[list[Finding]]:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return [found]
        everyone: list[list[Finding] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, found, group=self.group)
        return [f or [] for f in everyone]


def describe(everyone: list[list[Finding]], step: int, rank: int) -> str:
    """The error's text: which ranks, which step, which parameter first, what to do."""
    bad = [found for found in everyone if found]
    per_rank = "; ".join(
        f"rank {found[0].rank}: '{found[0].name}' holds {found[0].kind}"
        + (f" (and {len(found) - 1} more parameter(s))" if len(found) > 1 else "")
        for found in bad
    )
    ranks = ", ".join(str(found[0].rank) for found in bad)
    finite = [str(r) for r, found in enumerate(everyone) if not found]
    return (
        f"non-finite gradients at synchronised step {step}, found in rank(s) {ranks}'s own "
        f"gradients before averaging: {per_rank}. Ranks with finite gradients: "
        f"{', '.join(finite) or 'none'}. (raised on rank {rank}; every gradient of the step "
        "was dropped, so the parameters are unchanged.) A NaN or inf loss on a rank gives "
        "such gradients: look at that rank's batch and loss at that step (a log of 0, a "
        "division by zero, a learning rate too high). To skip such steps as a gradient "
        "scaler does, pass nonfinite='skip' to the wrapper (steps whose forward ran under "
        "fp16 autocast are left to torch.amp.GradScaler)."
    )


class CheckedCollective:
    """A bucket collective whose buckets are checked for non-finite values before they start."""

    def __init__(self, inner: BucketCollective, guard: FiniteGuard) -> None:
        self.inner = inner
        self.guard = guard

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        return self.inner.averaging(dtype)

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        self.guard.check_bucket(bucket)
        return self.inner.launch(bucket, is_last)

    def sent_bytes(self) -> int | None:
        return self.inner.sent_bytes()


def bucket_params(names: list[str]) -> Locate:
    """The DDP engine's buckets: one view per parameter, in `bucket.param_indices` order."""

    def locate(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
        for index, view in zip(bucket.param_indices, bucket.views, strict=True):
            yield names[index], view

    return locate


def flat_params(flats: list) -> Locate:
    """The sharded engine's buckets: one flat each (`bucket.index` is the flat's index)."""
    by_index = {flat.index: flat for flat in flats}

    def locate(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
        offset = 0
        for slot in by_index[bucket.index].slots:
            numel = slot.param.numel()
            yield slot.names[0], bucket.buffer[offset : offset + numel]
            offset += numel

    return locate
