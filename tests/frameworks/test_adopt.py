"""The switch itself: off by default, on when asked, and torch's class name kept.

Two gloo ranks (which imported lockstep without LOCKSTEP_ENGINE) show torch's class
untouched until `install()`, then what a framework relies on: `isinstance`, `.module`,
torch's `state_dict` keys, the reducer's `prepare_for_backward`, a deep copy, a clear
refusal for torch's other internals, and torch's engine again after `uninstall()`.
The launch tests show the variable turning it on; bad values are refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from lockstep import adopt
from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # frameworks' imports and ranks: make test, not the inner loop


def test_the_variables_values():
    assert adopt.engine_from_env({}) == "torch"
    assert adopt.engine_from_env({adopt.ENGINE_VARIABLE: "lockstep"}) == "lockstep"
    with pytest.raises(ValueError, match="LOCKSTEP_ENGINE must be one of"):
        adopt.engine_from_env({adopt.ENGINE_VARIABLE: "lockstep2"})
    with pytest.raises(NotImplementedError, match="not supported yet"):
        adopt.engine_from_env({adopt.ENGINE_VARIABLE: "sharded"})


def test_a_bad_value_read_from_the_process_environment_is_a_value_error(monkeypatch):
    """The default path (no mapping given) reads os.environ; it once raised AttributeError."""
    monkeypatch.setenv(adopt.ENGINE_VARIABLE, "lockstep2")
    with pytest.raises(ValueError, match=r"found 'lockstep2' \(rank \?\)"):
        adopt.engine_from_env()


def _adopted(ctx) -> dict:
    # The ranks imported lockstep without LOCKSTEP_ENGINE: torch's class is untouched.
    untouched = "__new__" not in vars(TorchDDP) and not adopt.installed()
    adopt.install()
    try:
        torch.manual_seed(0)
        model = TorchDDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
        out = {"isinstance": isinstance(model, TorchDDP), "class": type(model).__name__}
        out["keys"] = list(model.state_dict())
        out["module"] = type(model.module).__name__
        with model.no_sync():
            loss = model(torch.full((2, 4), float(ctx.rank))).sum()
        model.reducer.prepare_for_backward([])  # as accelerate's trigger_sync_in_backward
        loss.backward()
        out["grad"] = model.module[0].weight.grad.clone()
        out["copy"] = type(copy.deepcopy(model)).__name__
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        out["comm_hook"] = model._get_ddp_logging_data()["comm_hook"]  # as Lightning reads it
        try:
            model._register_fused_optim(torch.optim.SGD, lr=0.1)
        except NotImplementedError as exc:
            out["refusal"] = str(exc)
    finally:
        adopt.uninstall()
    theirs = TorchDDP(nn.Linear(2, 2))
    out["after"] = type(theirs).__name__
    theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out["torch_comm_hook"] = theirs._get_ddp_logging_data()["comm_hook"]
    out["untouched"] = untouched
    return out


def test_torchs_constructor_builds_lockstep_engine_where_frameworks_look():
    per_rank = run_ranks(_adopted, 2, deadline_s=60)
    for out in per_rank:
        assert out["untouched"], "importing lockstep without LOCKSTEP_ENGINE changed torch"
        assert out["isinstance"] and out["class"] == "TorchFacedDDP"
        assert out["keys"][0] == "module.0.weight" and out["module"] == "Sequential"
        assert out["copy"] == "TorchFacedDDP" and out["after"] == "DistributedDataParallel"
        assert "_register_fused_optim" in out["refusal"] and "LOCKSTEP_ENGINE" in out["refusal"]
        assert out["comm_hook"] == out["torch_comm_hook"] == "fp16_compress_hook", out
    # prepare_for_backward armed the backward after no_sync: the gradients were averaged.
    assert torch.equal(per_rank[0]["grad"], per_rank[1]["grad"])


def _mixed(ctx) -> dict:
    """Rank 0 adopted, rank 1 not (a rank a framework started without the adoption)."""
    if ctx.rank == 0:
        adopt.install()
    try:
        TorchDDP(nn.Linear(4, 2))
    except RuntimeError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    finally:
        adopt.uninstall()
    return {"type": None}


def test_ranks_that_built_different_engines_stop_at_the_wrap_naming_them():
    """Neither hangs: lockstep's first collective has the shape of torch's first."""
    ours, theirs = run_ranks(_mixed, 2, deadline_s=60)
    assert ours["type"] == "RankMismatchError", ours
    assert "rank(s) [1] built torch's, rank(s) [0] lockstep's" in ours["message"], ours
    assert theirs["type"] == "RuntimeError" and "inconsistent" in theirs["message"], theirs
