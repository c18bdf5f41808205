"""`Trainer`: the transformers Trainer whose training runs on lockstep's engine.

The Trainer builds its Accelerator itself and wraps the model inside `train()`;
this subclass runs `train()` with the adoption on (`lockstep.adopt.adopted`), so
the DDP that Accelerate builds there is lockstep's, under torch's class name.
Public name: `lockstep.adopt.accelerate.Trainer`.
"""

from __future__ import annotations

from typing import Any

import transformers

from lockstep.adopt import adopted


class Trainer(transformers.Trainer):
    """transformers' `Trainer`; `train()` wraps the model with lockstep's engine."""

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with adopted():
            return super().train(*args, **kwargs)
