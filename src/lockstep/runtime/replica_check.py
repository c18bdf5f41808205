"""Replicas that vouch for each other: every step, the ranks' parameters and buffers compared.

Data parallelism keeps one replica per rank, bitwise equal after every step. A bit
flipped in one rank's memory, a rank-local write to the model, a checkpoint loaded
on one rank only: each leaves one replica different, and from then on every rank
applies gradients that replica computed. `ReplicaGuard` finds it at the next step.

The hot path, per synchronised step: as each bucket launches, the digest
(`replica_digest.tensor_digest`, one integer sum on the device) of each of its
parameters, which backward has just read; when the fingerprint goes out, the
digests of the buffers and frozen parameters that a forward leaves as they are
(learned in the first synchronised forward of the process: BatchNorm's running
statistics move with each rank's batch and are not compared) and a fold of all of
them into two values below 2**24, which ride in the step fingerprint's all-reduce
(`runtime/fingerprint.py`): no host read, no collective of its own. The parameters
compared at step k+1 are those step k's optimizer left, and the verdict is known
at step k+1's backward end, before any rank's optimizer applies a gradient that a
differing replica computed.

Only when the folds differ (`end_step`, the driver's first end-of-step action):
every rank's per-tensor digests are gathered, and every rank reaches the same
verdict (`replica_digest.judge`), naming the ranks outside the majority, the step
and the first parameter or buffer that differs. Then:

- with a majority, under `lockstep run --live-recovery`: each differing rank says
  so and leaves, killed by its own signal as a lost rank would be; the others meet
  its loss in one more collective (`_await_leaving`), and live recovery replaces it
  with the state of the lowest majority rank, the survivors redo the step's
  reduction from their own local gradients and the replacement recomputes the step
  (`runtime/driver.py` `_end_step`, the seam the non-finite check's exchange uses);
- otherwise (two replicas, no majority, or no live recovery): `ReplicaMismatchError`
  on every rank, naming the ranks.

On by default (but with `init_sync=False`, where torch lets each rank start from its
own weights, unless `check_replicas=True` is passed); `check_replicas=False` (the DDP
wrapper) or LOCKSTEP_CHECK_REPLICAS=0 switches it off. Every rank must make the same
choice.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lockstep.env import read_variable
from lockstep.errors import ReplicaMismatchError
from lockstep.runtime import waits
from lockstep.runtime.control_device import control_device, to_control_device
from lockstep.runtime.replica_digest import (
    SLOTS,
    GroupDigest,
    Verdict,
    fold,
    judge,
    tensor_digest,
    weights,
)

if TYPE_CHECKING:
    from lockstep.runtime.bucket import Bucket
    from lockstep.runtime.driver import BackwardDriver

VARIABLE = "LOCKSTEP_CHECK_REPLICAS"
Named = Sequence[tuple[str, torch.Tensor]]


def wanted(argument: bool) -> bool:
    """The argument, unless LOCKSTEP_CHECK_REPLICAS says 0/off/false/no."""
    value = (read_variable(VARIABLE) or "").strip().lower()
    return argument and value not in ("0", "off", "false", "no")


class ReplicaGuard:
    """The replica check of one engine.

    Args:
        enabled: check (a world of one checks nothing).
        process_group: the replicas' group.
        rank: this rank in it.
        world_size: its size.
        trained: the parameters the engine's buckets hold, in the index order of
            `Bucket.param_indices`.
        others: the buffers and frozen parameters (compared when a forward leaves them).

    Attributes:
        steps_checked: synchronised steps whose digests went out.
    """

    def __init__(
        self,
        enabled: bool,
        process_group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        trained: Named,
        others: Named,
    ) -> None:
        self.on = enabled and world_size > 1
        self.group, self.rank, self.world_size = process_group, rank, world_size
        self.trained = [t for _, t in trained]
        self.others = [t for _, t in others]
        self.names = [f"parameter '{n}'" for n, _ in trained]
        self.names += [f"buffer or frozen parameter '{n}'" for n, _ in others]
        self.steps_checked = 0
        self._groups: dict[int, tuple[list[int], GroupDigest]] = {}  # bucket -> its indices
        self._parts: dict[int, list[torch.Tensor]] = {}  # this step's, by bucket index
        self._still: list[bool] | None = None  # per `others`: a forward leaves it as it is
        self._still_group: GroupDigest | None = None
        self._before: list[int] | None = None
        self._weights: torch.Tensor | None = None
        self._driver: BackwardDriver | None = None

    def attach(self, driver: BackwardDriver) -> None:
        """Digest `driver`'s buckets as they launch, send the fold, judge at the step's end
        (first of its end-of-step actions: a differing replica is named before anything
        else the step decides)."""
        self._driver = driver
        if not self.on:
            return
        driver.digest_bucket = self.bucket_ready
        driver.digest = self.digest
        driver.end_of_step.insert(0, self.end_step)

    # ------------------------------------------------------------ forward side
    def before_forward(self) -> None:
        """A synchronised forward starts: in the first, note the other tensors' digests."""
        if self.on and self._still is None and self._before is None:
            self._before = [int(tensor_digest(t).item()) for t in self.others]

    def after_forward(self) -> None:
        """The first synchronised forward ended: keep the tensors it left as they were."""
        if self._before is not None:
            after = [int(tensor_digest(t).item()) for t in self.others]
            self._still = [a == b for a, b in zip(after, self._before, strict=True)]
            kept = zip(self.others, self._still, strict=True)
            self._still_group = GroupDigest([t for t, still in kept if still])
            self._before = None

    # ----------------------------------------------------------- the hot path
    def bucket_ready(self, bucket: Bucket) -> None:
        """The bucket is about to launch: digest its parameters (backward just read them):
        a word sum per large parameter, one over the small ones together (`GroupDigest`)."""
        indices = bucket.param_indices
        known = self._groups.get(bucket.index)
        if known is None or known[0] is not indices:  # the first step, or the one rebuild
            group = GroupDigest([self.trained[i] for i in indices])
            known = self._groups[bucket.index] = (indices, group)
        self._parts[bucket.index] = known[1].parts()

    def digest(self) -> torch.Tensor:
        """The fold of this step's digests (on the parameters' device), for the fingerprint."""
        assert self._driver is not None
        parts = [p for i in range(len(self._driver.buckets)) for p in self._parts.get(i, [])]
        if self._still_group is not None:
            parts += self._still_group.parts()
        if not parts:
            return torch.zeros(SLOTS, dtype=torch.int64)
        digests = torch.stack(parts).to(torch.int64)
        if self._weights is None or self._weights.shape != digests.shape:
            self._weights = weights(len(parts), digests.device)
        self.steps_checked += 1
        return fold(digests, self._weights)

    def entries(self) -> torch.Tensor:
        """Every parameter's and compared buffer's digest, one each (the slow path's table;
        the parameters are as backward read them: no optimizer ran since)."""
        still = self._still or [False] * len(self.others)
        found = [int(tensor_digest(t).item()) for t in self.trained]
        kept = zip(self.others, still, strict=True)
        found += [int(tensor_digest(t).item()) if s else 0 for t, s in kept]
        return torch.tensor(found, dtype=torch.int64)

    # ------------------------------------------------------------ step's end
    def end_step(self) -> None:
        """After the step's collectives: act if the replicas' digests differed.

        Raises:
            ReplicaMismatchError: on every rank, when the ranks differ and no live heal
                applies (two replicas, no majority, no live recovery).
            RuntimeError: on a majority rank, the loss of the differing rank(s), which
                live recovery replaces (the driver hands it to its recovery slot).
        """
        assert self._driver is not None, "ReplicaGuard.attach(driver) comes first"
        if self._driver.fingerprint.replicas_agree:
            return
        step = self._driver.steps
        table = self._gather(step)
        verdict = judge(table)
        what = self.describe(verdict, step)
        healable = len(verdict.majority) >= 2 and self._driver.recovery is not None
        if not healable:
            raise ReplicaMismatchError(f"{what} (raised on rank {self.rank}). {_advice()}")
        donor = verdict.majority[0]
        if self.rank in verdict.differing:
            _say(
                self.rank,
                f"{what}: this rank's replica differs from the majority's, so it leaves and "
                f"is replaced live with the state of rank {donor}; step {step} is finished "
                "again with the gradient its replacement recomputes",
            )
            os.kill(os.getpid(), signal.SIGKILL)  # leaves as a lost rank does
        _say(
            self.rank,
            f"{what}: rank(s) {list(verdict.differing)} leave and are replaced live with "
            f"the state of rank {donor}; step {step} is finished again",
        )
        self._await_leaving(verdict.differing, step)

    def _gather(self, step: int) -> list[list[int]]:
        """Every rank's per-tensor digests (the slow path's one collective)."""
        mine = to_control_device(self.entries(), control_device(self.group))
        slots = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(slots, mine, group=self.group, async_op=True)
        waits.collective(work, f"replica check's digests of step {step}", self.group)
        return [slot.tolist() for slot in slots]

    def _await_leaving(self, leaving: Sequence[int], step: int) -> None:
        """Wait in a collective the leaving rank(s) never join, until their loss ends it."""
        token = torch.zeros(1, device=control_device(self.group))
        work = dist.all_reduce(token, group=self.group, async_op=True)
        waits.collective(work, f"replica check: rank(s) {list(leaving)} leaving", self.group)
        raise RuntimeError(f"rank(s) {list(leaving)} did not leave after step {step}'s check")

    def describe(self, verdict: Verdict, step: int) -> str:
        """'replicas differ at synchronised step 6: rank(s) [1] ...' (one sentence)."""
        majority, differing, first = verdict.majority, list(verdict.differing), verdict.first
        where = self.names[first] if 0 <= first < len(self.names) else "(not located)"
        head = f"replicas differ at synchronised step {step}"
        if majority:
            return (
                f"{head}: rank(s) {differing} hold other parameters or buffers than the "
                f"majority, rank(s) {list(majority)}; the first that differs is {where}"
            )
        return (
            f"{head} and no majority holds the same state: rank(s) {differing} differ from "
            f"each other (with two replicas nobody can tell which is right); the first "
            f"that differs is {where}"
        )


def _say(rank: int, text: str) -> None:
    print(f"lockstep [rank {rank}]: replica check: {text}", file=sys.stderr, flush=True)


def _advice() -> str:
    return (
        "Found by the step's fingerprint before any rank applied this step's gradients, so "
        "the last checkpoint every rank agreed on is sound (Checkpointer keeps it as the "
        "latest). Causes: a rank-local write to the model (`if rank == 0: ...`), a "
        "checkpoint loaded on one rank only, a nondeterministic kernel, a memory fault. "
        "Restore that checkpoint and go on; with three ranks or more, `lockstep run "
        "--live-recovery` replaces a differing minority live. To switch the check off: "
        "check_replicas=False, or LOCKSTEP_CHECK_REPLICAS=0."
    )
