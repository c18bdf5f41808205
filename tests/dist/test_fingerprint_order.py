"""The step fingerprint never cuts into collectives that a communication hook issues late.

The fingerprint leaves right after the last bucket when every bucket's collectives are
issued inside `launch` (the native all-reduce). A hook may issue more from a callback
(torch's PowerSGD issues its second all-reduce when the first completes), at a time
that differs between ranks: a fingerprint sent after the last bucket would then pair
with the hook's collective on one rank and not on the other. Here the one bucket's
hook issues a second all-reduce in its first one's callback: at once on rank 1, 0.3 s
late on rank 0. The run must train bitwise like torch's DDP with the same hook (the
oracle): the fingerprint waits for such buckets.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.testing import run_ranks


def _late_second_all_reduce(late: list[dist.Work], bucket):  # torch's DDP reads a return
    """Average the bucket; in the callback, one more all-reduce, issued late on rank 0."""  # hint
    first = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    if dist.get_rank() == 1:
        first.wait()  # the callback below then runs at once, inside the hook

    def second(fut: torch.futures.Future) -> torch.Tensor:
        if dist.get_rank() == 0:
            time.sleep(0.3)
        late.append(dist.all_reduce(torch.ones(1), async_op=True))
        return fut.value()[0] / dist.get_world_size()

    return first.then(second)


def _train(ctx, engine: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    cls = (
        lockstep.DistributedDataParallel
        if engine == "lockstep"
        else nn.parallel.DistributedDataParallel
    )
    ddp = cls(net)  # one bucket: a second bucket's collectives would race the hook's
    late: list[dist.Work] = []
    ddp.register_comm_hook(late, _late_second_all_reduce)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        while late:
            late.pop().wait()
    return [p.detach().clone() for p in net.parameters()]


def test_a_hook_that_issues_a_collective_late_trains_like_torch_ddp():
    ours = run_ranks(_train, 2, "lockstep", deadline_s=120)
    theirs = run_ranks(_train, 2, "torch", deadline_s=120)
    for rank in range(2):
        for a, b in zip(ours[rank], theirs[rank], strict=True):
            assert torch.equal(a, b), f"rank {rank}"
