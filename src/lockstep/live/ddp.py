"""The DDP engine's part in live recovery (`live/registry.py`): hand over, adopt, regroup.

A survivor hands a replacement what the engine itself decided during the run and the
script cannot recompute: the synchronised step count (the step fingerprint's number),
the bucket layout after the one rebuild, the configuration a past `Join` left (torch
keeps it: every later forward notifies the context), and with buffers broadcast at
every forward, the buffers the replacement starts from (`live/buffers.py`). After a survivor
re-forms the default group, every reference the engine holds to the old one is
replaced (`regroup`).
Modes that keep more state, or run collectives the replacement cannot match at its
first step, are refused with the reason, and the launcher restarts the group instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.join import _JoinConfig

from lockstep.engine import join
from lockstep.live.buffers import LiveBuffers
from lockstep.live import registry as live
from lockstep.runtime.transport import NATIVE


class LiveDDP:
    """One `lockstep.DistributedDataParallel` as `live/registry.py` sees it."""

    def __init__(self, ddp: Any) -> None:  # a lockstep.DistributedDataParallel (imports us)
        self.ddp = ddp
        self.passes = 0  # data passes as of the last finished step (`runtime/data_passes.py`)
        self.buffers = LiveBuffers(ddp)
        driver = ddp.reducer.driver
        if driver.data_passes is not None:
            driver.end_of_step.append(self._note_passes)

    @classmethod
    def registered(cls, ddp: Any) -> LiveDDP:
        """A new wrapper's part, registered with `live/registry.py` (which may adopt now)."""
        engine = cls(ddp)
        live.register_engine(engine)
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
        ddp, args = self.ddp, self.ddp._args
        checks = [
            (args.process_group is not None or args.device_mesh is not None,
             "a process group other than the default one"),
            (args.allreduce != NATIVE, f"allreduce={args.allreduce!r} (native only)"),
            (ddp.find_unused_parameters, "find_unused_parameters=True"),
            (args.static_graph, "static_graph=True"),
            (ddp.mixed_precision is not None, "mixed_precision"),
            (ddp._delayed is not None, "delay_all_reduce_named_params"),
            (getattr(ddp, "_hooked", False), "a communication hook"),
        ]  # fmt: skip
        for refused, what in checks:
            if refused:
                return f"live recovery does not yet cover DistributedDataParallel with {what}"
        return None

    def after_forward(self) -> None:
        """A synchronised forward ran (rank 0 posts its buffers, `live/buffers.py`)."""
        self.buffers.post()

    def state(self, recovery: live.Recovery) -> dict[str, Any]:
        reducer = self.ddp.reducer
        groups, rebuilt, ready = reducer.live_layout(recovery)
        steps = reducer.driver.steps
        state = {"steps": steps, "groups": groups, "rebuilt": rebuilt, "passes": self.passes}
        state["ready"] = [] if recovery.within_step else ready  # inside a step: its own
        if self.buffers.active():
            state["buffers"] = self.buffers.state(recovery)
        config = self.ddp._join_config  # torch keeps a Join's config after the context:
        state["join"] = {  # each forward then notifies it, and the replacement must too
            "enable": config.enable,
            "throw_on_early_termination": config.throw_on_early_termination,
            "is_first_joinable": config.is_first_joinable,
            "divide": self.ddp.divide_by_initial_world_size,
            "resumed": recovery.opened,  # the survivors sent this step's notices already
        }
        return state

    def adopt(self, state: dict[str, Any]) -> None:
        """A replacement takes a survivor's step count and bucket layout."""
        reducer = self.ddp.reducer
        reducer.adopt_layout(state["groups"], state["rebuilt"], state["ready"])
        reducer.driver.steps = int(state["steps"])
        if reducer.driver.data_passes is not None:  # the first pass continues a resumed epoch
            self.passes = int(state["passes"])  # unless the sampler says it starts a new one
            reducer.driver.data_passes.adopt(self.passes, state.get("continues", True))
        if "buffers" in state:  # after the steps: the kept copy is labelled with them
            self.buffers.adopt(state["buffers"])
        config = dict(state["join"])
        self.ddp.divide_by_initial_world_size = config.pop("divide")
        self.ddp.join_resumed = config.pop("resumed") and config["enable"]
        self.ddp._join_config = _JoinConfig(**config)

    def recovered_before_forward(self) -> None:
        """A loss met before this process's first forward, recovered as at the start of
        the step (the sampler's agreement, `live/agreement.py`)."""
        self.buffers.recovered_before_forward()

    def catch_up(self) -> None:
        """This rank recovered between steps while a peer was already past the next
        step's opening broadcasts (`live/registry.py` `Recovery.opened`): take what they
        carry instead of running them."""
        self.ddp.reducer.catch_up_rebuild()
        self.skip_opening()

    @contextlib.contextmanager
    def opening(self) -> Iterator[None]:
        """This rank is in its forward's first collective, the bucket rebuild's broadcast
        before the buffers': a hand-over meanwhile gives what the buffer broadcast carries."""
        self.buffers.in_broadcast = True
        try:
            yield
        finally:
            self.buffers.in_broadcast = False

    def skip_opening(self) -> None:
        """Recovered as at the start of a step before the forward's buffer broadcast and
        Join's notices: take what the broadcast carries, send no notice in that forward
        (peers past them sent theirs on the group now gone, and nobody shadows them)."""
        self.buffers.catch_up()
        join.skip_next_notices(self.ddp)

    def regroup(self, group: dist.ProcessGroup) -> None:
        """Point every reference to the old default group at `group`."""
        ddp = self.ddp
        ddp.process_group = group
        reducer = ddp.reducer
        reducer.group = reducer.driver.group = reducer.driver.fingerprint.group = group
        ddp.nonfinite.group = group
        collective: Any = reducer.driver.collective
        while not hasattr(collective, "transport"):
            collective = collective.inner
        collective.transport.process_group = group
