"""A model on the meta device is refused at wrap time on every rank; the way that works.

lockstep's wrappers broadcast rank 0's values when they wrap, so a model built on
meta must be materialised first (`to_empty`, then `reset_parameters` under one seed).
Every wrapper must refuse a meta model with `MetaDeviceError` on every rank, also
when only one rank's model is on meta (no rank may wait in a collective). The
pattern the message gives trains exactly like the model built directly, under stage
3 and under torch's fully_shard (bitwise at world 2).
"""

from __future__ import annotations

import pytest
import torch
from sharded_cases import _full_state, global_batches, loss_of, make_optimizer, wrap
from torch import nn

import lockstep
from lockstep.testing import run_ranks

WRAPPERS = {
    "ddp": lockstep.DistributedDataParallel,
    "stage2": lambda m: lockstep.ShardedDataParallel(m, stage=2),
    "stage3": lambda m: lockstep.FSDP(m),
}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _on_meta() -> nn.Module:
    with torch.device("meta"):
        return _mlp()


def _materialised() -> nn.Module:
    model = _on_meta().to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def _refusals(ctx) -> dict:
    out = {}
    for name, wrapper in WRAPPERS.items():
        for where in ("every rank", "rank 1 only"):
            meta = where == "every rank" or ctx.rank == 1
            try:
                torch.manual_seed(0)
                wrapper(_on_meta() if meta else _mlp())
                out[(name, where)] = None
            except Exception as error:  # the type is checked in the test
                out[(name, where)] = f"{type(error).__name__}: {error}"
    return out


def _train(ctx, engine: str, materialise: bool) -> dict:
    if materialise:
        model = _materialised()
    else:
        torch.manual_seed(0)
        model = _mlp()
    model = wrap(engine, model, "mlp")
    opt = make_optimizer("adamw", model)
    losses = []
    for batch in global_batches("mlp", 3):
        loss = loss_of("mlp", model, [t.chunk(ctx.world_size)[ctx.rank] for t in batch])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "state": _full_state(engine, model)}


def _all(ctx) -> dict:
    out = {"refusals": _refusals(ctx)}
    for engine in ("stage3", "fsdp2"):
        out[(engine, "direct")] = _train(ctx, engine, materialise=False)
        out[(engine, "meta")] = _train(ctx, engine, materialise=True)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, deadline_s=120, timeout_s=20)


@pytest.mark.parametrize("where", ["every rank", "rank 1 only"])
@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_meta_model_is_refused_on_every_rank(results, name, where):
    for rank, out in enumerate(results):
        found = out["refusals"][(name, where)]
        assert found is not None, f"rank {rank}: {name} accepted a model on meta ({where})"
        assert found.startswith("MetaDeviceError: "), f"rank {rank}: {found}"
        assert "to_empty" in found and "reset_parameters" in found, found


def test_materialising_then_wrapping_trains_like_the_model_built_directly(results):
    runs = results[0]
    for engine in ("stage3", "fsdp2"):
        direct, meta = runs[(engine, "direct")], runs[(engine, "meta")]
        assert torch.equal(meta["losses"], direct["losses"]), engine
        for key, value in direct["state"].items():
            assert torch.equal(meta["state"][key], value), f"{engine}: {key}"
    assert torch.equal(runs[("stage3", "meta")]["losses"], runs[("fsdp2", "meta")]["losses"])
