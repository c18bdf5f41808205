"""Non-finite gradients caught at the step where they appear, before the average is applied.

Just before a bucket's collective starts, its local gradients are summed on their
device (one read of the bucket: a NaN or an infinity anywhere makes the sum
non-finite). Nothing is read by the host then: once the last bucket is launched,
this rank's count of non-finite sums rides in the step fingerprint's all-reduce
(`runtime/fingerprint.py`), which every step makes and reads once at its end. Only
when some rank found one does more happen (`FiniteGuard`): every gradient is
dropped (`.grad = None`) and the step ends as the mode says: "raise" (default)
raises `NonFiniteGradientError` on every rank, naming the rank(s), the step and the
parameter; "skip" lets the run go on, its optimizer step doing nothing, and counts
the skip; "off" checks nothing. Both engines wrap their bucket collective.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lockstep.errors import NonFiniteGradientError, NonFiniteSkipWarning
from lockstep.runtime.averaging import Averaging
from lockstep.runtime.bucket import Bucket
from lockstep.runtime.bucket_collective import BucketCollective
from lockstep.runtime.handles import CollectiveHandle

if TYPE_CHECKING:
    from lockstep.runtime.driver import BackwardDriver

# A bucket's parameters after its collective: (name, the part of its averaged gradient
# this rank holds).
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


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _nonfinite_kind(grad: torch.Tensor) -> str | None:
    """The kind, "NaN" or "inf", or None when finite (a quick sum first, then the exact look)."""
    if grad.numel() == 0 or math.isfinite(grad.sum(dtype=_sum_dtype(grad.dtype)).item()):
        return None
    if bool(torch.isfinite(grad).all()):
        return None  # the sum overflowed
    return "NaN" if bool(torch.isnan(grad).any()) else "inf"


@dataclass(frozen=True)
class Report:
    """What one rank brings to the slow path.

    Attributes:
        rank: its rank in the group.
        buckets: the buckets whose local sum was not finite on it, by index.
        seen: (bucket index, parameter, "NaN" or "inf") for each parameter whose averaged
            gradient is not finite in the part of the results this rank holds.
    """

    rank: int
    buckets: list[int]
    seen: list[tuple[int, str, str]]


def attribute(reports: list[Report]) -> list[list[Finding]]:
    """Each rank's findings: the non-finite parameters (seen by any rank) of the buckets
    it flagged. A flagged bucket with no such parameter (its sum overflowed) adds none."""
    seen: dict[int, dict[str, str]] = {}
    for report in reports:
        for index, name, kind in report.seen:
            seen.setdefault(index, {}).setdefault(name, kind)
    return [
        [
            Finding(report.rank, name, kind)
            for index in report.buckets
            for name, kind in seen.get(index, {}).items()
        ]
        for report in reports
    ]


class FiniteGuard:
    """The check of one engine: wraps its bucket collective, decides each synchronised step.

    The hot path is one `sum` per bucket, kept on the device, and a count of the
    non-finite ones at backward's end (`verdict`), which the driver sends in the
    step fingerprint: no host read per bucket (on a GPU, none per step beyond the
    fingerprint's own), no collective of its own. The price is paid only when some
    rank found one: by then each bucket's local gradients have been averaged in
    place, so a flagging rank is named with the parameters whose *averaged* gradient
    is not finite in the buckets it flagged (a NaN or inf in one rank's gradient
    leaves the average non-finite at the same parameter). That is exact when one
    rank found them; when several ranks flagged the same bucket, each is named with
    that bucket's non-finite parameters, and the kind (NaN, inf) is the average's.

    Args:
        mode: "raise", "skip" or "off".
        process_group: the replicas' group.
        rank: this rank in `process_group`.
        locate: a bucket's parameters and this rank's part of their averaged gradients,
            for the slow path only.
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
        self._sums: dict[int, torch.Tensor] = {}  # by bucket: a bucket launched again replaces
        self._driver: BackwardDriver | None = None
        self.scaler_owns = False  # the step's forward ran under fp16 autocast

    def attach(self, driver: BackwardDriver) -> None:
        """Decide `driver`'s steps: its fingerprint carries `verdict`, `end_step` ends each."""
        self._driver = driver
        driver.end_of_step.append(self.end_step)
        if self.mode != NonFinite.OFF:
            driver.verdict = self.verdict

    def note_forward(self) -> None:
        """A synchronised forward ran: under fp16 autocast a gradient scaler owns overflow.

        torch.amp.GradScaler scales fp16 losses until gradients overflow to inf, on
        purpose, and skips those steps itself; such a step is left to it (checked
        nothing, raised nothing), whatever the mode.
        """
        self.scaler_owns = _fp16_autocast()
        self._sums = {}

    def wrap(self, collective: BucketCollective) -> BucketCollective:
        """`collective`, checking each bucket before it starts (itself when the mode is off)."""
        if self.mode == NonFinite.OFF:
            return collective
        return CheckedCollective(collective, self)

    def check_bucket(self, bucket: Bucket) -> None:
        """Before the bucket's collective: its local sum, kept on the device (not read)."""
        if self.scaler_owns:
            return
        buffer = bucket.buffer
        self._sums[bucket.index] = buffer.sum(dtype=_sum_dtype(buffer.dtype))

    def verdict(self) -> torch.Tensor | None:
        """This rank's count of buckets whose sum is not finite, on their device (None: none
        checked). Called once the last bucket is launched; nothing waits for the device."""
        sums = list(self._sums.values())
        if not sums:
            return None
        first = sums[0]
        if any(s.dtype != first.dtype or s.device != first.device for s in sums):
            sums = [s.to(first.device, torch.float64) for s in sums]
        return torch.stack(sums).isfinite().logical_not().sum()

    def end_step(self, holds_results: bool = True) -> None:
        """After the step's collectives, on every rank: raise or skip if any rank found one.

        The verdict came back with the fingerprint, the same on every rank. Only when it
        is not 0 do the ranks exchange what they found (one `all_gather_object`); a rank
        lost in it leaves this guard as it was, so the step can be finished again.

        Args:
            holds_results: this rank holds the step's averaged gradients (False: it has
                joined under Join and shadows the step).

        Raises:
            NonFiniteGradientError: in "raise" mode, on every rank, when any rank found one.
            RuntimeError: the exchange failed (a rank was lost).
        """
        if self.mode == NonFinite.OFF:
            return
        assert self._driver is not None, "FiniteGuard.attach(driver) comes first"
        everyone = self._exchange(holds_results) if self._driver.fingerprint.flagged else []
        self.steps, self._sums = self.steps + 1, {}
        self.last_step_skipped = any(everyone)
        if not self.last_step_skipped:
            return
        self.drop_grads()
        if self.mode == NonFinite.SKIP:
            self.skipped += 1
            if self.rank == 0 and self.skipped & (self.skipped - 1) == 0:  # 1, 2, 4, 8, ...
                message = skip_message(everyone, self.steps, self.skipped)
                warnings.warn(message, NonFiniteSkipWarning, stacklevel=2)
            return
        raise NonFiniteGradientError(describe(everyone, self.steps, self.rank))

    def _exchange(self, holds_results: bool) -> list[list[Finding]]:
        """The slow path: this rank's flagged buckets and what it sees, from every rank."""
        assert self._driver is not None
        flagged = [i for i, total in self._sums.items() if not math.isfinite(total.item())]
        seen = []
        for bucket in self._driver.buckets if holds_results else []:
            for name, grad in self.locate(bucket):
                kind = _nonfinite_kind(grad)
                if kind is not None:
                    seen.append((bucket.index, name, kind))
        return attribute(self._gather(Report(self.rank, flagged, seen)))

    def _gather(self, mine: Report) -> list[Report]:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return [mine]
        everyone: list[Report | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        return [r for r in everyone if r is not None]


def _per_rank(everyone: list[list[Finding]]) -> str:
    """ "rank 1: 'fc.weight' holds NaN (and 2 more parameter(s))", for each rank that found one."""
    return "; ".join(
        f"rank {found[0].rank}: '{found[0].name}' holds {found[0].kind}"
        + (f" (and {len(found) - 1} more parameter(s))" if len(found) > 1 else "")
        for found in everyone
        if found
    )


def describe(everyone: list[list[Finding]], step: int, rank: int) -> str:
    """The error's text: which ranks, which step, which parameter first, what to do."""
    bad = [found for found in everyone if found]
    ranks = ", ".join(str(found[0].rank) for found in bad)
    finite = [str(r) for r, found in enumerate(everyone) if not found]
    return (
        f"non-finite gradients at synchronised step {step}, found in rank(s) {ranks}'s own "
        f"gradients before averaging: {_per_rank(everyone)}. Ranks with finite gradients: "
        f"{', '.join(finite) or 'none'}. (raised on rank {rank}; every gradient of the step "
        "was dropped, so the parameters are unchanged.) A NaN or inf loss on a rank gives "
        "such gradients: look at that rank's batch and loss at that step (a log of 0, a "
        "division by zero, a learning rate too high). To skip such steps as a gradient "
        "scaler does, pass nonfinite='skip' to the wrapper (steps whose forward ran under "
        "fp16 autocast are left to torch.amp.GradScaler)."
    )


def skip_message(everyone: list[list[Finding]], step: int, skipped: int) -> str:
    """The warning of nonfinite="skip" (rank 0, at 1, 2, 4, 8, ... skipped steps)."""
    return (
        f"lockstep [rank 0]: skipped synchronised step {step} (nonfinite='skip'): non-finite "
        f"gradients before averaging in {_per_rank(everyone)}; every gradient of the step "
        f"was dropped, the parameters are unchanged. {skipped} step(s) skipped so far "
        "(said at 1, 2, 4, 8, ... skipped steps; the wrapper's `nonfinite.skipped` counts them)"
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

    def issues_inline(self) -> bool:
        return self.inner.issues_inline()


def bucket_params(names: list[str]) -> Locate:
    """The DDP engine's buckets: one view per parameter (in `bucket.param_indices` order),
    holding the averaged gradient once the bucket's collective is done."""

    def locate(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
        for index, view in zip(bucket.param_indices, bucket.views, strict=True):
            yield names[index], view

    return locate


def flat_params(flats: list, rank: int) -> Locate:
    """The sharded engine's buckets (one flat each, `bucket.param_indices[0]` its index):
    the pieces of the flat's parameters in this rank's shard of the averaged gradient."""
    by_index = {flat.index: flat for flat in flats}

    def locate(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
        flat = by_index[bucket.param_indices[0]]
        grad = flat.shard.grad
        if grad is None:
            return
        for piece in flat.layout.pieces(rank):
            start = piece.shard_offset
            yield flat.slots[piece.param].names[0], grad[start : start + piece.numel]

    return locate
