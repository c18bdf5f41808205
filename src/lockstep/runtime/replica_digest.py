"""Digests of a replica's tensors, and the verdict on whose replica differs.

A tensor's digest is the sum of its raw bits read as integers (`tensor_digest`: an
integer view of the same memory, summed in int64 on the tensor's device; no copy,
no host read). Flipping one bit of one element changes one integer by 2**b, so it
always changes the sum; a permutation of equal-sized values inside one tensor does
not (a fault that moves values without changing them is not what this is for).

The step fingerprint's all-reduce proves equality with sums of v and v*v over the
ranks (`runtime/fingerprint.py`), and v*v must not overflow int64 there. So the
per-tensor digests are folded into `SLOTS` values below 2**24 (`fold`): each is the
weighted sum, modulo a prime p, of the digests modulo p, the weights 1..65521 by
position. A single flipped bit changes the fold by w * 2**b modulo p, which is never
0 (p is prime and larger than w), so it is always seen; two primes make an unrelated
change go unseen once in 2**48. Sums of up to 2**15 ranks stay below 2**63.

`judge` reads every rank's per-tensor digests (the slow path, only when the folded
ones differed) and names the ranks that differ from the majority and the first
tensor where they do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PRIMES = (16777213, 16777199)  # the two largest primes below 2**24
SLOTS = len(PRIMES)
_WEIGHT_SPAN = 65521  # weights 1..65521: w * (p - 1) * 2**23 tensors < 2**63
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16}  # 4 bytes and more: int32 words


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s memory as one row of int32 words (int16 or uint8 for smaller elements):
    a view when it is contiguous (it follows in-place updates), else a copy."""
    flat = tensor.detach().reshape(-1)
    return flat.view(_INT_OF_SIZE.get(flat.element_size(), torch.int32))


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor`'s bits as integers (`int_view`), in int64, on its device
    (0-dim). Exact below 2**32 elements."""
    return int_view(tensor).sum(dtype=torch.int64)


def weights(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The position weights of `count` digests (1..65521, repeating)."""
    return torch.arange(count, dtype=torch.int64, device=device) % _WEIGHT_SPAN + 1


def fold(digests: torch.Tensor, position_weights: torch.Tensor) -> torch.Tensor:
    """`SLOTS` int64 values in [0, 2**24) that stand for every digest in `digests`."""
    return torch.stack(
        [(torch.remainder(digests, p) * position_weights).sum().remainder(p) for p in PRIMES]
    )


def host_digest(value: object) -> int:
    """A digest read by the host (checkpoints): a tensor's `tensor_digest`, an int's
    value, a float's bits, anything else the sum of its repr's bytes."""
    if isinstance(value, torch.Tensor):
        return int(tensor_digest(value).item())
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return int(torch.tensor(value, dtype=torch.float64).view(torch.int64).item())
    return sum(repr(value).encode())


@dataclass(frozen=True)
class Verdict:
    """Who differs, from every rank's per-tensor digests.

    Attributes:
        majority: the ranks of the largest group holding the same digests, if it is more
            than half of the ranks; empty when no group is (two replicas that differ).
        differing: the ranks outside the majority (every rank when there is none).
        first: the index of the first tensor where a differing rank differs (from the
            majority, or, without one, from the lowest rank), -1 if none was found.
    """

    majority: tuple[int, ...]
    differing: tuple[int, ...]
    first: int


def judge(table: Sequence[Sequence[int]]) -> Verdict:
    """The verdict on `table` (per rank, its per-tensor digests, in the same order)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(table):
        groups.setdefault(tuple(row), []).append(rank)
    largest = max(groups.values(), key=len)
    if len(groups) == 1:
        return Verdict(tuple(largest), (), -1)
    if 2 * len(largest) > len(table):
        reference = table[largest[0]]
        differing = tuple(r for r in range(len(table)) if r not in largest)
        majority = tuple(largest)
    else:
        reference, differing, majority = table[0], tuple(range(len(table))), ()
    first = min(
        (
            i
            for r in differing
            for i, (a, b) in enumerate(zip(table[r], reference, strict=True))
            if a != b
        ),
        default=-1,
    )
    return Verdict(majority, differing, first)
