"""Broadcast (one to all): the root's tensor is copied into every rank's tensor, in place.

Two algorithms. Linear: the root sends the whole tensor to each other rank, so
its link carries (N-1) copies, one after another: N-1 rounds. Binomial tree:
every rank that has the data sends it on, doubling the informed ranks each
round: ceil(log2 N) rounds. In a training step, broadcast copies rank 0's
parameters to every replica before the first step, and it is the second half
of the reduce-then-broadcast all-reduce.
"""

from __future__ import annotations

import torch

from lockstep.collectives._p2p import Group, check_args, post, rank_and_size, wait_all


def broadcast_linear(tensor: torch.Tensor, src: int = 0, group: Group = None) -> None:
    """Copy `src`'s tensor into every rank's `tensor`: the root sends to each rank directly.

    Args:
        tensor: the data on `src`; overwritten with it on the other ranks.
        src: the root, as a rank of `group` (the group's own numbering).
        group: the process group; the default group when None.

    Raises:
        ValueError: the tensor is not dense and contiguous.
    """
    check_args(tensor)
    rank, size = rank_and_size(group)
    if rank != src:
        wait_all(post(group, recv=tensor, src=src))
        return
    works = []
    for peer in range(size):
        if peer != src:
            works += post(group, send=tensor, dst=peer)
    wait_all(works)


def broadcast_tree(tensor: torch.Tensor, src: int = 0, group: Group = None) -> None:
    """Copy `src`'s tensor into every rank's `tensor` along a binomial tree.

    Ranks are renumbered relative to the root (v = rank - src mod N). Rank v
    receives from v - m, where m is v's lowest set bit, then sends to v + m/2,
    v + m/4, ..., 1 (those below N). The root sends to N/2-ish, N/4-ish, ... first.

    Args:
        tensor: the data on `src`; overwritten with it on the other ranks.
        src: the root, as a rank of `group` (the group's own numbering).
        group: the process group; the default group when None.

    Raises:
        ValueError: the tensor is not dense and contiguous.
    """
    check_args(tensor)
    rank, size = rank_and_size(group)
    vrank = (rank - src) % size
    mask = 1
    while mask < size:
        if vrank & mask:
            wait_all(post(group, recv=tensor, src=(rank - mask) % size))
            break
        mask <<= 1
    works = []
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            works += post(group, send=tensor, dst=(rank + mask) % size)
        mask >>= 1
    wait_all(works)
