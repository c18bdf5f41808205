"""Refusals at wrap time, with torch's exception types, checked against torch's own class.

Each bad call is made with lockstep's class and with torch's: both must raise the
same exception type (lockstep's message may be clearer, its type may not differ).
Calls that only lockstep refuses, or that torch accepts and lockstep refuses, are
listed apart with the reason.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from engine_models import MLP
from torch import nn

import lockstep
from lockstep.testing import run_ranks


def _bad_calls(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = MLP()
    return {
        "no trainable parameter": lambda cls: cls(MLP().requires_grad_(False)),
        "device_ids on a CPU module": lambda cls: cls(MLP(), device_ids=[0]),
        "two device_ids": lambda cls: cls(MLP(), device_ids=[0, 1]),
        "process_group and device_mesh": lambda cls: cls(
            MLP(), process_group=torch.distributed.group.WORLD, device_mesh=mesh
        ),
        "delayed without the hook parameter": lambda cls: cls(
            model, delay_all_reduce_named_params=list(model.named_parameters())[:1]
        ),
    }


def _refusals(ctx):
    out = {}
    for what, call in _bad_calls(ctx.world_size).items():
        for engine, cls in [
            ("lockstep", lockstep.DistributedDataParallel),
            ("torch", nn.parallel.DistributedDataParallel),
        ]:
            try:
                call(cls)
                out[(what, engine)] = None
            except Exception as error:  # the type is what is compared
                out[(what, engine)] = (type(error).__name__, str(error))
    return out


@pytest.fixture(scope="module")
def refusals():
    return run_ranks(_refusals, 2)[0]


def test_every_refusal_has_torchs_type(refusals):
    whats = sorted({what for what, _ in refusals})
    assert len(whats) == 5
    for what in whats:
        ours, theirs = refusals[(what, "lockstep")], refusals[(what, "torch")]
        assert theirs is not None, f"torch accepted {what}"
        assert ours is not None, f"lockstep accepted {what}; torch raised {theirs}"
        assert ours[0] == theirs[0], f"{what}: lockstep {ours}, torch {theirs}"


def _late_and_odd(ctx):
    ddp = lockstep.DistributedDataParallel(MLP())
    ddp(torch.randn(2, 8)).sum().backward()
    errors = {}
    try:
        ddp._set_static_graph()
    except RuntimeError as error:
        errors["static_graph late"] = str(error)
    try:
        lockstep.DistributedDataParallel(MLP(), mixed_precision="bf16")
    except ValueError as error:
        errors["mixed_precision not a config"] = str(error)
    group = torch.distributed.new_group([0, 1])
    try:
        pickle.dumps(lockstep.DistributedDataParallel(MLP(), process_group=group))
    except RuntimeError as error:
        errors["pickle with another group"] = str(error)
    return errors


def test_late_static_graph_bad_config_and_pickling_another_group_are_refused():
    errors = run_ranks(_late_and_odd, 2)[0]
    assert "before the first forward" in errors["static_graph late"]
    assert "_MixedPrecision" in errors["mixed_precision not a config"]
    assert "default process group" in errors["pickle with another group"]


def _deprecations(ctx):
    import warnings

    out = {}
    for engine, cls in [
        ("lockstep", lockstep.DistributedDataParallel),
        ("torch", nn.parallel.DistributedDataParallel),
    ]:
        for kwargs in ({"check_reduction": True}, {"broadcast_buffers": True}):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cls(MLP(), **kwargs)
            key = (engine, next(iter(kwargs)))
            out[key] = sorted({w.category.__name__ for w in caught if w.category is FutureWarning})
    return out


def test_deprecated_arguments_warn_as_torch_does():
    out = run_ranks(_deprecations, 2)[0]
    for argument in ("check_reduction", "broadcast_buffers"):
        assert out[("lockstep", argument)] == out[("torch", argument)] == ["FutureWarning"]
