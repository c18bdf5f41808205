"""Accelerate and the transformers Trainer on lockstep's engine, in one line.

    from lockstep.adopt.accelerate import Accelerator     # instead of accelerate's
    from lockstep.adopt.accelerate import Trainer         # instead of transformers'

`Accelerator.prepare` wraps models with lockstep's engine under torch's class name
(`lockstep.adopt.torch_face`), so `unwrap_model`, `save_model`, `accumulate`,
`no_sync`, `trigger_sync_in_backward` and the comm hooks of
`DistributedDataParallelKwargs` work as with torch's. `Trainer.train` does the
same for the Trainer, which builds its own Accelerator. transformers is imported
only when `Trainer` is first used.
"""

from __future__ import annotations

from typing import Any

import accelerate
from torch import nn

from lockstep.adopt import adopted


class Accelerator(accelerate.Accelerator):
    """accelerate's `Accelerator` whose DDP is lockstep's engine."""

    def prepare_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        with adopted():
            return super().prepare_model(model, *args, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from lockstep.adopt.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'lockstep.adopt.accelerate' has no attribute {name!r}")
