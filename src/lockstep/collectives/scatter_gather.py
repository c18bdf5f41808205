"""Reduce-scatter and all-gather on a ring: the two halves of the bandwidth-optimal all-reduce.

The tensor is cut into N chunks (near-equal when its length does not divide).
Reduce-scatter: in each of N-1 steps every rank sends one chunk's partial result
to its right neighbour and adds the one arriving from its left; afterwards rank r
holds chunk r reduced over all ranks. All-gather: N-1 more steps pass the
finished chunks around the ring until every rank has all of them. Each rank
sends (N-1)/N of the tensor per half. The ring all-reduce of a gradient bucket
runs the same two halves as one pipeline (`ring.py`); here they stand alone.
"""

from __future__ import annotations

import torch

from lockstep.collectives._p2p import (
    Group,
    ReduceOp,
    Workspace,
    check_args,
    combine_,
    finish_,
    post,
    rank_and_size,
    segments,
    wait_all,
    workspace_or_new,
)
from lockstep.collectives.ring import MAX_SEGMENTS, SEGMENT_BYTES


def _segment_numel(flat: torch.Tensor, bounds: list[int], segment_bytes: int) -> int:
    """Elements per message: about segment_bytes, but at most MAX_SEGMENTS per chunk."""
    largest = max(bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1))
    return max(1, segment_bytes // flat.element_size(), -(-largest // MAX_SEGMENTS))


def ring_reduce_scatter_(
    flat: torch.Tensor,
    bounds: list[int],
    op: object,
    group: Group,
    recv: torch.Tensor,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """In place: chunk `rank` of `flat` ends reduced over all ranks; other chunks hold partials.

    Args:
        flat: a 1-D contiguous tensor; the same length on every rank.
        bounds: N+1 chunk boundaries (`chunk_bounds`); chunk i is flat[bounds[i]:bounds[i+1]].
        op: the reduction (`_p2p.SUPPORTED_OPS`).
        group: the process group; the default group when None.
        recv: a receive buffer of at least the largest chunk's length.
        segment_bytes: the size of the messages a step is cut into.
    """
    rank, size = rank_and_size(group)
    seg = _segment_numel(flat, bounds, segment_bytes)
    for step in range(size - 1):
        send_c = (rank - step - 1) % size
        recv_c = (rank - step - 2) % size
        sends = segments(bounds[send_c], bounds[send_c + 1], seg)
        recvs = segments(bounds[recv_c], bounds[recv_c + 1], seg)
        base = bounds[recv_c]
        batches = []
        for i in range(max(len(sends), len(recvs))):
            send = flat[sends[i][0] : sends[i][1]] if i < len(sends) else None
            into = recv[recvs[i][0] - base : recvs[i][1] - base] if i < len(recvs) else None
            batches.append(post(group, send, (rank + 1) % size, into, (rank - 1) % size))
        for i, works in enumerate(batches):
            wait_all(works)
            if i < len(recvs):
                a, b = recvs[i]
                combine_(flat[a:b], recv[a - base : b - base], op)
    finish_(flat[bounds[rank] : bounds[rank + 1]], op, size)


def ring_all_gather_(
    flat: torch.Tensor, bounds: list[int], group: Group, segment_bytes: int = SEGMENT_BYTES
) -> None:
    """In place: every rank's chunk `rank` of `flat` is copied into the same chunk on all ranks.

    Args:
        flat: a 1-D contiguous tensor; chunk `rank` holds this rank's part.
        bounds: N+1 chunk boundaries, the same on every rank.
        group: the process group; the default group when None.
        segment_bytes: the size of the messages a step is cut into.
    """
    rank, size = rank_and_size(group)
    seg = _segment_numel(flat, bounds, segment_bytes)
    for step in range(size - 1):
        send_c = (rank - step) % size
        recv_c = (rank - step - 1) % size
        sends = segments(bounds[send_c], bounds[send_c + 1], seg)
        recvs = segments(bounds[recv_c], bounds[recv_c + 1], seg)
        works = []
        for i in range(max(len(sends), len(recvs))):
            send = flat[sends[i][0] : sends[i][1]] if i < len(sends) else None
            into = flat[recvs[i][0] : recvs[i][1]] if i < len(recvs) else None
            works += post(group, send, (rank + 1) % size, into, (rank - 1) % size)
        wait_all(works)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: Group = None,
    workspace: Workspace | None = None,
) -> None:
    """Like `torch.distributed.reduce_scatter_single`: output = op over ranks of input chunk r.

    Args:
        output: this rank's result, `input.numel() / N` elements; overwritten.
        input: N equal chunks, one per rank, left unchanged.
        op: SUM, AVG, PRODUCT, MIN or MAX; combined in the tensor's dtype.
        group: the process group; the default group when None.
        workspace: reusable buffers (a working copy of `input` and a receive buffer).

    Raises:
        ValueError: sizes or dtypes disagree, or a tensor is not dense and contiguous.
    """
    check_args(input, op)
    check_args(output)
    rank, size = rank_and_size(group)
    n = output.numel()
    if input.numel() != size * n or input.dtype != output.dtype:
        raise ValueError(
            f"reduce_scatter expects input of {size} x output.numel() = {size * n} elements "
            f"and one dtype; found input {input.numel()} {input.dtype}, output {output.dtype}"
            f" on rank {rank}"
        )
    buffer = workspace_or_new(workspace).scratch((size + 1) * n, input)
    acc = buffer[: size * n].copy_(input.view(-1))
    ring_reduce_scatter_(acc, [i * n for i in range(size + 1)], op, group, buffer[size * n :])
    output.view(-1).copy_(acc[rank * n : (rank + 1) * n])


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = None) -> None:
    """Like `torch.distributed.all_gather_single`: output chunk r = rank r's input.

    Args:
        output: N x input.numel() elements; overwritten. `input` may be a view of its chunk.
        input: this rank's part.
        group: the process group; the default group when None.

    Raises:
        ValueError: sizes or dtypes disagree, or a tensor is not dense and contiguous.
    """
    check_args(input)
    check_args(output)
    rank, size = rank_and_size(group)
    n = input.numel()
    if output.numel() != size * n or input.dtype != output.dtype:
        raise ValueError(
            f"all_gather expects output of {size} x input.numel() = {size * n} elements and "
            f"one dtype; found output {output.numel()} {output.dtype}, input {input.dtype}"
            f" on rank {rank}"
        )
    flat = output.view(-1)
    flat[rank * n : (rank + 1) * n].copy_(input.view(-1))
    ring_all_gather_(flat, [i * n for i in range(size + 1)], group)
