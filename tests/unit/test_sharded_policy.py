"""The pure parts of the policy and of per-unit resharding: dtypes, rules, the plan's bytes.

FSDP2's dtype rules per flat (no cast for non-floating flats; reduce defaults
to the compute dtype), the reshard rule by bool, int, class, name and callable
(an int other than 1 or the world size refused with the reason), and the plan's
per-GPU bytes under a policy (`lockstep plan --param-dtype`).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

import lockstep
from lockstep.cli import main
from lockstep.plan.memory import StateBytes, Strategy
from lockstep.plan.policy_memory import with_policy
from lockstep.plan.units import DType
from lockstep.sharded.precision import as_policy, flat_dtypes
from lockstep.sharded.reshard import resolve_reshard

BF16, FP32 = torch.bfloat16, torch.float32


def test_flat_dtypes_follow_fsdp2():
    policy = lockstep.MixedPrecisionPolicy(param_dtype=BF16)
    d = flat_dtypes(policy, FP32)
    assert (d.orig, d.param, d.reduce, d.casts) == (FP32, BF16, BF16, True)
    mixed = flat_dtypes(lockstep.MixedPrecisionPolicy(BF16, FP32), FP32)
    assert (mixed.param, mixed.reduce) == (BF16, FP32)
    ints = flat_dtypes(policy, torch.int64)
    assert (ints.param, ints.reduce, ints.differ) == (torch.int64, torch.int64, False)
    assert not flat_dtypes(None, FP32).differ


def test_torch_policy_is_taken_and_other_objects_refused():
    ours = as_policy(TorchPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=FP32))
    assert ours == lockstep.MixedPrecisionPolicy(BF16, FP32, FP32, True)
    with pytest.raises(TypeError, match="mp_policy expects"):
        as_policy({"param_dtype": BF16})
    with pytest.raises(ValueError, match=r"floating torch\.dtype"):
        lockstep.MixedPrecisionPolicy(param_dtype=torch.int8)


class Block(nn.Linear):
    pass


UNITS = [("blocks.0", Block(2, 2)), ("blocks.1", Block(2, 2)), ("head", nn.Linear(2, 2))]


@pytest.mark.parametrize(
    "rule, expected",
    [
        (True, [True, True, True]),
        (False, [False, False, False]),
        (1, [False, False, False]),  # FSDP2: a world of 1 is False
        (4, [True, True, True]),  # the world size is True
        ({Block: False}, [False, False, True]),
        ({"head": False, Block: True}, [True, True, False]),
        (lambda name, module: name == "blocks.1" or None, [True, True, True]),
        (lambda name, module: False if name.startswith("blocks") else None, [False, False, True]),
    ],
)
def test_reshard_rule_per_unit(rule, expected):
    assert list(resolve_reshard(rule, UNITS, 4).values()) == expected


def test_reshard_rule_refusals_say_why():
    with pytest.raises(ValueError, match="world of 2 ranks is not supported on the flat layout"):
        resolve_reshard(2, UNITS, 4)
    with pytest.raises(ValueError, match=r"keys \['blocks\.7'\] match no wrapped unit"):
        resolve_reshard({"blocks.7": False}, UNITS, 4)
    with pytest.raises(ValueError, match="expects a bool or an int"):
        resolve_reshard({Block: "no"}, UNITS, 4)


def test_plan_under_a_policy_keeps_fp32_shards_and_a_bf16_compute_copy():
    full = StateBytes(weights=400.0, grads=400.0, optimizer=800.0)
    args = (100, 100, DType.FP32, DType.BF16, DType.FP32, 4)
    zero2 = with_policy(full, Strategy.ZERO2, *args)
    assert (zero2.weights, zero2.grads, zero2.optimizer) == (100 + 200, 100, 800)
    zero3 = with_policy(full, Strategy.ZERO3, *args)
    assert (zero3.weights, zero3.grads) == (100, 100)
    assert with_policy(full, Strategy.DDP, *args) == full
    # no cast, a bf16 reduce: ZeRO-1 keeps no whole reduced gradient, weights unchanged
    zero1 = with_policy(full, Strategy.ZERO1, 100, 100, DType.FP32, None, DType.BF16, 4)
    assert (zero1.weights, zero1.grads) == (400, 100)
    assert with_policy(full, Strategy.ZERO1, 100, 100, DType.FP32, None, None, 4) == full


def test_plan_cli_takes_the_policy_and_the_kept_units(capsys):
    argv = ["plan", "--model", "1B", "--gpus", "4", "--weights-dtype", "fp32"]
    assert (
        main(
            [
                *argv,
                "--param-dtype",
                "bf16",
                "--reduce-dtype",
                "fp32",
                "--keep-gathered",
                "25%",
                "--json",
                "-",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["policy"] == {"param": "bf16", "reduce": "fp32"}
    assert doc["gathered_bytes"] == 0.25e9 * 2
    assert doc["memory"]["zero2"]["weights_bytes"] == 1e9 * 4 / 4 + 1e9 * 2
    assert doc["memory"]["zero3"]["grads_bytes"] == 1e9 * 4 / 4
    assert doc["bytes_per_param"]["grads"] == 4  # the payload: the reduce dtype
