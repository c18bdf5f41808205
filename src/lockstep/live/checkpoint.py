"""`Checkpointer.restore` under live recovery: the state comes from a survivor, not from disk.

In a survivor, `restore()` registers what the script handed it (`LiveState`); at a
recovery the donor (the lowest surviving rank) builds the same payload a checkpoint
holds, in memory, and broadcasts it over the new group with the engines' states
(`live/ddp.py`). In the replacement, `restore()` receives it (`receive`) instead
of reading the directory, loads it as it would load a file, and returns the last
finished step, so the script resumes at the interrupted step with the same samples.
Random state: each rank posts a copy of its generators (`checkpoint/rng.py`, about
8 KB) in the launcher's store in every synchronised step, before the step's last
collective, so a rank lost after that collective has posted what the survivors count
as finished; a replacement takes its own.

Labels: each piece of per-rank state that a replacement takes says the number of
finished steps it is as of (the random state's post, the sampler's copy; the step
count and the engines' states are the donor's own). The replacement checks every
label against the step it resumes after and falls back, naming the piece, where one
disagrees: it never resumes with another step's state.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from lockstep.checkpoint import rng
from lockstep.checkpoint.state import build_payload, load_component, load_model
from lockstep.live import keys, lines, registry, save, sealed, wire
from lockstep.live.sampler import SamplerPlace, continues, received
from lockstep.sharded.engine import ShardedDataParallel

SOURCE = "the state received from a live peer"


class LiveState:
    """What a survivor hands over: the script's components and where the step count stands.

    Args:
        checkpointer: the script's `Checkpointer` (its `extra` travels too).
        model, components: what `restore()` was given.
        offset: steps finished when registered, less the engine's count then, so that
            `engine steps + offset` is the number of finished steps at any time.
        finished: steps finished when registered (the engine may not be built yet).
    """

    def __init__(
        self, checkpointer: Any, model: nn.Module, components: dict, offset: int, finished: int
    ) -> None:
        self.checkpointer, self.model, self.components = checkpointer, model, components
        self.offset = offset
        self.miscount: str | None = None
        self.sampler = SamplerPlace(components.get("sampler"), finished)
        self.post_rng(finished)  # the generators before the first step

    def saved(self, step: int) -> None:
        """`save(step)` ran: the script's count and the engine's must agree, else refuse."""
        if self.miscount is None and registry.engines() and step != self.finished() - 1:
            self.miscount = lines.miscounted(dist.get_rank(), step, self.finished())
            registry.declare()

    def refusal(self) -> str | None:
        if self.miscount is not None:
            return self.miscount
        if isinstance(self.model, ShardedDataParallel):
            return registry.SHARDED_REFUSAL
        return None

    def finished(self) -> int:
        return registry.steps() + self.offset

    def serve(self, donor: int, recovery: registry.Recovery, interrupted: Any) -> None:
        """Survivors: the donor broadcasts the state over the new default group."""
        blob = None
        if dist.get_rank() == donor:
            blob = wire.pack(self._bundle(recovery, interrupted))
        wire.broadcast(blob, donor)

    def _bundle(self, recovery: registry.Recovery, interrupted: Any) -> dict[str, Any]:
        finished = self.finished()
        world = dist.get_world_size()
        posts = [_read_rng(r, finished) for r in range(world)]
        components = {"model": self.model, **self.components}
        states = [post["state"] if post else None for post in posts]
        payload = build_payload(max(finished - 1, 0), world, components, states, None)
        payload["extra"] = self.checkpointer.extra
        payload["sampler"] = self.sampler.handed()  # as of the last finished step
        engines = [engine.state(recovery) for engine in registry.engines()]
        labels = {
            "rng": [post["step"] if post else None for post in posts],
            "sampler": self.sampler.step,
        }
        return {
            "payload": payload,
            "finished": finished,
            "labels": labels,
            "engines": engines,
            "save": interrupted,
        }

    def post_rng(self, step: int) -> None:
        """This rank's generators as of `step` finished steps, kept in the store (the slot
        of that count's parity: the post before it stays)."""
        key = keys.RNG.format(rank=dist.get_rank(), parity=step % 2)
        sealed.put_bytes(registry.store(), key, wire.pack({"step": step, "state": rng.capture()}))


def register(checkpointer: Any, model: nn.Module, components: dict, step: int | None) -> None:
    """A survivor-to-be: `restore()` returned `step` (None: from scratch)."""
    finished = 0 if step is None else step + 1
    _install(LiveState(checkpointer, model, components, finished - registry.steps(), finished))


def saved(step: int) -> None:
    """`Checkpointer.save(step)`: check the script's count against the engine's."""
    state = registry.server()
    if isinstance(state, LiveState):
        state.saved(step)


def _install(state: LiveState) -> None:
    # in each step, as of the step done (backward draws nothing: the state is final)
    registry.add_in_step(lambda: state.post_rng(state.finished() + 1))
    registry.add_after_step(lambda: state.sampler.take(state.finished()))
    registry.set_server(state)


def receive(checkpointer: Any, model: nn.Module, components: dict) -> int | None:
    """The replacement's `restore()`: load the donor's state; returns the last finished step."""
    donor = registry.donor()
    bundle = wire.unpack(wire.broadcast(None, donor))
    payload, finished = bundle["payload"], int(bundle["finished"])
    check_labels(bundle["labels"], finished, dist.get_rank(), components)
    load_model(model, payload["model"], SOURCE)
    for name, component in components.items():
        if component is not None:
            load_component(component, payload.get(name), name, SOURCE)
    received(components.get("sampler"))
    rng.restore(payload["rng"][dist.get_rank()])
    checkpointer.extra = payload.get("extra")
    passes_continue = continues(payload.get("sampler"))
    registry.adopt_received([{**s, "continues": passes_continue} for s in bundle["engines"]])
    engine_steps = int(bundle["engines"][0]["steps"]) if bundle["engines"] else 0
    _install(LiveState(checkpointer, model, components, finished - engine_steps, finished))
    registry.post_joined()
    save.finish(checkpointer, model, components, bundle.get("save"))
    return finished - 1 if finished > 0 else None


def check_labels(labels: dict[str, Any], finished: int, rank: int, components: dict) -> None:
    """A replacement's check: every piece of per-rank state it takes is as of `finished`
    steps, the step it resumes after.

    Raises:
        LockstepError: a piece is another step's (or missing): the fallback, naming it.
    """
    wrong = []
    posted = labels["rng"][rank]
    if posted != finished:
        found = "no post" if posted is None else f"a post as of {posted} finished steps"
        wrong.append(f"the random state of rank {rank} ({found})")
    if components.get("sampler") is not None and labels["sampler"] != finished:
        wrong.append(f"the sampler's place (as of {labels['sampler']} finished steps)")
    if wrong:
        raise lines.fallback(
            f"{' and '.join(wrong)} handed to a replacement that resumes after {finished} "
            "finished steps: it would compute with another step's state"
        )


def _read_rng(rank: int, finished: int) -> dict[str, Any] | None:
    """`rank`'s post as of `finished` steps, or the one in its slot (checked by the
    replacement), or None."""
    data = sealed.read_bytes(registry.store(), keys.RNG.format(rank=rank, parity=finished % 2))
    return wire.unpack(data) if data is not None else None
