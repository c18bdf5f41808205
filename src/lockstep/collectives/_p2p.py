"""The small pieces every algorithm here shares: ranks, chunk bounds, exchanges, reduction ops.

Each collective in this package is a loop of point-to-point sends and receives
on a process group. This module holds what those loops have in common: the
rank arithmetic (always in the group's own numbering), how a flat tensor is cut
into per-rank chunks when its length does not divide, the posting and waiting of
sends and receives, the element-wise combination of a received partial result,
and a `Workspace` of receive buffers that is allocated once and reused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
Group = dist.ProcessGroup | None


def _add(acc: torch.Tensor, other: torch.Tensor) -> None:
    acc.add_(other)


def _mul(acc: torch.Tensor, other: torch.Tensor) -> None:
    acc.mul_(other)


def _min(acc: torch.Tensor, other: torch.Tensor) -> None:
    torch.minimum(acc, other, out=acc)


def _max(acc: torch.Tensor, other: torch.Tensor) -> None:
    torch.maximum(acc, other, out=acc)


# AVG combines as SUM; `finish_` divides once the sum is complete.
_COMBINE: dict[object, Callable[[torch.Tensor, torch.Tensor], None]] = {
    ReduceOp.SUM: _add,
    ReduceOp.AVG: _add,
    ReduceOp.PRODUCT: _mul,
    ReduceOp.MIN: _min,
    ReduceOp.MAX: _max,
}
SUPPORTED_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def rank_and_size(group: Group) -> tuple[int, int]:
    """This process's rank in `group` (the group's own numbering) and the group's size."""
    return dist.get_rank(group), dist.get_world_size(group)


def check_args(tensor: torch.Tensor, op: object = ReduceOp.SUM) -> None:
    """Raise ValueError for a tensor or op that these algorithms cannot handle.

    Raises:
        ValueError: the tensor is not dense and contiguous, or the op is not supported
            (AVG needs a floating-point tensor).
    """
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError(
            "lockstep.collectives expects a dense, contiguous tensor; found "
            f"layout={tensor.layout}, contiguous={tensor.is_contiguous()} on rank "
            f"{dist.get_rank()}. Call .contiguous() first and copy the result back."
        )
    if op not in _COMBINE:
        raise ValueError(f"expected a ReduceOp among {', '.join(SUPPORTED_OPS)}; found {op}")
    if op == ReduceOp.AVG and not tensor.is_floating_point():
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor; found {tensor.dtype}")


def combine_(acc: torch.Tensor, other: torch.Tensor, op: object) -> None:
    """acc = op(acc, other), element-wise and in place, in acc's dtype."""
    _COMBINE[op](acc, other)


def finish_(tensor: torch.Tensor, op: object, world_size: int) -> None:
    """Complete a reduction that is whole: AVG divides the sum by the group's size."""
    if op == ReduceOp.AVG:
        tensor.div_(world_size)


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """Boundaries of `parts` near-equal chunks of `numel` elements; the first ones get the extra.

    Chunk i is [bounds[i], bounds[i + 1]). Some chunks are empty when numel < parts.
    """
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def segments(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """[start, end) cut into pieces of at most `size` elements (none when it is empty)."""
    return [(a, min(a + size, end)) for a in range(start, end, size)]


def post(
    group: Group,
    send: torch.Tensor | None = None,
    dst: int | None = None,
    recv: torch.Tensor | None = None,
    src: int | None = None,
) -> list[dist.Work]:
    """Start sending `send` to group rank `dst` and receiving `recv` from group rank `src`.

    Empty tensors are skipped on both sides (both sides know the sizes), so no
    zero-byte message is ever posted. Returns the handles to `wait()` on.
    """
    ops = []
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=dst))
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=src))
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def wait_all(works: list[dist.Work]) -> None:
    """Block until every handle in `works` has completed."""
    for work in works:
        work.wait()


class Workspace:
    """Receive buffers, allocated once and reused: one growing flat buffer per dtype and device.

    An algorithm asks for `scratch(numel, like)` and gets a view of the cached
    buffer; a later call may return the same memory, so a caller uses a scratch
    only until its next call. Not thread-safe: give each thread its own.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat tensor of `numel` elements with `like`'s dtype and device; contents undefined."""
        key = (like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
        return buffer[:numel]


def workspace_or_new(workspace: Workspace | None) -> Workspace:
    """The given workspace, or a fresh one for a single call."""
    return workspace if workspace is not None else Workspace()
