"""The ring all-reduce as one pipeline: reduce-scatter and all-gather, segment by segment.

The tensor is cut into N chunks and each chunk into K segments. In 2(N-1) steps
every rank sends one chunk to its right neighbour and receives one from its left;
the chunk received in step t is the one sent in step t+1. In the first N-1 steps
(reduce-scatter) a received chunk is added to this rank's own; after them rank r
holds chunk r summed over all ranks, and the last N-1 steps (all-gather) pass the
finished chunks on. Nothing waits for a whole step: as soon as segment i of a step
has arrived (and been added) it is sent on, so steps overlap, and the all-gather
of the first segments runs while the last ones are still being reduced.
"""

from __future__ import annotations

import torch

from lockstep.collectives._p2p import (
    Group,
    Workspace,
    chunk_bounds,
    combine_,
    finish_,
    post,
    rank_and_size,
    wait_all,
)

SEGMENT_BYTES = 2 * 1024 * 1024
"""Ring messages inside one node: not below this size, since each message has a fixed
cost. Measured at world size 2 over gloo on 2 CPU cores (docs/collectives.md): for a
4 MiB tensor, 4 or 8 segments per chunk ran at 0.5-0.67 x native, 1 or 2 at 0.8-0.9 x;
for 64 MiB, 8 segments of 4 MiB at 0.92-1.06 x, 2 of 16 MiB at 0.74-0.95 x."""

NETWORK_SEGMENT_BYTES = 1024 * 1024
"""Ring messages between nodes. With two ranks, both directions share one TCP connection;
one 12.5 MB message each way took 209 ms on a 1 Gbit/s link, the same bytes in 1 MiB
pieces 130 ms (line rate: 100 ms). `make_allreduce` uses this size when the group spans
nodes, and the hierarchical all-reduce for its leaders."""

MAX_SEGMENTS = 8
"""At most this many segments per chunk: a larger chunk gets larger segments."""


class RingSchedule:
    """Which bytes move in each step of the ring, for one rank.

    Step t sends chunk (rank - t - 1) mod N and receives chunk (rank - t - 2) mod N;
    every chunk is cut into the same number of segments, so the pieces of step t
    and step t+1 line up one to one even when chunk lengths differ by one element:
    chunk / segment_numel of them, but at most `max_segments` (each message has a
    fixed cost, so a large tensor gets larger segments rather than more of them).
    """

    def __init__(
        self, numel: int, rank: int, size: int, segment_numel: int, max_segments: int
    ) -> None:
        self.rank, self.size = rank, size
        self.bounds = chunk_bounds(numel, size)
        largest = self.bounds[1] - self.bounds[0]
        wanted = -(-largest // max(1, segment_numel))
        self.num_segments = max(1, min(wanted, max_segments))
        self.slot_numel = -(-largest // self.num_segments)  # the largest segment
        self.steps = 2 * (size - 1)

    @property
    def scratch_numel(self) -> int:
        """Receive space: one fixed slot per segment index, reused from step to step."""
        return self.num_segments * self.slot_numel

    def piece(self, chunk: int, segment: int) -> tuple[int, int]:
        """[start, end) of segment `segment` of chunk `chunk`, in the flat tensor."""
        start = self.bounds[chunk]
        inner = chunk_bounds(self.bounds[chunk + 1] - start, self.num_segments)
        return start + inner[segment], start + inner[segment + 1]

    def send_piece(self, step: int, segment: int) -> tuple[int, int]:
        return self.piece((self.rank - step - 1) % self.size, segment)

    def recv_piece(self, step: int, segment: int) -> tuple[int, int]:
        return self.piece((self.rank - step - 2) % self.size, segment)

    def reduces(self, step: int) -> bool:
        """True for the reduce-scatter steps, whose received data is added, not copied."""
        return step < self.size - 1


def all_reduce_ring_pipelined(
    flat: torch.Tensor,
    op: object,
    group: Group,
    workspace: Workspace,
    segment_numel: int,
    max_segments: int,
) -> None:
    """Run the whole ring on a 1-D tensor, in place, receiving into `workspace`.

    Each segment's send and receive are posted together (`batch_isend_irecv`), in
    (step, segment) order on every rank, so each send meets the receive meant for
    it; segment i of step t+1 is posted as soon as segment i of step t is done.
    """
    rank, size = rank_and_size(group)
    plan = RingSchedule(flat.numel(), rank, size, segment_numel, max_segments)
    recv = workspace.scratch(plan.scratch_numel, flat)
    pending = [_post(plan, flat, recv, 0, i, group) for i in range(plan.num_segments)]
    for step in range(plan.steps):
        for i in range(plan.num_segments):
            wait_all(pending[i])
            if plan.reduces(step):
                a, b = plan.recv_piece(step, i)
                start = i * plan.slot_numel
                combine_(flat[a:b], recv[start : start + b - a], op)
                if step == size - 2:  # chunk `rank` is now complete
                    finish_(flat[a:b], op, size)
            if step + 1 < plan.steps:
                pending[i] = _post(plan, flat, recv, step + 1, i, group)


def _post(
    plan: RingSchedule,
    flat: torch.Tensor,
    recv: torch.Tensor,
    step: int,
    segment: int,
    group: Group,
) -> list:
    """Post one segment of a step: send to the right, receive from the left."""
    a, b = plan.send_piece(step, segment)
    c, d = plan.recv_piece(step, segment)
    if plan.reduces(step):
        start = segment * plan.slot_numel
        into = recv[start : start + d - c]
    else:
        into = flat[c:d]
    right, left = (plan.rank + 1) % plan.size, (plan.rank - 1) % plan.size
    return post(group, flat[a:b], right, into, left)
