"""All-reduce: every rank's tensor becomes op(all ranks' tensors), in place. Four ways to do it.

- naive: every rank sends to rank 0, which combines them one by one and sends the
  result back to each rank. 2(N-1) rounds, all through rank 0's link.
- tree: binomial-tree reduce to rank 0, then binomial-tree broadcast.
  2 ceil(log2 N) rounds, each moving the whole tensor.
- ring: ring reduce-scatter, then ring all-gather. 2(N-1) rounds of 1/N of the
  tensor: each rank sends 2(N-1)/N of it, the least any algorithm can.
- halving_doubling: recursive halving (reduce-scatter) then recursive doubling
  (all-gather) among the largest power of two of ranks (Rabenseifner's algorithm).
  2 log2 N rounds, the ring's bytes; surplus ranks fold their data in first.
This is the call a data-parallel engine makes on each gradient bucket after backward.
"""

from __future__ import annotations

import torch

from lockstep.collectives._p2p import (
    Group,
    ReduceOp,
    Workspace,
    check_args,
    chunk_bounds,
    combine_,
    finish_,
    post,
    rank_and_size,
    wait_all,
    workspace_or_new,
)
from lockstep.collectives.broadcast import broadcast_linear, broadcast_tree
from lockstep.collectives.reduce import reduce_tree_
from lockstep.collectives.ring import MAX_SEGMENTS, SEGMENT_BYTES, all_reduce_ring_pipelined


def all_reduce_naive(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: Group = None,
    workspace: Workspace | None = None,
) -> None:
    """Rank 0 receives from each rank in turn, combines, and sends the result to each rank.

    Args:
        tensor: this rank's contribution; overwritten with the result on every rank.
        op: SUM, AVG, PRODUCT, MIN or MAX; combined in the tensor's dtype, in rank order.
        group: the process group; the default group when None.
        workspace: reusable receive buffers; a fresh one when None.

    Raises:
        ValueError: the tensor is not dense and contiguous, or the op is not supported.
    """
    check_args(tensor, op)
    rank, size = rank_and_size(group)
    flat = tensor.view(-1)
    if rank == 0:
        recv = workspace_or_new(workspace).scratch(flat.numel(), flat)
        for peer in range(1, size):
            wait_all(post(group, recv=recv, src=peer))
            combine_(flat, recv, op)
        finish_(flat, op, size)
    else:
        wait_all(post(group, send=flat, dst=0))
    broadcast_linear(tensor, 0, group)


def all_reduce_tree(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: Group = None,
    workspace: Workspace | None = None,
) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from rank 0.

    Args: as `all_reduce_naive`.

    Raises:
        ValueError: the tensor is not dense and contiguous, or the op is not supported.
    """
    check_args(tensor, op)
    flat = tensor.view(-1)
    recv = workspace_or_new(workspace).scratch(flat.numel(), flat)
    reduce_tree_(flat, 0, op, group, recv)
    broadcast_tree(tensor, 0, group)


def all_reduce_ring(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: Group = None,
    workspace: Workspace | None = None,
    segment_bytes: int = SEGMENT_BYTES,
    max_segments: int = MAX_SEGMENTS,
) -> None:
    """Ring reduce-scatter, then ring all-gather, pipelined segment by segment (`ring.py`).

    Args: as `all_reduce_naive`, and
        segment_bytes: chunks are sent in messages of about this size, so that adding one
            segment overlaps the transfer of the next; across nodes use
            `ring.NETWORK_SEGMENT_BYTES`, which keeps both directions of a link busy.
        max_segments: at most this many segments per chunk; larger chunks get larger ones.

    Raises:
        ValueError: the tensor is not dense and contiguous, or the op is not supported.
    """
    check_args(tensor, op)
    _, size = rank_and_size(group)
    if size == 1:
        return
    flat = tensor.view(-1)
    segment_numel = max(1, segment_bytes // flat.element_size())
    workspace = workspace_or_new(workspace)
    all_reduce_ring_pipelined(flat, op, group, workspace, segment_numel, max_segments)


def all_reduce_halving_doubling(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: Group = None,
    workspace: Workspace | None = None,
) -> None:
    """Recursive halving reduce-scatter, then recursive doubling all-gather (Rabenseifner).

    With N not a power of two, let P be the largest power of two below N and
    R = N - P. Ranks 2i and 2i+1 for i < R fold first: the even one sends its
    tensor to the odd one and waits; the P remaining ranks run the algorithm; the
    odd ones then send the result back. See Thakur, Rabenseifner and Gropp,
    "Optimization of Collective Communication Operations in MPICH" (2005).

    Args: as `all_reduce_naive`.

    Raises:
        ValueError: the tensor is not dense and contiguous, or the op is not supported.
    """
    check_args(tensor, op)
    rank, size = rank_and_size(group)
    flat = tensor.view(-1)
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    recv = workspace_or_new(workspace).scratch(flat.numel(), flat)
    if rank < 2 * extra:
        if rank % 2 == 0:
            wait_all(post(group, send=flat, dst=rank + 1))
            wait_all(post(group, recv=flat, src=rank + 1))
            return
        wait_all(post(group, recv=recv, src=rank - 1))
        combine_(flat, recv, op)
    vrank = rank // 2 if rank < 2 * extra else rank - extra
    bounds = chunk_bounds(flat.numel(), pof2)
    lo, hi = _halve(flat, bounds, vrank, pof2, extra, op, group, recv)
    finish_(flat[bounds[lo] : bounds[hi]], op, size)
    _double(flat, bounds, vrank, pof2, extra, group, (lo, hi))
    if rank < 2 * extra:
        wait_all(post(group, send=flat, dst=rank - 1))


def _real_rank(vrank: int, extra: int) -> int:
    """The group rank of a participant of the power-of-two phase."""
    return 2 * vrank + 1 if vrank < extra else vrank + extra


def _halve(
    flat: torch.Tensor,
    bounds: list[int],
    vrank: int,
    pof2: int,
    extra: int,
    op: object,
    group: Group,
    recv: torch.Tensor,
) -> tuple[int, int]:
    """Recursive halving: each round keep half the blocks, trade the other half with a peer.

    Returns the block range [lo, hi) this rank ends owning, reduced: it is [vrank, vrank+1).
    """
    lo, hi = 0, pof2
    mask = pof2 // 2
    while mask > 0:
        peer = _real_rank(vrank ^ mask, extra)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if vrank & mask == 0 else ((mid, hi), (lo, mid))
        a, b = bounds[keep[0]], bounds[keep[1]]
        send = flat[bounds[give[0]] : bounds[give[1]]]
        wait_all(post(group, send, peer, recv[: b - a], peer))
        combine_(flat[a:b], recv[: b - a], op)
        lo, hi = keep
        mask //= 2
    return lo, hi


def _double(
    flat: torch.Tensor,
    bounds: list[int],
    vrank: int,
    pof2: int,
    extra: int,
    group: Group,
    owned: tuple[int, int],
) -> None:
    """Recursive doubling: each round trade the owned blocks with a peer; ownership doubles."""
    lo, hi = owned
    mask = 1
    while mask < pof2:
        peer = _real_rank(vrank ^ mask, extra)
        width = hi - lo
        theirs = (hi, hi + width) if vrank & mask == 0 else (lo - width, lo)
        send = flat[bounds[lo] : bounds[hi]]
        into = flat[bounds[theirs[0]] : bounds[theirs[1]]]
        wait_all(post(group, send, peer, into, peer))
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
        mask *= 2
