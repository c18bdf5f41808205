"""The non-finite check's slow path names ranks and parameters from what every rank saw.

`attribute` is a pure function (no processes): each rank reports the buckets whose
local sum was not finite on it and the parameters whose averaged gradient is not
finite in the part of the results it holds (all of it under DDP, its shard under the
sharded engine). A rank is named with the non-finite parameters of its own buckets.
"""

from __future__ import annotations

from lockstep.runtime.finite import Finding, Report, attribute, describe


def test_one_rank_is_named_with_the_parameters_of_its_buckets_only():
    seen = [(0, "a", "NaN"), (2, "c", "inf")]
    reports = [Report(0, [], seen), Report(1, [0], seen), Report(2, [], seen)]
    assert attribute(reports) == [[], [Finding(1, "a", "NaN")], []]


def test_a_shard_seen_by_another_rank_still_names_the_parameter():
    # sharded: rank 1 flagged bucket 3, whose non-finite piece lies in rank 0's shard
    reports = [Report(0, [], [(3, "w", "inf")]), Report(1, [3], [])]
    assert attribute(reports) == [[], [Finding(1, "w", "inf")]]


def test_a_bucket_whose_sum_overflowed_names_nothing():
    reports = [Report(0, [1], []), Report(1, [], [])]
    assert attribute(reports) == [[], []]


def test_the_message_names_the_step_the_rank_and_the_first_parameter():
    everyone = [[], [Finding(1, "fc.weight", "NaN"), Finding(1, "fc.bias", "NaN")]]
    message = describe(everyone, 5, 0)
    assert "step 5" in message and "rank(s) 1's own gradients" in message
    assert "rank 1: 'fc.weight' holds NaN (and 1 more parameter(s))" in message
    assert "Ranks with finite gradients: 0." in message and "raised on rank 0" in message
