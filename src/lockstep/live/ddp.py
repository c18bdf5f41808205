"""The DDP engine's part in live recovery: hand over, adopt, regroup.

Attached when a `lockstep.DistributedDataParallel` is wrapped (`lockstep.live`): it
fills the backward driver's slot (`live/steps.py`) and registers with the registry.
A survivor hands a replacement what the engine itself decided during the run and the
script cannot recompute: the synchronised step count (the step fingerprint's
number), the bucket layout after the one rebuild, the configuration a past `Join`
left (torch keeps it: every later forward notifies the context), and with buffers
broadcast at every forward, the buffers the replacement starts from
(`live/buffers.py`). After a survivor re-forms the default group, the engine runs
on the new one (`use_process_group`). Modes that keep more state, or run collectives
the replacement cannot match at its first step, are refused with the reason, and
the launcher restarts the group instead.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.join import _JoinConfig

from lockstep.live import rebuild, registry
from lockstep.live.buffers import LiveBuffers
from lockstep.live.steps import LiveSteps
from lockstep.runtime.recovery import Point
from lockstep.runtime.transport import NATIVE


class LiveDDP:
    """One `lockstep.DistributedDataParallel` as the registry sees it."""

    def __init__(self, ddp: Any) -> None:  # a lockstep.DistributedDataParallel
        self.ddp = ddp
        self.passes = 0  # data passes as of the last finished step (`runtime/data_passes.py`)
        self.buffers = LiveBuffers(ddp)
        driver = ddp.reducer.driver
        driver.recovery = LiveSteps(self.buffers.post)
        if driver.data_passes is not None:
            driver.end_of_step.append(self._note_passes)

    @classmethod
    def attach(cls, ddp: Any) -> LiveDDP:
        """A new wrapper's part, registered (a replacement may adopt its state now)."""
        engine = cls(ddp)
        registry.register_engine(engine)
        return engine

    def _note_passes(self) -> None:
        self.passes = self.ddp.reducer.driver.data_passes.seen

    @property
    def steps(self) -> int:
        return self.ddp.reducer.driver.steps

    @property
    def module(self) -> Any:
        """The wrapped module, whose state a plain hand-over sends (`live/plain.py`)."""
        return self.ddp.module

    def refusal(self) -> str | None:
        """Why this wrapper cannot be recovered live in this version, or None."""
        ddp, args = self.ddp, self.ddp.arguments
        checks = [
            (
                args.process_group is not None or args.device_mesh is not None,
                "a process group other than the default one",
            ),
            (args.allreduce != NATIVE, f"allreduce={args.allreduce!r} (native only)"),
            (ddp.find_unused_parameters, "find_unused_parameters=True"),
            (args.static_graph, "static_graph=True"),
            (ddp.mixed_precision is not None, "mixed_precision"),
            (args.delay_all_reduce_named_params is not None, "delay_all_reduce_named_params"),
            (ddp.has_comm_hook, "a communication hook"),
        ]
        for refused, what in checks:
            if refused:
                return f"live recovery does not yet cover DistributedDataParallel with {what}"
        return None

    def state(self, recovery: registry.Recovery) -> dict[str, Any]:
        groups, rebuilt, ready = self._layout(recovery)
        steps = self.steps
        state = {"steps": steps, "groups": groups, "rebuilt": rebuilt, "passes": self.passes}
        state["ready"] = [] if recovery.within_step else ready  # inside a step: its own
        if self.buffers.active():
            state["buffers"] = self.buffers.state(recovery)
        config = self.ddp.join_config  # torch keeps a Join's config after the context:
        state["join"] = {  # each forward then notifies it, and the replacement must too
            "enable": config.enable,
            "throw_on_early_termination": config.throw_on_early_termination,
            "is_first_joinable": config.is_first_joinable,
            "divide": self.ddp.divide_by_initial_world_size,
            "resumed": recovery.opened,  # the survivors sent this step's notices already
        }
        return state

    def _layout(self, recovery: registry.Recovery) -> tuple[list[list[int]], bool, list[int]]:
        """The bucket layout in use, whether the one rebuild happened, and the ready order
        it will use if not. A loss met in the rebuild's broadcast is recovered as at the
        start of step 2, and a peer may be past it while this rank is between steps
        (`recovery.opened`): the layout is then the rebuilt one."""
        reducer = self.ddp.reducer
        in_rebuild = recovery.within_step and recovery.point is Point.REBUILD
        if in_rebuild or (recovery.opened and not recovery.within_step and reducer.rebuild_due()):
            return reducer.groups_for(rebuild.agreed(reducer.ready_order)), True, []
        groups = [list(g) for g in reducer.layout.groups]
        return groups, reducer.rebuilt, [] if reducer.rebuilt else reducer.ready_order

    def adopt(self, state: dict[str, Any]) -> None:
        """A replacement takes a survivor's step count and bucket layout."""
        reducer = self.ddp.reducer
        reducer.adopt_layout(state["groups"], state["rebuilt"], state["ready"])
        reducer.driver.steps = int(state["steps"])
        if reducer.driver.data_passes is not None:  # the first pass continues a resumed epoch
            self.passes = int(state["passes"])  # unless the sampler says it starts a new one
            reducer.driver.data_passes.adopt(self.passes, state.get("continues", True))
        if "buffers" in state:  # after the steps: the kept copy is labelled with them
            # torch's flag for the next forward's broadcast, as at the survivors
            self.ddp.require_forward_param_sync = bool(state["buffers"]["forward_sync"])
            self.buffers.adopt(state["buffers"])
        config = dict(state["join"])
        self.ddp.divide_by_initial_world_size = config.pop("divide")
        if config.pop("resumed") and config["enable"]:  # its peers notified in this step
            registry.take(Point.JOIN_NOTICES, None)
        self.ddp.join_config = _JoinConfig(**config)

    def broadcast_done(self) -> None:
        """The buffer broadcast completed: keep what every rank now holds."""
        self.buffers.keep()

    def met_loss(self, point: Point) -> Any:
        """This rank met a loss in an opening broadcast (recovered as at the step's start):
        what it carries, and the rest of the forward's openings taken."""
        if point is Point.REBUILD:
            order = rebuild.posted()
            self.skip_opening(rebuilt=True)
            return order
        value = self.buffers.lost_in_broadcast()  # the buffers' broadcast
        if self.ddp.join_config.enable:  # this forward's notices: nobody sends them again
            registry.take(Point.JOIN_NOTICES, None)
        return value

    def recovered_before_forward(self) -> None:
        """A loss met before this process's first forward, recovered as at the start of
        the step (the data's agreement, `data/agreement.py`)."""
        self.buffers.recovered_before_forward()

    def skip_opening(self, rebuilt: bool) -> None:
        """Recovered as at the start of a step, before the forward's broadcasts and Join's
        notices, which peers ran on the group now gone: take what the broadcasts carry
        and send no notice in that forward. `rebuilt`: the rebuild's broadcast was met
        (its order is taken already); else a due rebuild takes the posted order too."""
        if not rebuilt and self.ddp.reducer.rebuild_due():
            registry.take(Point.REBUILD, rebuild.posted())
        self.buffers.catch_up()
        if self.ddp.join_config.enable:
            registry.take(Point.JOIN_NOTICES, None)

    def regroup(self, group: dist.ProcessGroup) -> None:
        """Run on the re-formed default group."""
        self.ddp.use_process_group(group)
