"""The non-finite check's hot path reads nothing on the host per bucket and adds no collective.

Real gloo ranks, six buckets (tiny caps). Inside one synchronised step the calls that
read a tensor's value on the host (`item`, `tolist`, `bool`, ...: on a GPU each is a
synchronisation) and the all-reduces are counted, with the check on (the default) and
off. At world size 2 both counts must be equal: the verdict travels in the step
fingerprint, read once with it. At world size 1 (no fingerprint exchange) the check
reads its verdict once per step, and nothing more. The same counts on a GPU, with
torch's sync debug mode and torch's DDP as the oracle: tests/gpu/test_host_syncs.py.
Where the check reads: every op of a step recorded (a dispatch mode), the sums over
each bucket must read every element once, all before the bucket's all-reduce (after
it, the local values are gone); and one inf among 263k elements of one rank's
gradient is caught and named.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lockstep
from lockstep.errors import NonFiniteGradientError
from lockstep.testing import run_ranks
from lockstep.testing.syncs import count_a_settled_step

CAPS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.001}


def _wrap(engine: str, mode: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))
    if engine == "ddp":
        ddp = lockstep.DistributedDataParallel(net, nonfinite=mode, **CAPS)
        return ddp, len(ddp.reducer.buckets)
    sharded = lockstep.ShardedDataParallel(net, stage=2, nonfinite=mode, **CAPS)
    return sharded, len(sharded.grad_sync.buckets)


def _counted_step(ctx, engine: str, mode: str) -> dict:
    """Three steps; the third one's host reads and all-reduces (after the one rebuild)."""
    model, buckets = _wrap(engine, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(ctx.rank)
    reads, all_reduces = count_a_settled_step(model, opt, gen)
    return {"reads": reads, "all_reduce": all_reduces, "buckets": buckets}


def _both_modes(ctx, engine: str) -> dict:
    return {mode: _counted_step(ctx, engine, mode) for mode in ("raise", "off")}


@pytest.mark.parametrize("engine", ["ddp", "sharded2"])
def test_the_check_reads_nothing_per_bucket_and_adds_no_collective(engine):
    for rank, result in enumerate(run_ranks(_both_modes, 2, engine, deadline_s=120)):
        on, off = result["raise"], result["off"]
        assert on["buckets"] >= 3, on  # the precondition: several buckets per step
        assert on["reads"] == off["reads"], (rank, on, off)
        assert on["all_reduce"] == off["all_reduce"], (rank, on, off)


def test_at_world_size_one_the_verdict_is_the_steps_one_read():
    result = run_ranks(_both_modes, 1, "ddp", deadline_s=60)[0]
    on, off = result["raise"], result["off"]
    assert on["buckets"] >= 3, on
    assert off["reads"] == {}, off
    assert on["reads"] == {"item": 1}, on


# ---------------------------------------------------------- where the gradients are read
# Linear(256, 256): each weight 256 KiB, each bias 1 KiB; 600 kB buckets hold two layers.
WIDE = 256
WIDE_CAPS = {"bucket_cap_mb": 0.6, "first_bucket_cap_mb": 0.6}


class _Reads(TorchDispatchMode):
    """Every op of the block in order, as (name, (address, elements) of its first input)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, int] | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        read = (first.data_ptr(), first.numel()) if first is not None else None
        self.ops.append((func.overloadpacket.__name__, read))
        return func(*args, **(kwargs or {}))


def _placement(ctx, mode: str) -> dict:
    """The third step's ops and all-reduces in order, and each bucket's (address, elements)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDE, WIDE) for _ in range(4)))
    model = lockstep.DistributedDataParallel(net, nonfinite=mode, **WIDE_CAPS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(ctx.rank)
    reads = _Reads()
    all_reduce = dist.all_reduce

    def noted(tensor, *args, **kwargs):
        reads.ops.append(("all_reduce", (tensor.data_ptr(), tensor.numel())))
        return all_reduce(tensor, *args, **kwargs)

    for step in range(3):
        loss = model(torch.randn(4, WIDE, generator=gen)).pow(2).mean()
        if step == 2:
            dist.all_reduce = noted
            try:
                with reads:
                    loss.backward()
            finally:
                dist.all_reduce = all_reduce
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    buckets = [(b.buffer.data_ptr(), b.buffer.numel()) for b in model.reducer.buckets]
    return {"ops": reads.ops, "buckets": buckets}


def _check_placement(result: dict) -> None:
    """Every element of every bucket is summed once, before the bucket's all-reduce."""
    ops, buckets = result["ops"], result["buckets"]
    assert len(buckets) >= 2, buckets  # the precondition: several buckets
    for ptr, numel in buckets:
        launch = ops.index(("all_reduce", (ptr, numel)))  # the bucket's own collective
        inside = [
            read
            for name, read in ops
            if name == "sum" and read and ptr <= read[0] < ptr + numel * 4
        ]
        before = [
            read
            for name, read in ops[:launch]
            if name == "sum" and read and ptr <= read[0] < ptr + numel * 4
        ]
        assert sorted(inside) == sorted(before), ("summed after the launch", inside, before)
        end = ptr
        for start, n in sorted(inside):  # no element twice, none left out
            assert start == end, ("a gap or an overlap", (ptr, numel), sorted(inside))
            end = start + n * 4
        assert end == ptr + numel * 4, ("not read to the end", (ptr, numel), sorted(inside))


def test_every_gradient_element_is_summed_once_before_its_buckets_all_reduce():
    for result in run_ranks(_placement, 2, "raise", deadline_s=120):
        _check_placement(result)


def _inf_in_one_element(ctx, mode: str) -> dict:
    """Rank 1's gradient of `1.weight` gets one inf at step 3 (one element in 263k)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDE, WIDE) for _ in range(4)))
    model = lockstep.DistributedDataParallel(net, nonfinite=mode, **WIDE_CAPS)
    state = {"step": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if ctx.rank == 1 and state["step"] == 3:
            grad = grad.clone()
            grad[7, 11] = float("inf")
        return grad

    net[1].weight.register_hook(poison)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(ctx.rank)
    for step in range(1, 5):
        state["step"] = step
        opt.zero_grad()
        try:
            model(torch.randn(4, WIDE, generator=gen)).pow(2).mean().backward()
        except NonFiniteGradientError as error:
            return {"raised_at": step, "error": str(error)}
        opt.step()
    return {"raised_at": None}


def test_an_inf_in_one_element_of_rank_1_is_caught_and_named():
    for rank, result in enumerate(run_ranks(_inf_in_one_element, 2, "raise")):
        assert result["raised_at"] == 3, (rank, result)
        assert "rank 1: '1.weight' holds inf" in result["error"], result["error"]
        assert "Ranks with finite gradients: 0." in result["error"], result["error"]
