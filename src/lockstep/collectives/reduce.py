"""Reduce (all to one) along a binomial tree: the root ends with op(all ranks' tensors).

The mirror image of the tree broadcast. Ranks are renumbered relative to the
root (v = rank - dst mod N). In round k, every rank whose bit k is set sends its
partial result to v - 2^k and drops out; the rank it reaches combines it into its
own. After ceil(log2 N) rounds the root holds the whole reduction. It is the
first half of the "tree" all-reduce (reduce, then broadcast the result) and the
first step of the hierarchical all-reduce inside each node.
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
    wait_all,
    workspace_or_new,
)


def reduce_tree(
    tensor: torch.Tensor,
    dst: int = 0,
    op: object = ReduceOp.SUM,
    group: Group = None,
    workspace: Workspace | None = None,
) -> None:
    """Reduce every rank's `tensor` into `dst`'s tensor, in place, along a binomial tree.

    As with `torch.distributed.reduce`, only the root's tensor changes; the other
    ranks' tensors are left as they were (ranks that relay partial results work
    on a copy).

    Args:
        tensor: this rank's contribution; on `dst`, overwritten with the result.
        dst: the root, as a rank of `group` (the group's own numbering).
        op: SUM, AVG, PRODUCT, MIN or MAX; combined in the tensor's dtype.
        group: the process group; the default group when None.
        workspace: reusable receive buffers; a fresh one when None.

    Raises:
        ValueError: the tensor is not dense and contiguous, or the op is not supported.
    """
    check_args(tensor, op)
    rank, size = rank_and_size(group)
    vrank = (rank - dst) % size
    flat = tensor.view(-1)
    relays = vrank != 0 and vrank % 2 == 0 and vrank + 1 < size
    if not relays:
        scratch = workspace_or_new(workspace).scratch(flat.numel(), flat)
        reduce_tree_(flat, dst, op, group, scratch)
        return
    scratch = workspace_or_new(workspace).scratch(2 * flat.numel(), flat)
    acc = scratch[flat.numel() :].copy_(flat)
    reduce_tree_(acc, dst, op, group, scratch[: flat.numel()])


def reduce_tree_(acc: torch.Tensor, dst: int, op: object, group: Group, recv: torch.Tensor) -> None:
    """The tree itself: `acc` is combined in place on every rank that has children.

    On the root `acc` ends with the result; on relaying ranks it ends with a
    partial result. `recv` is a buffer shaped like `acc` for the children's data.
    """
    rank, size = rank_and_size(group)
    vrank = (rank - dst) % size
    mask = 1
    while mask < size:
        if vrank & mask:
            wait_all(post(group, send=acc, dst=(rank - mask) % size))
            return
        if vrank + mask < size:
            wait_all(post(group, recv=recv, src=(rank + mask) % size))
            combine_(acc, recv, op)
        mask <<= 1
    finish_(acc, op, size)
