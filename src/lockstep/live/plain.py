"""Live recovery of a script without `Checkpointer.restore`: the weights and the step count.

A script that wraps its model in `lockstep.DistributedDataParallel` but never calls
`Checkpointer.restore` still has what every rank holds alike: the module's parameters
and buffers, and the engine's count of synchronised steps. At a recovery the donor
sends those (`PlainServer`); the replacement takes them inside its wrapper's
constructor (`receive`), where `ddp.finished_steps` then says where the script
resumes, and names in one line on its stderr what nobody could hand it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from lockstep.live import keys, lines, sealed
from lockstep.live import wire as live_wire

NOT_RESTORED = (
    "the optimizer's state, the random state, the data position, the learning-rate "
    "schedule and anything else the script keeps"
)


def post_handover(store: dist.Store, rank: int, plain: bool) -> None:
    """Say which hand-over this rank would serve as a donor."""
    sealed.put(store, keys.HANDOVER.format(rank=rank), "plain" if plain else "checkpointer")


def donor_is_plain(store: dist.Store, donor: int) -> bool:
    return sealed.read(store, keys.HANDOVER.format(rank=donor)) == "plain"


class PlainServer:
    """A survivor's plain hand-over: the engine's module state and the engines' states."""

    def __init__(self, engines: Sequence[Any]) -> None:  # the registry's LiveEngines
        self.engines = list(engines)

    def refusal(self) -> str | None:
        return None

    def serve(self, donor: int, recovery: Any, interrupted: Any) -> None:
        """The donor broadcasts the module's state and the engines' (no save runs again:
        without `restore()` no save was ever handed over)."""
        blob = None
        if dist.get_rank() == donor:
            bundle = {
                "model": self.engines[0].module.state_dict(),
                "engines": [engine.state(recovery) for engine in self.engines],
            }
            blob = live_wire.pack(bundle)
        live_wire.broadcast(blob, donor)


def receive(module: nn.Module, donor: int) -> list[dict[str, Any]]:
    """The replacement: load the donor's weights into `module`; returns the engines' states."""
    bundle = live_wire.unpack(live_wire.broadcast(None, donor))
    module.load_state_dict(bundle["model"])
    finished = int(bundle["engines"][0]["steps"])
    lines.say(
        f"without Checkpointer.restore(): received the weights, buffers and step count "
        f"({finished} steps finished, `ddp.finished_steps`) from rank {donor}; not restored: "
        f"{NOT_RESTORED} (hand them to Checkpointer.restore() to have them handed over)"
    )
    return bundle["engines"]
