"""Bucket assignment is a pure function: checked here without any process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lockstep.runtime.bucketing import (
    MB,
    ParamSpec,
    assign_buckets,
    param_specs,
    trainable_parameters,
)


def _spec(i: int, nbytes: int, dtype=torch.float32, device="cpu") -> ParamSpec:
    size = torch.tensor([], dtype=dtype).element_size()
    return ParamSpec(i, f"p{i}", nbytes // size, size, dtype, torch.device(device))


def test_reverse_registration_order_and_first_cap():
    specs = [_spec(i, 400) for i in range(6)]
    # first cap 500 B closes after two params (800 >= 500); later cap 1000 B after three.
    assert assign_buckets(specs, first_cap_bytes=500, cap_bytes=1000) == [[5, 4], [3, 2, 1], [0]]


def test_parameter_is_never_split_and_big_one_gets_own_bucket():
    specs = [_spec(0, 100), _spec(1, 10_000), _spec(2, 100)]
    buckets = assign_buckets(specs, first_cap_bytes=150, cap_bytes=150)
    assert buckets == [[2, 1], [0]]
    assert sorted(i for b in buckets for i in b) == [0, 1, 2]


def test_separate_buckets_per_dtype_and_device():
    specs = [
        _spec(0, 400),
        _spec(1, 400, torch.float16),
        _spec(2, 400),
        _spec(3, 400, torch.float16),
    ]
    buckets = assign_buckets(specs, first_cap_bytes=10 * MB, cap_bytes=10 * MB)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]
    for bucket in buckets:
        assert len({specs[i].dtype for i in bucket}) == 1


def test_explicit_order_is_followed():
    specs = [_spec(i, 400) for i in range(4)]
    assert assign_buckets(specs, [1, 3, 0, 2], first_cap_bytes=800, cap_bytes=800) == [
        [1, 3],
        [0, 2],
    ]


def test_huge_cap_gives_one_bucket_tiny_cap_one_per_param():
    specs = [_spec(i, 400) for i in range(5)]
    assert assign_buckets(specs, first_cap_bytes=1 << 40, cap_bytes=1 << 40) == [[4, 3, 2, 1, 0]]
    assert assign_buckets(specs, first_cap_bytes=1, cap_bytes=1) == [[4], [3], [2], [1], [0]]


@pytest.mark.parametrize("bad", [{"first_cap_bytes": 0}, {"cap_bytes": -1}])
def test_bad_caps_are_rejected(bad):
    with pytest.raises(ValueError, match="bucket caps must be positive"):
        assign_buckets([_spec(0, 4)], **bad)


def test_bad_order_is_rejected():
    with pytest.raises(ValueError, match="each of the 2 parameter indices once"):
        assign_buckets([_spec(0, 4), _spec(1, 4)], [0, 0])


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_trainable_parameters_skip_frozen_and_count_tied_once():
    named = trainable_parameters(_Tied())
    assert [name for name, _ in named] == ["embed.weight"]
    specs = param_specs(named)
    assert specs[0].nbytes == 10 * 4 * 4


def test_cap_list_gives_each_bucket_its_own_cap():
    """torch's bucket_cap_mb_list: bucket k uses caps[k], the last cap for all later ones."""
    specs = param_specs([(f"p{i}", torch.zeros(25)) for i in range(6)])  # 100 bytes each
    layout = assign_buckets(specs, cap_list=[100, 300])
    assert layout == [[5], [4, 3, 2], [1, 0]]
