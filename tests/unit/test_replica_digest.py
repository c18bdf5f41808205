"""The replica digest: any one flipped bit changes it, and the verdict names who differs.

Every bit position of a float32, bfloat16 and float64 element is flipped in turn;
the tensor's digest and the fold the fingerprint carries must change each time
(the fold is what the ranks compare, below 2**24 so its square fits the all-reduce).
`judge` names the ranks outside a majority, or every rank when there is none.
"""

from __future__ import annotations

import pytest
import torch

from lockstep.runtime.replica_digest import (
    LARGE,
    GroupDigest,
    fold,
    judge,
    tensor_digest,
    weights,
)


def _flip(tensor: torch.Tensor, element: int, bit: int) -> torch.Tensor:
    flipped = tensor.clone()
    words = flipped.view(-1).view(torch.uint8)
    size = tensor.element_size()
    words[element * size + bit // 8] ^= 1 << (bit % 8)
    return flipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_single_bit_flip_changes_the_digest_and_the_fold(dtype):
    tensor = torch.randn(7, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    others = torch.randn(100)
    w = weights(2)
    clean = fold(torch.stack([tensor_digest(tensor), tensor_digest(others)]).long(), w)
    assert all(0 <= v < 2**24 for v in clean.tolist())
    for bit in range(8 * tensor.element_size()):
        flipped = _flip(tensor, 11, bit)
        assert not torch.equal(tensor_digest(flipped), tensor_digest(tensor)), bit
        changed = torch.stack([tensor_digest(flipped), tensor_digest(others)]).long()
        assert not torch.equal(fold(changed, w), clean), bit


def test_a_group_sums_large_tensors_alone_and_small_ones_together_and_follows_updates():
    large, small = torch.zeros(LARGE), [torch.zeros(3, 3), torch.zeros(5)]
    group = GroupDigest([large, *small])
    assert len(group.alone) == 1 and len(group.small) == 2
    before = [p.item() for p in group.parts()]
    small[1][2] = 1.0  # in place: the views made once see it
    assert [p.item() for p in group.parts()] != before


def test_the_verdict_names_the_minority_or_everyone_without_a_majority():
    verdict = judge([[1, 2, 3], [1, 9, 3], [1, 2, 3]])
    assert (verdict.majority, verdict.differing, verdict.first) == ((0, 2), (1,), 1)
    verdict = judge([[1, 2], [1, 3]])
    assert (verdict.majority, verdict.differing, verdict.first) == ((), (0, 1), 1)
    verdict = judge([[4], [4]])
    assert (verdict.majority, verdict.differing, verdict.first) == ((0, 1), (), -1)
