"""The cost of one step's gradient all-reduce: payload, buckets, ring and two-phase time.

After backward, DDP all-reduces every trainable gradient, bucket by bucket. The
payload is trainable parameters x gradient bytes. A ring all-reduce over N ranks
(reduce-scatter then all-gather) sends 2(N-1)/N of a bucket from every rank in
2(N-1) hops, so one bucket of b bytes costs 2(N-1) x hop latency + 2(N-1)/N x b / B,
with B the bus bandwidth of the slowest link in the ring (Patarasuk and Yuan, 2009;
the busbw convention of nccl-tests). Across nodes, the two-phase all-reduce runs that
ring inside each node first, then across the nodes: G GPUs per node, M nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lockstep.plan.links import Link

MiB = 1024 * 1024
FIRST_BUCKET_BYTES = 1 * MiB  # torch DDP's first bucket, small so backward overlaps early
BUCKET_BYTES = 25 * MiB  # torch DDP's bucket_cap_mb default


def ring_factor(world_size: int) -> float:
    """2(N-1)/N: the share of the payload each rank sends in a ring all-reduce."""
    return 2 * (world_size - 1) / world_size


def bucket_sizes(
    param_bytes: Sequence[int] | None,
    payload_bytes: int,
    cap_bytes: int = BUCKET_BYTES,
    first_cap_bytes: int = FIRST_BUCKET_BYTES,
) -> list[int]:
    """The byte size of each bucket, as DDP forms them.

    With the parameters known (registration order), walk them in reverse, the order
    gradients become ready, and close a bucket once it reaches its cap; a parameter
    is never split. Without them, cut the payload into cap-sized pieces.

    Args:
        param_bytes: gradient bytes of each trainable parameter, or None.
        payload_bytes: their sum (used when `param_bytes` is None).
        cap_bytes: cap of every bucket after the first.
        first_cap_bytes: cap of the first bucket.

    Returns:
        Bucket sizes in launch order; empty when nothing is trainable.
    """
    if param_bytes is None:
        return _cut(payload_bytes, cap_bytes, first_cap_bytes)
    buckets: list[int] = []
    open_bytes, cap = 0, first_cap_bytes
    for nbytes in reversed(param_bytes):
        open_bytes += nbytes
        if open_bytes >= cap:
            buckets.append(open_bytes)
            open_bytes, cap = 0, cap_bytes
    if open_bytes:
        buckets.append(open_bytes)
    return buckets


def _cut(payload_bytes: int, cap_bytes: int, first_cap_bytes: int) -> list[int]:
    if payload_bytes <= 0:
        return []
    first = min(first_cap_bytes, payload_bytes)
    rest = payload_bytes - first
    full, tail = divmod(rest, cap_bytes)
    return [first] + [cap_bytes] * full + ([tail] if tail else [])


def ring_seconds(nbytes: float, world_size: int, bus_bps: float, hop_latency_s: float) -> float:
    """Time of one ring all-reduce of `nbytes` over `world_size` ranks."""
    if world_size < 2 or nbytes <= 0:
        return 0.0
    hops = 2 * (world_size - 1)
    return hops * hop_latency_s + ring_factor(world_size) * nbytes / bus_bps


@dataclass(frozen=True)
class Topology:
    """Where the ranks sit: `gpus_per_node` on each of `nodes` nodes."""

    gpus_per_node: int
    nodes: int

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


def step_seconds(buckets: Sequence[int], world_size: int, link: Link, fast: bool) -> float:
    """One step's all-reduce time, every bucket one ring over `world_size` ranks on `link`.

    Args:
        buckets: bucket sizes in bytes.
        world_size: ranks in the ring.
        link: the link that bounds the ring.
        fast: use the high end of the link's range (else the low end).
    """
    bps = link.high_bps if fast else link.low_bps
    return sum(ring_seconds(b, world_size, bps, link.hop_latency_s) for b in buckets)


def two_phase_seconds(
    buckets: Sequence[int], topo: Topology, intra: Link, inter: Link, fast: bool
) -> float:
    """One step's all-reduce time, inside each node first and then across the nodes.

    Per bucket: a ring over the G GPUs of a node on `intra` (reduce-scatter, and later
    all-gather), and a ring over the M nodes on `inter`, where the node's network
    bandwidth carries 2(M-1)/M of the bucket. Phases of one bucket run one after the
    other; buckets run one after the other.
    """
    intra_bps = intra.high_bps if fast else intra.low_bps
    inter_bps = inter.high_bps if fast else inter.low_bps
    total = 0.0
    for nbytes in buckets:
        total += ring_seconds(nbytes, topo.gpus_per_node, intra_bps, intra.hop_latency_s)
        total += ring_seconds(nbytes, topo.nodes, inter_bps, inter.hop_latency_s)
    return total
