"""Where the non-finite check reads a bucket: large slots in their hook, runs of the rest.

`plan` is a pure function of the slots' sizes: every element of the bucket must be
read exactly once, by a hook read (a large slot) or by one run (neighbouring small
slots), and a run never spans a large slot.
"""

from __future__ import annotations

import pytest

from lockstep.runtime.finite_reads import plan

KIB = 1024


def _covered(sizes: list[int], element_size: int, hot: int) -> list[int]:
    """How many times each element is read under the plan."""
    reads = [0] * sum(sizes)
    p = plan(sizes, element_size, hot)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for position in p.in_hook:
        for e in range(offsets[position], offsets[position] + sizes[position]):
            reads[e] += 1
    for start, end in p.runs:
        for e in range(start, end):
            reads[e] += 1
    return reads


@pytest.mark.parametrize(
    "sizes",
    [[1], [1024], [4, 1024, 4, 1024, 4], [1024, 1024], [3, 5, 7], [0, 1024, 0, 2], [2, 0, 2]],
)
def test_every_element_is_read_once(sizes):
    assert _covered(sizes, 4, 1 * KIB) == [1] * sum(sizes)


def test_large_slots_go_to_hooks_and_the_small_ones_between_them_to_runs():
    p = plan([4, 256, 4, 4, 256, 4], 4, 1 * KIB)  # 256 floats = 1 KiB: large
    assert p.in_hook == (1, 4)
    assert p.runs == ((0, 4), (260, 268), (524, 528))


def test_a_bucket_of_small_slots_is_one_run_and_no_hook_read():
    p = plan([64] * 100, 4, 1 * KIB)
    assert p.in_hook == ()
    assert p.runs == ((0, 6400),)


def test_a_threshold_out_of_reach_reads_the_bucket_whole():
    assert plan([1 << 20, 4], 4, 1 << 62).runs == ((0, (1 << 20) + 4),)
