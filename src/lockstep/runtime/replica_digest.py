"""Digests of a replica's tensors, and the verdict on whose replica differs.

A tensor's digest is the sum of its raw bits read as integers (`tensor_digest`: an
int32 view of the same memory, summed modulo 2**32 on the tensor's device; no copy,
no host read). Flipping bit b of one word changes it by 2**b, so it always changes
the sum; a permutation of equal-sized values inside one tensor does not (a fault
that moves values without changing them is not what this is for). A bucket's small
tensors are concatenated and summed once (`GroupDigest`).

The step fingerprint's all-reduce proves equality with sums of v and v*v over the
ranks (`runtime/fingerprint.py`), and v*v must not overflow int64 there. So the
digests are folded into `SLOTS` values below 2**24 (`fold`): each is the weighted
sum, modulo a prime p, of the digests modulo p, the weights 1..65521 by position. A
single flipped bit changes a digest by 2**b or 2**b - 2**32, so the fold by w times
that modulo p, which is never 0 (p is a prime above w, and no power of 2 up to 2**32
is 1 modulo either prime), so it is always seen; two primes make an unrelated change
go unseen once in 2**48. Sums of up to 2**15 ranks stay below 2**63.

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
LARGE = 1 << 16  # elements: a tensor this large is summed alone (`GroupDigest`)


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s memory as one row of int32 words (int16 or uint8 words when its size is
    not a multiple of 4 bytes): a view when it is contiguous (it follows in-place
    updates), else a copy."""
    flat = tensor.detach().reshape(-1)
    if flat.element_size() >= 4 or flat.numel() * flat.element_size() % 4 == 0:
        try:
            return flat.view(torch.int32)
        except RuntimeError:  # not 4-byte aligned
            pass
    return flat.view(_INT_OF_SIZE[flat.element_size()])


def word_sum(words: torch.Tensor) -> torch.Tensor:
    """The sum of `words` (an `int_view`) modulo 2**32, as a 0-dim int32 on their device.

    Summed in the words' own type, which wraps: ten times faster than summing int32
    words in int64 on a CPU, and a flipped bit b still changes the sum by 2**b modulo
    2**32, never 0."""
    total = words.sum(dtype=words.dtype)
    return total if total.dtype == torch.int32 else total.to(torch.int32)


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s digest: the sum of its memory's words (`int_view`, `word_sum`)."""
    return word_sum(int_view(tensor))


class GroupDigest:
    """The digest parts of a fixed group of tensors (a bucket's parameters, the buffers):
    each tensor of `LARGE` elements or more summed alone, the smaller ones concatenated
    and summed once (a sum per small tensor costs more in calls than in reading).

    The views are made once and made again when a tensor's storage was replaced.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self._plan()

    def _plan(self) -> None:
        self.pointers = [t.data_ptr() for t in self.tensors]
        views = [int_view(t) for t in self.tensors]
        small = [v.numel() < LARGE and v.dtype == torch.int32 for v in views]
        self.alone = [v for v, s in zip(views, small, strict=True) if not s]
        self.small = [v for v, s in zip(views, small, strict=True) if s]

    def parts(self) -> list[torch.Tensor]:
        """This group's 0-dim int32 parts, on the tensors' device; no host read."""
        if any(t.data_ptr() != p for t, p in zip(self.tensors, self.pointers, strict=True)):
            self._plan()
        found = [word_sum(v) for v in self.alone]
        if self.small:
            found.append(torch.cat(self.small).sum(dtype=torch.int32))
        return found


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
