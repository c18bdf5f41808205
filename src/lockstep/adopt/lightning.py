"""Lightning strategies on lockstep's engine: `Trainer(strategy="lockstep")`, `Fabric(...)` too.

    import lockstep.adopt.lightning                        # registers the name "lockstep"
    trainer = L.Trainer(strategy="lockstep")         # or LockstepStrategy(**ddp_kwargs)
    fabric = L.Fabric(strategy="lockstep")           # or LockstepFabricStrategy(...)

Each is Lightning's own DDP strategy (same arguments: `find_unused_parameters`,
`static_graph`, `ddp_comm_hook`, ...), except that the model is wrapped by
lockstep's engine under torch's class name (`lockstep.adopt.torch_face`), so
Lightning's checks, `no_backward_sync`, checkpoints and comm hooks keep working.
Launch with `lockstep run`, `torchrun`, or Lightning's own launcher.
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lockstep.adopt import adopted

NAME = "lockstep"


class LockstepStrategy(DDPStrategy):
    """The Lightning Trainer's DDP strategy, with lockstep's engine."""

    strategy_name = NAME

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        with adopted():
            return super()._setup_model(model)


class LockstepFabricStrategy(FabricDDPStrategy):
    """Lightning Fabric's DDP strategy, with lockstep's engine."""

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        with adopted():
            return super().setup_module(module)


def _register() -> None:
    description = "DDP on lockstep's engine (lockstep.adopt.lightning)"
    if NAME not in StrategyRegistry:
        StrategyRegistry.register(NAME, LockstepStrategy, description=description)
    if NAME not in FABRIC_REGISTRY:
        FABRIC_REGISTRY.register(NAME, LockstepFabricStrategy, description=description)


_register()
