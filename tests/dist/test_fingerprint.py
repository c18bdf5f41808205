"""The step fingerprint and the second-backward check: misuse is named at its first step.

Uneven data with an epoch loop, no_sync() on one rank only and a second
backward through a synchronised step all leave torch DDP running with ranks that
pair different steps (or keep local gradients) until it fails at the very end,
or never. Here each is raised on every rank at the first step it happens, and
the first mismatched step is computed by hand. A correct run (equal data, the
same no_sync on every rank, a loader restarted for a fixed number of steps with
the data-pass check off) trains bitwise like torch DDP: the fingerprint does
not change numerics.
"""

from __future__ import annotations

import pytest
import torch
from engine_models import MLP
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep.errors import LockstepError, RankMismatchError
from lockstep.testing import run_ranks

BATCH = 2


def _loader(rank: int, batches_per_rank: tuple[int, ...]) -> DataLoader:
    gen = torch.Generator().manual_seed(100 + rank)
    n = batches_per_rank[rank] * BATCH
    data = TensorDataset(torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen))
    return DataLoader(data, batch_size=BATCH)


def _wrap(engine: str, **kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = MLP()
    if engine == "torch":
        return model, nn.parallel.DistributedDataParallel(model)
    return model, lockstep.DistributedDataParallel(model, **kwargs)


def _epochs(ctx, engine: str, batches_per_rank: tuple[int, ...], epochs: int) -> dict:
    """An epoch loop over a plain DataLoader; returns the steps done and any error."""
    model, ddp = _wrap(engine)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader, step = _loader(ctx.rank, batches_per_rank), 0
    try:
        for _ in range(epochs):
            for x, y in loader:
                opt.zero_grad()
                ((ddp(x) - y) ** 2).mean().backward()
                opt.step()
                step += 1
    except RankMismatchError as error:
        return {"failed_at": step + 1, "error": str(error)}
    return {"steps": step, "params": [p.detach().clone() for p in model.parameters()]}


def test_uneven_dataloader_fails_on_every_rank_at_the_first_mismatched_step():
    # rank 0 has 5 batches per epoch, rank 1 has 4: rank 0's 5th step (the last of its
    # first epoch) pairs with rank 1's 5th (the first of its second): step 5.
    results = run_ranks(_epochs, 2, "lockstep", (5, 4), 3)
    for rank, result in enumerate(results):
        assert result.get("failed_at") == 5, (rank, result)
        assert "different passes over their data" in result["error"]
        assert "rank 0: step 5, data pass 1" in result["error"]
        assert "rank 1: step 5, data pass 2" in result["error"]
        assert "lockstep.shard" in result["error"]


def test_even_dataloader_trains_bitwise_like_torch_ddp():
    ours = run_ranks(_epochs, 2, "lockstep", (3, 3), 2)
    theirs = run_ranks(_epochs, 2, "torch", (3, 3), 2)
    for rank in range(2):
        assert ours[rank]["steps"] == theirs[rank]["steps"] == 6
        for a, b in zip(ours[rank]["params"], theirs[rank]["params"], strict=True):
            assert torch.equal(a, b)


def _restarting(ctx, engine: str, check: bool) -> dict:
    """A fixed number of steps over a loader that is restarted when it runs out."""
    model, ddp = _wrap(engine) if engine == "torch" else _wrap(engine, check_data_passes=check)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _loader(ctx.rank, (3, 2))
    batches = iter(loader)
    try:
        for _ in range(7):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
    except RankMismatchError as error:
        return {"error": str(error)}
    return {"params": [p.detach().clone() for p in model.parameters()]}


def test_a_restarted_loader_needs_the_data_pass_check_off_then_matches_torch():
    flagged = run_ranks(_restarting, 2, "lockstep", True)
    assert all("check_data_passes=False" in r["error"] for r in flagged)
    ours = run_ranks(_restarting, 2, "lockstep", False)
    theirs = run_ranks(_restarting, 2, "torch", False)
    for rank in range(2):
        for a, b in zip(ours[rank]["params"], theirs[rank]["params"], strict=True):
            assert torch.equal(a, b)


def _no_sync_on_rank0_only(ctx) -> str:
    _, ddp = _wrap("lockstep")
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    if ctx.rank == 0:
        with ddp.no_sync():
            ((ddp(x) - y) ** 2).mean().backward()
    try:
        ((ddp(x) - y) ** 2).mean().backward()
    except RankMismatchError as error:
        return str(error)
    return "no error"


def test_no_sync_on_one_rank_only_is_named_at_the_first_step():
    for message in run_ranks(_no_sync_on_rank0_only, 2):
        assert "different numbers of micro-batches" in message
        assert "rank 0: step 1, data pass 0, 2 micro-batch(es)" in message
        assert "rank 1: step 1, data pass 0, 1 micro-batch(es)" in message


def _second_backward(ctx, engine: str) -> str:
    _, ddp = _wrap(engine)
    loss = ((ddp(torch.randn(4, 8)) - torch.randn(4, 4)) ** 2).mean()
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except LockstepError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("engine", ["lockstep", "torch"])
def test_a_second_backward_through_a_synchronised_step_raises(engine):
    messages = run_ranks(_second_backward, 2, engine)
    if engine == "torch":  # the silent divergence this check exists for
        assert messages == ["no error", "no error"]
        return
    for rank, message in enumerate(messages):
        assert f"on rank {rank}" in message and "second backward" in message


def _accumulate_then_sync(ctx) -> list[torch.Tensor]:
    model, ddp = _wrap("lockstep")
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        with ddp.no_sync():
            ((ddp(torch.randn(4, 8, generator=gen)) - 1) ** 2).mean().backward()
        ((ddp(torch.randn(4, 8, generator=gen)) - 1) ** 2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_same_no_sync_on_every_rank_passes_and_ranks_agree():
    grads = run_ranks(_accumulate_then_sync, 2)
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def _fingerprints(ctx, steps: list[int | None]) -> str:
    from lockstep.runtime.fingerprint import Fingerprint, StepFingerprint

    check = StepFingerprint(None, ctx.rank, ctx.world_size)
    step = steps[ctx.rank]
    check.launch(None if step is None else Fingerprint(step, 1, 1, 7))
    try:
        check.check()
    except RankMismatchError as error:
        return str(error)
    return "agree"


def test_a_shadowing_rank_is_not_counted_but_raises_with_the_others():
    assert run_ranks(_fingerprints, 3, [4, 4, None]) == ["agree"] * 3
    # 3 + 5 == 2 x 4 and 9 + 25 != 2 x 16: a plain sum alone would be fooled
    for message in run_ranks(_fingerprints, 3, [3, 5, None]):
        assert "rank 0: step 3" in message and "rank 1: step 5" in message
