"""The step fingerprint: ranks that pair different steps are caught at the first one.

Every synchronised step, once its last bucket is launched, each rank contributes
three integers to one small asynchronous all-reduce: its count of synchronised
steps, how many passes over its data have fed them (`lockstep.runtime.data_passes`),
how many micro-batches this step accumulated (forwards under `no_sync()` plus one),
and a hash of its bucket layout. The collective runs beside the last bucket's and
is checked when backward ends. For each value v a rank sends v and v*v, plus a 1
that counts the M ranks taking part; the sums satisfy M * sum(v*v) == sum(v)**2
only when every taking part sent the same v, so every rank reaches the same verdict
and raises together, naming each rank's figures (one all_gather_object, on the
error path only). The same tensor carries the non-finite check's verdict
(`runtime/finite.py`): a last slot with this rank's count of non-finite buckets,
written on the device, so the check costs no collective and no host read of its
own. `check` reads the sums once: with NCCL the step's one host synchronisation.
A rank that has run out of data under Join shadows the collective with zeros
(`launch(None)`, after its shadow buckets): it is not counted, but checks and
raises with the others. The data pass has a count of its own, of the ranks that
read their data: a rank fed by another (Accelerate's dispatch_batches) says 0 and
is not compared. Before that last slot, `SLOTS` digest values and their squares
carry the replica check's fold of this rank's parameters and buffers
(`runtime/replica_check.py`), compared the same way: `replicas_agree` says whether
every rank taking part sent the same (zeros when the check is off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep.collectives.agreement import gather_from_ranks
from lockstep.errors import RankMismatchError
from lockstep.runtime import progress, waits
from lockstep.runtime.control_device import control_device, to_control_device
from lockstep.runtime.handles import WorkHandle
from lockstep.runtime.replica_digest import SLOTS

FIELDS = ("synchronised step", "data pass", "micro-batches", "bucket layout")


@dataclass(frozen=True)
class Fingerprint:
    """What one rank says about the step it is in."""

    step: int
    data_pass: int
    micro_batches: int
    layout: int

    def values(self) -> tuple[int, int, int, int]:
        return (self.step, self.data_pass, self.micro_batches, self.layout)


class StepFingerprint:
    """Note a step's backward, launch its fingerprint after its buckets, check it at the end.

    Attributes:
        flagged: after `check`, the buckets whose local sum was not finite, counted over
            every rank (0: no rank found a NaN or an infinity; `runtime/finite.py`).
        replicas_agree: after `check`, whether every rank sent the same replica digest
            (`runtime/replica_check.py`).
    """

    def __init__(self, process_group: dist.ProcessGroup | None, rank: int, world_size: int):
        self.group = process_group
        self.rank, self.world_size = rank, world_size
        self.flagged = 0
        self.replicas_agree = True
        self._mine: Fingerprint | None = None
        self._sums: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._flag: torch.Tensor | None = None  # a world of one: the verdict, read by `check`
        self._step = 0  # the step in progress, for progress notes and stall messages

    def begin(self, step: int | None) -> None:
        """A synchronised backward began (None: a shadow under Join, the next step)."""
        self._step = step if step is not None else self._step + 1
        if self.world_size > 1:
            progress.note(progress.Phase.BACKWARD, self._step)

    def launch(
        self,
        mine: Fingerprint | None,
        flag: torch.Tensor | None = None,
        digest: torch.Tensor | None = None,
    ) -> None:
        """Start the all-reduce of (1, reading, v..., v*v..., d..., d*d..., flag); None: a
        shadow of zeros.

        Args:
            mine: this rank's fingerprint of the step.
            flag: this rank's count of non-finite buckets, a tensor on the buckets' device
                (None: none checked). Copied into the sums on the device, never read here.
            digest: this rank's `SLOTS` replica digest values, each below 2**24, on the
                device (None: not checked, zeros). Squared and copied there, never read.
        """
        self._mine = mine
        if self.world_size == 1:
            self._flag = flag
            return
        if mine is None:
            sums = torch.zeros(3 + 2 * len(FIELDS) + 2 * SLOTS, dtype=torch.int64)
        else:
            values = torch.tensor(mine.values(), dtype=torch.int64)
            counts = torch.tensor([1, int(mine.data_pass > 0)], dtype=torch.int64)
            zero = torch.zeros(1 + 2 * SLOTS, dtype=torch.int64)
            sums = torch.cat([counts, values, values * values, zero])
        sums = to_control_device(sums, control_device(self.group))  # NCCL takes CUDA only
        if flag is not None:
            sums[-1:].copy_(flag.reshape(1))
        if digest is not None and mine is not None:
            at = 2 + 2 * len(FIELDS)
            sums[at : at + SLOTS].copy_(digest)
            sums[at + SLOTS : at + 2 * SLOTS].copy_(digest * digest)
        self._sums = sums
        self._work = dist.all_reduce(sums, group=self.group, async_op=True)

    def check(self) -> None:
        """Wait for the sums; raise `RankMismatchError` on every rank if any value differs.

        Sets `flagged`. The one host read of the step: one `tolist()` of the sums (with a
        world of one, of the flag alone).
        """
        if self._work is None:
            flag, self._flag = self._flag, None
            self.flagged = int(flag.item()) if flag is not None else 0
            return
        work, self._work = self._work, None
        waits.wait(WorkHandle(work), "step fingerprint", self._step, -1, self.group)
        progress.note(progress.Phase.SYNCHRONISED, self._step)
        assert self._sums is not None
        n = len(FIELDS)
        values = self._sums.tolist()
        taking_part, reading = values[0], values[1]
        sums, squares = values[2 : 2 + n], values[2 + n : 2 + 2 * n]
        digests = values[2 + 2 * n : 2 + 2 * n + SLOTS]
        self.replicas_agree = all(
            taking_part * sq == d * d
            for d, sq in zip(digests, values[2 + 2 * n + SLOTS : -1], strict=True)
        )
        self.flagged = values[-1]
        parts = [reading if name == "data pass" else taking_part for name in FIELDS]
        if all(m * sq == s * s for m, s, sq in zip(parts, sums, squares, strict=True)):
            return
        raise self._mismatch(self._mine)

    def settle(self, flagged: int = 0) -> None:
        """End the step as a peer that finished its fingerprint saw it, instead of `check`
        (live recovery: this rank's wait failed after that peer's had ended; the sums
        matched there, and carried `flagged`)."""
        self._work = None
        self.flagged = flagged
        self.replicas_agree = True
        progress.note(progress.Phase.SYNCHRONISED, self._step)

    def _mismatch(self, mine: Fingerprint | None) -> RankMismatchError:
        everyone = gather_from_ranks(mine, self.group)
        per_rank = "; ".join(
            f"rank {r}: step {f.step}, data pass {f.data_pass}, {f.micro_batches} micro-batch(es)"
            for r, f in enumerate(everyone)
            if f is not None
        )
        if len({f.layout for f in everyone if f is not None}) > 1:
            what = "different bucket layouts (the ranks built different models or buckets)"
        elif len({f.step for f in everyone if f is not None}) > 1:
            what = "different synchronised steps"
        elif len({f.micro_batches for f in everyone if f is not None}) > 1:
            what = "steps that accumulated different numbers of micro-batches (no_sync)"
        else:
            what = "steps fed by different passes over their data (uneven data per rank)"
        return RankMismatchError(
            f"on rank {self.rank}: the ranks' gradient all-reduces paired {what}: {per_rank}. "
            "Every rank must run the same synchronised steps on its share of the same epoch. "
            "Give every rank the same number of batches (lockstep.shard(dataset, ...) does, "
            "or torch's DistributedSampler), wrap uneven inputs in "
            "torch.distributed.algorithms.join.Join([model]), use no_sync() for the same "
            "micro-batches on every rank, and run extra forwards of one rank only under "
            "torch.no_grad(). A loader that every rank restarts when "
            "it runs out, for a fixed number of steps, is harmless: pass "
            "check_data_passes=False to DistributedDataParallel."
        )
