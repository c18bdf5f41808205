"""Replicas that vouch for each other: a replica that differs is caught at the next step.

Real gloo ranks and real faults, made by the test script on one rank after its
optimizer's step 4: one bit flipped in one weight (through the tensor's int32 view,
as a memory fault would), a write to a buffer the forward only reads, an entry of
the optimizer's state changed. The check compares every rank's parameters and
buffers inside the step fingerprint, so the fault is found at the next step's
backward (the optimizer-state fault one step later, once it has moved a
parameter), on every rank, before any optimizer applies that step's gradient:
with two replicas both are named, with three the one outside the majority.
BatchNorm's running statistics, which move with each rank's batch, never trip it.
With the check off (`check_replicas=False`, or LOCKSTEP_CHECK_REPLICAS=0 for every
test here) nothing is raised and the tests fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lockstep
from lockstep.errors import ReplicaMismatchError
from lockstep.testing import run_ranks
from lockstep.testing.syncs import count_a_settled_step

STEPS, FAULT_STEP = 7, 4


class Net(nn.Module):
    """An MLP with a buffer the forward only reads, and optionally a BatchNorm layer."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16),
            nn.BatchNorm1d(16) if batchnorm else nn.Identity(),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, 4),
        )
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.net(x) * self.scale


def flip_bit(tensor: torch.Tensor, element: int = 3, bit: int = 20) -> None:
    """One bit of one element flipped in place, through the int32 view of its memory."""
    with torch.no_grad():
        tensor.view(-1).view(torch.int32)[element] ^= 1 << bit


def _fault(kind: str, model: Net, opt: torch.optim.Optimizer) -> None:
    if kind == "weight":
        flip_bit(model.net[3].weight)
    elif kind == "buffer":
        model.scale[2] = 1.5  # a rank-local write: `if rank == 1: model.scale[2] = ...`
    elif kind == "optimizer":
        opt.state[model.net[0].weight]["momentum_buffer"][0, 0] += 1e-3


def _train(ctx, kind: str, fault_rank: int, steps: int, options: dict) -> dict:
    torch.manual_seed(0)
    model = Net(options.pop("batchnorm", False))
    ddp = lockstep.DistributedDataParallel(model, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(100 * step + ctx.rank)
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        try:
            loss.backward()
        except ReplicaMismatchError as error:
            return {"raised_at": step, "error": str(error), "state": _state(model)}
        opt.step()
        if step == FAULT_STEP and ctx.rank == fault_rank:
            _fault(kind, model, opt)
    return {"raised_at": None, "state": _state(model)}


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _with_oracle(ctx, kind: str, fault_rank: int, options: dict) -> dict:
    """The run with the fault, then a run of the steps before it (their state)."""
    caught = _train(ctx, kind, fault_rank, STEPS, dict(options))
    before = (caught["raised_at"] or 1) - 1
    caught["oracle"] = _train(ctx, "", -1, before, dict(options))["state"]
    return caught


def _run(world_size: int, kind: str, options: dict | None = None) -> list[dict]:
    return run_ranks(_with_oracle, world_size, kind, 1, options or {}, deadline_s=120)


def _assert_stopped(results: list[dict], at: int, names: list[str], *lines: str) -> None:
    """Every rank raised at step `at`, its message naming what `lines` say, and its
    parameters are those after step at - 1 (the step's gradient was never applied)."""
    for rank, result in enumerate(results):
        assert result["raised_at"] == at, (rank, result.get("error"))
        error = result["error"]
        assert f"replicas differ at synchronised step {at}" in error, error
        assert f"raised on rank {rank}" in error, error
        for line in lines:
            assert line in error, (line, error)
        assert any(f"'{name}'" in error for name in names), error
        if rank != 1:  # the rank without the fault holds exactly the state before the step
            assert all(
                torch.equal(a, b) for a, b in zip(result["state"], result["oracle"], strict=True)
            ), rank


def test_a_bit_flipped_in_one_weight_stops_both_replicas_naming_both_and_the_weight():
    results = _run(2, "weight")
    _assert_stopped(
        results, FAULT_STEP + 1, ["net.3.weight"], "rank(s) [0, 1] differ", "no majority"
    )
    assert "parameter 'net.3.weight'" in results[0]["error"], results[0]["error"]


def test_with_three_replicas_the_one_outside_the_majority_is_named():
    results = _run(3, "weight")
    line = "rank(s) [1] hold other parameters or buffers than the majority, rank(s) [0, 2]"
    _assert_stopped(results, FAULT_STEP + 1, ["net.3.weight"], line)


def test_a_rank_local_write_to_a_buffer_is_named():
    results = _run(2, "buffer", {"forward_sync_buffers": False})
    _assert_stopped(results, FAULT_STEP + 1, ["scale"], "buffer or frozen parameter 'scale'")


def test_an_optimizer_state_entry_changed_on_one_rank_shows_in_the_next_steps_parameters():
    results = _run(3, "optimizer")
    line = "rank(s) [1] hold other parameters or buffers than the majority, rank(s) [0, 2]"
    _assert_stopped(results, FAULT_STEP + 2, ["net.0.weight"], line)


@pytest.mark.parametrize("sync_buffers", [True, False])
def test_batchnorm_statistics_that_move_with_each_ranks_batch_are_not_a_difference(sync_buffers):
    options = {"batchnorm": True, "forward_sync_buffers": sync_buffers}
    for rank, result in enumerate(_run(2, "", options)):
        assert result["raised_at"] is None, (rank, result.get("error"))


def test_switched_off_the_flip_goes_unseen_and_the_replicas_stay_apart():
    results = _run(2, "weight", {"check_replicas": False})
    assert [r["raised_at"] for r in results] == [None, None]
    assert not all(
        torch.equal(a, b) for a, b in zip(results[0]["state"], results[1]["state"], strict=True)
    )


def _counted_step(ctx, on: bool) -> dict:
    """Three steps, six buckets; the third's host reads and all-reduces (after the rebuild)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))
    caps = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.001}
    model = lockstep.DistributedDataParallel(net, check_replicas=on, **caps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(ctx.rank)
    reads, all_reduces = count_a_settled_step(model, opt, gen)
    checked = model.replicas.steps_checked
    return {"reads": reads, "all_reduce": all_reduces, "checked": checked}


def _on_and_off(ctx) -> dict:
    return {on: _counted_step(ctx, on) for on in (True, False)}


def test_the_check_adds_no_host_read_and_no_collective_to_a_step():
    for rank, result in enumerate(run_ranks(_on_and_off, 2, deadline_s=120)):
        on, off = result[True], result[False]
        assert on["checked"] == 3 and off["checked"] == 0, (rank, on, off)
        assert on["reads"] == off["reads"], (rank, on, off)
        assert on["all_reduce"] == off["all_reduce"], (rank, on, off)
