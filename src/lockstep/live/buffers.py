"""Buffers broadcast at every forward, under live recovery (`live/ddp.py`).

torch's rule: a forward that follows a synchronised one broadcasts rank 0's buffers
(BatchNorm's running statistics) to every rank; each rank's forward then moves its
own copy with its own batch. So between two broadcasts the ranks' buffers differ,
and a lost rank's are lost with it. Three things make such a model recoverable live:

- *The broadcast is waited interruptibly* (`live/points.py`): a rank lost
  there is recovered as inside the step the forward opens (peers that received the
  value may be in that step already); a rank still in the broadcast takes its value
  from rank 0's post (below), and nobody broadcasts it again.
- *A copy of the broadcast buffers* (`synced`), after each broadcast: a replacement
  that resumes inside a step starts from the buffers every rank had at that step's
  start, and skips its own first broadcast (the survivors are past it).
- *Rank 0 posts its buffers* in the launcher's store after each synchronised forward:
  that is what the next broadcast carries, so a rank stuck in it takes it from there,
  and a replacement of rank 0 between steps broadcasts what rank 0 would have (no
  survivor holds rank 0's buffers after its own forward).

The post costs rank 0 one store write of the buffers per step (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine import join
from lockstep.errors import LockstepError
from lockstep.live import registry as live
from lockstep.live import wire as live_wire
from lockstep.live.points import between_steps
from lockstep.runtime.replicate import copy_back, flattened

POSTED_KEY = "lockstep/live/buffers0/{parity}"  # rank 0's (step, buffers), two steps kept


class LiveBuffers:
    """One DDP wrapper's broadcast buffers under live recovery."""

    def __init__(self, ddp: Any) -> None:  # a lockstep.DistributedDataParallel
        self.ddp = ddp
        self.synced: dict[str, torch.Tensor] = {}  # as the last broadcast left them
        self.synced_after = -1  # the steps finished at that broadcast (-1: none yet)
        self.skip_next = False  # a replacement inside a step: its peers broadcast already
        self.in_broadcast = False

    def active(self) -> bool:
        return bool(self.ddp.forward_sync_buffers and self.named())

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers a forward broadcasts (as `BufferSync.sync_buffers` picks them)."""
        module = self.ddp.module
        return [(n, b) for n, b in module.named_buffers() if not getattr(b, "_ddp_ignored", 0)]

    def _own(self) -> dict[str, torch.Tensor]:
        """A copy of this rank's buffers as they stand."""
        return {n: b.detach().clone() for n, b in self.named()}

    # ------------------------------------------------------------- every step
    def sync(self, src_rank: int) -> None:
        """The forward's broadcast from group rank `src_rank`, recovered if a rank is lost.

        A loss met here is recovered as inside the step this forward opens: peers that
        had the broadcast's value may be inside that step already. This rank then takes
        the value the broadcast carries, rank 0's buffers after its last synchronised
        forward, from rank 0's post (`_broadcast_value`), and goes on into the step.
        """
        if self.skip_next:
            self.skip_next = False
            return
        named = self.named()
        self.in_broadcast = True
        try:
            done = self._broadcast([b for _, b in named], src_rank)
        finally:
            self.in_broadcast = False
        if not done:  # recovered: the state went over as for this step, now the value
            self._take_posted(named)
            join.skip_next_notices(self.ddp)  # this forward's: nobody sends them again
        self._keep(named)

    def _broadcast(self, buffers: list[torch.Tensor], src_rank: int) -> bool:
        """One broadcast per dtype; False if a rank was lost (nothing written then)."""
        ddp = self.ddp
        what = f"the buffer broadcast of step {ddp.reducer.driver.steps + 1}"
        src = ddp.ctx.global_rank(src_rank)
        chunks = list(flattened(buffers))  # small: a model's buffers
        works = [  # all launched, then waited: one wait's latency
            dist.broadcast(flat, src=src, group=ddp.process_group, async_op=True)
            for _, flat in chunks
        ]
        for work in works:
            if not between_steps(work, what, within_step=True):
                return False
        for chunk, flat in chunks:
            copy_back(chunk, flat)
        return True

    def _keep(self, named: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, buffer in named:
                kept = self.synced.get(name)
                if kept is None or kept.shape != buffer.shape or kept.dtype != buffer.dtype:
                    self.synced[name] = buffer.detach().clone()
                else:
                    kept.copy_(buffer)
        self.synced_after = self.ddp.reducer.driver.steps

    def post(self) -> None:
        """Rank 0, after a synchronised forward: its buffers, labelled with that step."""
        named = self.named() if dist.get_rank() == 0 and self.ddp.forward_sync_buffers else []
        if not named:
            return
        step = self.ddp.reducer.driver.steps + 1
        value = (step, {n: b.detach().cpu() for n, b in named})
        live.store().set(POSTED_KEY.format(parity=step % 2), live_wire.pack(value))

    # ---------------------------------------------------------- at a recovery
    def catch_up(self) -> None:
        """Recovered between steps while a peer is past the next forward's broadcast:
        take what it carries (rank 0's post) and skip it, as that peer did."""
        if not self.active() or not self.ddp.require_forward_param_sync:
            return
        named = self.named()
        self._take_posted(named)
        self._keep(named)
        self.skip_next = True

    def recovered_before_forward(self) -> None:
        """A loss met before this process's first forward, recovered as at the start of
        the step: that step's broadcast carries what every rank holds now (the wrap's or
        `restore()`'s buffers), so this rank keeps them and skips it, as its peers past
        it did.

        Raises:
            LockstepError: a forward ran already in this process (its buffers moved).
        """
        if not self.active():
            return
        if self.synced_after != -1:
            raise LockstepError(
                "live recovery: a loss met in the data's agreement after a forward had "
                "moved this rank's buffers; falling back to the whole-group restart"
            )
        self._keep(self.named())
        self.skip_next = True

    def state(self, recovery: live.Recovery) -> dict[str, Any]:
        """What the replacement's buffers must be, and whether its first forward broadcasts.

        Raises:
            LockstepError: the buffers a replacement needs exist nowhere (a forward
                ran without the broadcast torch's rule puts before it).
        """
        ddp, steps = self.ddp, self.ddp.reducer.driver.steps
        if recovery.within_step and self.in_broadcast:
            buffers = self._broadcast_value(steps)  # what this step's broadcast carries
        elif recovery.within_step or not ddp.require_forward_param_sync:
            # it resumes at this step (or its next forward keeps its own buffers): the
            # buffers every rank had after this step's broadcast
            if self.synced_after != steps:
                raise LockstepError(
                    f"live recovery: the buffers of the lost rank(s) {list(recovery.replaced)} "
                    f"at step {steps + 1} exist nowhere: no forward since step {steps} "
                    "broadcast them (torch's rule skips the broadcast after a forward without "
                    "gradients); falling back to the whole-group restart"
                )
            buffers = self.synced
        elif recovery.opened:  # between steps, a peer past the next forward's broadcast
            buffers = self._broadcast_value(steps)
        elif 0 in recovery.replaced:
            buffers = self._broadcast_value(steps)  # what rank 0's next forward broadcasts
        else:
            buffers = self._own()  # the next forward's broadcast overwrites them
        skip = recovery.within_step or (recovery.opened and ddp.require_forward_param_sync)
        return {
            "buffers": buffers,
            "skip_first_sync": skip,
            "forward_sync": ddp.require_forward_param_sync or recovery.within_step,
        }

    def _take_posted(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy in what the forward's broadcast carries after the steps finished now."""
        value = self._broadcast_value(self.ddp.reducer.driver.steps)
        with torch.no_grad():
            for name, buffer in named:
                buffer.copy_(value[name])

    def _broadcast_value(self, steps: int) -> dict[str, torch.Tensor]:
        """What a forward's broadcast after `steps` finished steps carries: rank 0's
        buffers after its last synchronised forward (its post), or before any step the
        buffers the wrap made equal on every rank."""
        if steps == 0:
            return self._own()
        store, key = live.store(), POSTED_KEY.format(parity=steps % 2)
        step, buffers = live_wire.unpack(store.get(key)) if store.check([key]) else (None, {})
        if step != steps:
            raise LockstepError(
                f"live recovery: rank 0's buffers after the forward of step {steps} were not "
                f"posted (found step {step}); falling back to the whole-group restart"
            )
        return buffers

    def adopt(self, state: dict[str, Any]) -> None:
        """The replacement takes the buffers (after the model's state was loaded)."""
        named = dict(self.named())
        with torch.no_grad():
            for name, value in state["buffers"].items():
                named[name].copy_(value)
        self.skip_next = bool(state["skip_first_sync"])
        self.ddp.require_forward_param_sync = bool(state["forward_sync"])
        if self.skip_next or not self.ddp.require_forward_param_sync:
            self._keep(list(named.items()))
