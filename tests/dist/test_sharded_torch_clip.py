"""torch's own `clip_grad_norm_` on the sharded engine clips by the global norm.

FSDP2 users call `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`.
Each engine trains the small GPT with that call, 2 ranks, SGD: lockstep's DDP and
torch's fully_shard are the oracles; stages 2 and 3 must return the same norms (to
1e-6 relative: the squares are added in another order) and end with the same
parameters (1e-6 absolute). `torch.nn.utils.get_total_norm` over the gradients must
agree too, and the engine's own `model.clip_grad_norm_` still gives the same answer.
"""

from __future__ import annotations

import pytest
import torch
from sharded_cases import _full_state, build, global_batches, loss_of, make_optimizer, wrap

from lockstep.testing import run_ranks

CLIP = 0.05
ENGINES = ("ddp", "fsdp2", "stage2", "stage3")


def _train(ctx, engine: str, own_clip: bool = False) -> dict:
    model = wrap(engine, build("gpt"), "gpt")
    opt = make_optimizer("sgd", model)
    norms, totals = [], []
    for batch in global_batches("gpt", 3):
        mine = [t.chunk(ctx.world_size)[ctx.rank] for t in batch]
        loss_of("gpt", model, mine).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        totals.append(_plain(torch.nn.utils.get_total_norm(grads)))
        if own_clip:
            norms.append(model.clip_grad_norm_(CLIP))
        else:
            norms.append(_plain(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    state = _full_state(engine, model)
    return {"norms": torch.stack(norms), "totals": torch.stack(totals), "state": state}


def _plain(norm: torch.Tensor) -> torch.Tensor:
    """fully_shard's norms are DTensors: their value, as a plain tensor."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm.detach()


def _all(ctx) -> dict:
    out = {engine: _train(ctx, engine) for engine in ENGINES}
    out["stage3 own clip"] = _train(ctx, "stage3", own_clip=True)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, deadline_s=180, timeout_s=30)[0]


@pytest.mark.parametrize("engine", ["fsdp2", "stage2", "stage3", "stage3 own clip"])
def test_torch_clip_grad_norm_is_global_like_ddp(results, engine):
    ref, out = results["ddp"], results[engine]
    assert ref["norms"].min() > CLIP, "the clip must actually clip"
    torch.testing.assert_close(out["norms"], ref["norms"], rtol=1e-6, atol=0)
    torch.testing.assert_close(out["totals"], ref["totals"], rtol=1e-6, atol=0)
    for key, value in ref["state"].items():
        torch.testing.assert_close(out["state"][key], value, atol=1e-6, rtol=0, msg=key)
