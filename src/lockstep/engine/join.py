"""Uneven inputs: ranks that ran out of data shadow the others' collectives (torch's Join).

Inside `with Join([model]):` (`torch.distributed.algorithms.join`) every
forward of a rank that still has data first tells the context so (one
all-reduce of a 1). A rank whose loop has ended waits in the context's exit,
and for every step the others still run, `DDPJoinHook.main_hook` issues the
same collectives they do, in the same order, with zeros: the bucket rebuild,
the buffer broadcast, whether this step synchronises, one collective per bucket
through the same strategy, the step fingerprint (`launch(None)`: a shadow is
not counted; it carries the non-finite verdict too), and the vote on unused
parameters. Gradients are divided by
the initial world size, or by the ranks still running when asked. When all
have joined, `post_hook` copies the last joiner's model to every rank, so the
result equals torch DDP's. Under live recovery a rank declares itself not
recoverable from the context's making to its post-hook (a context made with
`enable=False` has none: the refusal then stays): a loss meanwhile falls back to
the whole-group restart, named in one line.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from lockstep.context import DistContext
from lockstep.engine.reducer import Reducer
from lockstep.runtime import recovery
from lockstep.runtime.bucket import Bucket
from lockstep.runtime.control_device import control_device
from lockstep.runtime.replicate import broadcast_tensors

LIVE_REFUSAL = (
    "live recovery does not cover a loss inside DDP's Join (uneven inputs: the joined "
    "ranks' shadow collectives and their buffer broadcast's owner are not recovered)"
)


class JoinTarget(Protocol):
    """What Join needs of the wrapper (`DistributedDataParallel` provides it)."""

    ctx: DistContext
    process_group: dist.ProcessGroup
    reducer: Reducer
    require_backward_grad_sync: bool
    require_forward_param_sync: bool
    forward_sync_buffers: bool
    divide_by_initial_world_size: bool
    join_announcement: Any
    join_config: Any  # torch's JoinConfig, set by Join and kept after the context

    def will_sync_module_buffers(self) -> bool: ...
    def sync_buffers(self, src_rank: int) -> None: ...
    def named_state(self, buffers: bool) -> list[tuple[str, torch.Tensor]]: ...


class JoinableDDP(Joinable):
    """The wrapper's side of torch's Join protocol (the wrapper inherits it)."""

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """The context for uneven inputs: `Join([self], ...)`."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """What this wrapper does on a rank that has joined."""
        divide = kwargs.get("divide_by_initial_world_size", True)
        return DDPJoinHook(self, divide)  # type: ignore[arg-type]

    @property
    def join_device(self) -> torch.device:
        params = self.reducer.params  # type: ignore[attr-defined]
        return params[0].device if params else torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group  # type: ignore[attr-defined]

    @property
    def join_config(self) -> Any:
        """torch's `JoinConfig` of the last Join context (torch keeps it after the context:
        every later forward still notifies it), under a public name."""
        return self._join_config

    @join_config.setter
    def join_config(self, config: Any) -> None:
        self._join_config = config


def common_rank(ddp: JoinTarget, candidate: bool) -> int:
    """The highest group rank among the candidates (torch's rule for the model's owner)."""
    device = control_device(ddp.process_group)
    mine = torch.tensor([ddp.ctx.rank if candidate else -1], dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=ddp.process_group)
    return int(mine.item())


def before_forward(ddp: JoinTarget) -> None:
    """A rank with data: tell the Join context, and set this step's divisor if asked.

    Not after a live recovery at this step's start: the peers sent this forward's
    notices on the group now gone (`announce_sync` ends the skip).
    """
    if recovery.skips(recovery.Point.JOIN_NOTICES, consume=False):
        return
    work = Join.notify_join_context(ddp)
    if work is None:
        return
    if not ddp.divide_by_initial_world_size:
        work.wait()
        ddp.reducer.average_over(int(work.result()[0].item()))


def announce_sync(ddp: JoinTarget) -> None:
    """Tell joined ranks whether this step synchronises (1 from each rank that will)."""
    if recovery.skips(recovery.Point.JOIN_NOTICES):
        return
    device = control_device(ddp.process_group)
    flag = torch.tensor([1.0 if ddp.require_backward_grad_sync else 0.0], device=device)
    ddp.join_announcement = dist.all_reduce(flag, group=ddp.process_group, async_op=True)


class DDPJoinHook(JoinHook):
    """What a joined rank does for each step the others run, and once at the end."""

    def __init__(self, ddp: JoinTarget, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp.divide_by_initial_world_size = divide_by_initial_world_size
        recovery.hold_refusal(LIVE_REFUSAL)  # until the post-hook: shadows are not recovered

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_if_needed()
        if ddp.will_sync_module_buffers():
            ddp.sync_buffers(src_rank=common_rank(ddp, candidate=False))
        flag = torch.zeros(1, device=control_device(ddp.process_group))
        dist.all_reduce(flag, group=ddp.process_group)
        will_sync = bool(flag.item())
        ddp.require_forward_param_sync = will_sync
        if will_sync:
            shadow_backward(ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = common_rank(ddp, candidate=is_last_joiner)
        tensors = [p for _, p in ddp.named_state(buffers=ddp.forward_sync_buffers)]
        broadcast_tensors(tensors, src=ddp.ctx.global_rank(src), process_group=ddp.process_group)
        # Step counts differ after uneven inputs; agree on one so later steps pair.
        device = control_device(ddp.process_group)
        steps = torch.tensor([ddp.reducer.driver.steps], dtype=torch.int64, device=device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=ddp.process_group)
        ddp.reducer.driver.steps = int(steps.item())
        ddp.reducer.average_over(ddp.ctx.world_size)
        recovery.release_refusal(LIVE_REFUSAL)


def shadow_backward(ddp: JoinTarget) -> None:
    """The collectives of one synchronised backward, with zeros, in the reducer's order."""
    reducer, driver = ddp.reducer, ddp.reducer.driver
    driver.fingerprint.begin(None)
    last = len(driver.buckets) - 1
    handles = []
    for i, bucket in enumerate(driver.buckets):
        zeros = Bucket.build(bucket.index, bucket.params, bucket.param_indices, None)
        handles.append(driver.collective.launch(zeros, i == last))
    inline = driver.collective.issues_inline()  # when the others send theirs (runtime/driver.py)
    if inline:
        driver.fingerprint.launch(None)
    for handle in handles:
        handle.wait()
    if not inline:
        driver.fingerprint.launch(None)
    driver.fingerprint.check()
    if reducer.votes_unused():
        votes = torch.zeros(
            len(reducer.params), dtype=torch.int32, device=control_device(reducer.group)
        )
        dist.all_reduce(votes, group=reducer.group)
    ddp.nonfinite.end_step(holds_results=False)  # the others' verdict (runtime/finite.py)
