"""The non-finite check's hot path reads nothing on the host per bucket and adds no collective.

Real gloo ranks, six buckets (tiny caps). Inside one synchronised step the calls that
read a tensor's value on the host (`item`, `tolist`, `bool`, ...: on a GPU each is a
synchronisation) and the all-reduces are counted, with the check on (the default) and
off. At world size 2 both counts must be equal: the verdict travels in the step
fingerprint, read once with it. At world size 1 (no fingerprint exchange) the check
reads its verdict once per step, and nothing more. The same counts on a GPU, with
torch's sync debug mode and torch's DDP as the oracle: tests/gpu/test_host_syncs.py.
Where the check reads: every op of a step recorded (a dispatch mode), each large
gradient must be summed right after its copy into the bucket (in its hook, while in
cache), and the sums over the buckets must read every element once.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lockstep
from lockstep.errors import NonFiniteGradientError
from lockstep.runtime.finite_reads import HOT_BYTES
from lockstep.testing import run_ranks
from lockstep.testing.syncs import count_host_reads

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
    calls: Counter[str] = Counter()
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        calls["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    reads: Counter[str] = Counter()
    for step in range(3):
        loss = model(torch.randn(4, 16, generator=gen)).pow(2).mean()
        if step == 2:
            dist.all_reduce = counting
            try:
                with count_host_reads() as reads:
                    loss.backward()
            finally:
                dist.all_reduce = all_reduce
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {"reads": dict(reads), "all_reduce": calls["all_reduce"], "buckets": buckets}


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
# Linear(256, 256): each weight 256 KiB (summed in its hook), each bias 1 KiB (with its
# bucket); 600 kB buckets hold two layers each.
WIDE = 256
WIDE_CAPS = {"bucket_cap_mb": 0.6, "first_bucket_cap_mb": 0.6}


class _Reads(TorchDispatchMode):
    """Every op of the block in order: (name, input's (address, elements), out's address)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, int] | None, int | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        read = (first.data_ptr(), first.numel()) if first is not None else None
        out = kwargs.get("out")
        written = out.data_ptr() if isinstance(out, torch.Tensor) else None
        self.ops.append((func.overloadpacket.__name__, read, written))
        return func(*args, **kwargs)


def _placement(ctx, mode: str) -> dict:
    """The third step's ops, and where each bucket's slots are (address, elements, large)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDE, WIDE) for _ in range(4)))
    model = lockstep.DistributedDataParallel(net, nonfinite=mode, **WIDE_CAPS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(ctx.rank)
    reads = _Reads()
    for step in range(3):
        loss = model(torch.randn(4, WIDE, generator=gen)).pow(2).mean()
        if step == 2:
            with reads:
                loss.backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    buckets = [
        [(v.data_ptr(), v.numel(), v.numel() * v.element_size() >= HOT_BYTES) for v in b.views]
        for b in model.reducer.buckets
    ]
    return {"ops": reads.ops, "buckets": buckets}


def _sums_over_buckets(ops: list, buckets: list) -> list[tuple[int, int]]:
    """The (address, elements) of each sum that reads inside a bucket's buffer."""
    ranges = [(b[0][0], b[-1][0] + b[-1][1] * 4) for b in buckets]
    return [
        read
        for name, read, _ in ops
        if name == "sum" and read and any(lo <= read[0] < hi for lo, hi in ranges)
    ]


def _check_placement(result: dict) -> None:
    ops, buckets = result["ops"], result["buckets"]
    large = [(ptr, n) for bucket in buckets for ptr, n, big in bucket if big]
    assert len(large) == 4 and len(buckets) >= 2, buckets  # the precondition
    summed = sorted(_sums_over_buckets(ops, buckets))
    # Every element of every bucket is read once by the check, none twice.
    covered = sorted((ptr, n) for bucket in buckets for ptr, n, _ in bucket)
    pos = 0
    for ptr, n in summed:
        assert pos == 0 or ptr >= pos, ("read twice", summed)
        pos = ptr + n * 4
    assert sum(n for _, n in summed) == sum(n for _, n in covered), (summed, covered)
    # Each large gradient is summed in its hook: the op right after the copy into its slot.
    for ptr, n in large:
        copy = next(i for i, (_, _, out) in enumerate(ops) if out == ptr)
        assert ops[copy + 1][0] == "sum" and ops[copy + 1][1] == (ptr, n), ops[copy : copy + 3]


def test_large_gradients_are_read_in_their_hook_and_every_element_once():
    for result in run_ranks(_placement, 2, "raise", deadline_s=120):
        _check_placement(result)


def _inf_in_one_large_gradient(ctx, mode: str) -> dict:
    """Rank 1's gradient of `1.weight` (read in its hook) gets one inf at step 3."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDE, WIDE) for _ in range(4)))
    model = lockstep.DistributedDataParallel(net, nonfinite=mode, **WIDE_CAPS)
    large = net[1].weight.numel() * 4 >= HOT_BYTES  # the precondition: read in its hook
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
            return {"raised_at": step, "error": str(error), "large": large}
        opt.step()
    return {"raised_at": None, "large": large}


def test_an_inf_in_one_large_gradient_of_rank_1_is_caught_and_named():
    for rank, result in enumerate(run_ranks(_inf_in_one_large_gradient, 2, "raise")):
        assert result["large"], result
        assert result["raised_at"] == 3, (rank, result)
        assert "rank 1: '1.weight' holds inf" in result["error"], result["error"]
        assert "Ranks with finite gradients: 0." in result["error"], result["error"]
