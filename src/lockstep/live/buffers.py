"""Buffers broadcast at every forward, under live recovery (`live/ddp.py`).

torch's rule: a forward that follows a synchronised one broadcasts rank 0's buffers
(BatchNorm's running statistics) to every rank; each rank's forward then moves its
own copy with its own batch. So between two broadcasts the ranks' buffers differ,
and a lost rank's are lost with it. Three things make such a model recoverable live:

- *The broadcast is a recovery point at the step's start* (`runtime/recovery.py`): a
  rank lost there is recovered as inside the step the forward opens (peers that
  received the value may be in that step already); a rank still in the broadcast
  takes its value from rank 0's post (below), and nobody broadcasts it again.
- *A copy of the broadcast buffers* (`synced`, labelled with the steps finished when
  it was taken): a replacement that resumes inside a step starts from the buffers
  every rank had at that step's start, and skips its own first broadcast.
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

from lockstep.live import keys, lines, registry, sealed, wire
from lockstep.runtime.recovery import Point

Buffers = dict[str, torch.Tensor]


class LiveBuffers:
    """One DDP wrapper's broadcast buffers under live recovery."""

    def __init__(self, ddp: Any) -> None:  # a lockstep.DistributedDataParallel
        self.ddp = ddp
        self.synced: Buffers = {}  # as the last broadcast left them
        self.synced_after = -1  # the steps finished at that broadcast (-1: none yet)

    def active(self) -> bool:
        return bool(self.ddp.forward_sync_buffers and self.ddp.broadcast_buffers_named())

    def _steps(self) -> int:
        return self.ddp.reducer.driver.steps

    def _own(self) -> Buffers:
        """A copy of this rank's buffers as they stand."""
        return {n: b.detach().clone() for n, b in self.ddp.broadcast_buffers_named()}

    # ------------------------------------------------------------- every step
    def keep(self, value: Buffers | None = None) -> None:
        """After a broadcast (or its value taken): copy the buffers every rank now holds."""
        with torch.no_grad():
            for name, buffer in self.ddp.broadcast_buffers_named():
                now = value[name] if value is not None else buffer
                kept = self.synced.get(name)
                if kept is None or kept.shape != now.shape or kept.dtype != now.dtype:
                    self.synced[name] = now.detach().clone()
                else:
                    kept.copy_(now)
        self.synced_after = self._steps()

    def post(self) -> None:
        """Rank 0, after a synchronised forward: its buffers, labelled with that step."""
        if dist.get_rank() != 0 or not self.active():
            return
        step = self._steps() + 1
        value = (step, {n: b.detach().cpu() for n, b in self.ddp.broadcast_buffers_named()})
        sealed.put_bytes(registry.store(), keys.BUFFERS.format(parity=step % 2), wire.pack(value))

    # ---------------------------------------------------------- at a recovery
    def lost_in_broadcast(self) -> Buffers:
        """This rank met the loss in the broadcast: what it carries (rank 0's post)."""
        value = self.broadcast_value(self._steps())
        self.keep(value)
        return value

    def catch_up(self) -> None:
        """Recovered between steps while a peer is past the next forward's broadcast:
        take what it carries (rank 0's post) instead of running it, as that peer did."""
        if not self.active() or not self.ddp.require_forward_param_sync:
            return
        value = self.broadcast_value(self._steps())
        self.keep(value)
        registry.take(Point.BUFFERS, value)

    def recovered_before_forward(self) -> None:
        """A loss met before this process's first forward, recovered as at the start of
        the step: that step's broadcast carries what every rank holds now (the wrap's or
        `restore()`'s buffers), so this rank keeps them and skips it, as its peers did.

        Raises:
            LockstepError: a forward ran already in this process (its buffers moved).
        """
        if not self.active():
            return
        if self.synced_after != -1:
            raise lines.fallback(
                "a loss met in the data's agreement after a forward had moved this rank's buffers"
            )
        self.keep()
        registry.take(Point.BUFFERS, None)

    def state(self, recovery: registry.Recovery) -> dict[str, Any]:
        """What the replacement's buffers must be, and whether its first forward broadcasts.

        Raises:
            LockstepError: the buffers a replacement needs exist nowhere (a forward
                ran without the broadcast torch's rule puts before it).
        """
        steps, forward_sync = self._steps(), self.ddp.require_forward_param_sync
        if recovery.within_step and recovery.point in (Point.REBUILD, Point.BUFFERS):
            buffers = self.broadcast_value(steps)  # what this step's broadcast carries
        elif recovery.within_step or not forward_sync:
            # it resumes at this step (or its next forward keeps its own buffers): the
            # buffers every rank had after this step's broadcast
            if self.synced_after != steps:
                raise lines.fallback(
                    f"the buffers of the lost rank(s) {list(recovery.replaced)} at step "
                    f"{steps + 1} exist nowhere: no forward since step {steps} broadcast them "
                    "(torch's rule skips the broadcast after a forward without gradients)"
                )
            buffers = self.synced
        elif recovery.opened or 0 in recovery.replaced:
            # a peer is past the next forward's broadcast, or the replacement is rank 0:
            # what rank 0's next forward broadcasts
            buffers = self.broadcast_value(steps)
        else:
            buffers = self._own()  # the next forward's broadcast overwrites them
        skip = recovery.within_step or (recovery.opened and forward_sync)
        return {
            "buffers": buffers,
            "skip_first_sync": skip,
            "forward_sync": forward_sync or recovery.within_step,
        }

    def broadcast_value(self, steps: int) -> Buffers:
        """What a forward's broadcast after `steps` finished steps carries: rank 0's
        buffers after its last synchronised forward (its post), or before any step the
        buffers the wrap made equal on every rank."""
        if steps == 0:
            return self._own()
        data = sealed.read_bytes(registry.store(), keys.BUFFERS.format(parity=steps % 2))
        step, buffers = wire.unpack(data) if data is not None else (None, {})
        if step != steps:
            raise lines.fallback(
                f"rank 0's buffers after the forward of step {steps} were not posted (found "
                f"step {step})"
            )
        return buffers

    def adopt(self, state: dict[str, Any]) -> None:
        """The replacement takes the buffers (after the model's state was loaded), and
        whether its first forward broadcasts them (`forward_sync`, set by `LiveDDP.adopt`)."""
        named = dict(self.ddp.broadcast_buffers_named())
        with torch.no_grad():
            for name, value in state["buffers"].items():
                named[name].copy_(value)
        skip = bool(state["skip_first_sync"])
        if skip:
            registry.take(Point.BUFFERS, None)  # its peers broadcast already: keep these
        if skip or not state["forward_sync"]:
            self.keep()
