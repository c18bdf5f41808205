"""Per-GPU memory of the model states under DDP, ZeRO-1, ZeRO-2 and fully sharded training.

The accounting of the ZeRO paper (Rajbhandari et al., 2020, section 3): with Ψ
parameters, weights take Ψ x weight bytes, gradients T x gradient bytes and the
optimizer T x K bytes, where T is the trainable count (T = Ψ for a full fine-tune)
and K the optimizer bytes per parameter (12 for mixed-precision Adam: fp32 master
weights, momentum and variance; the master copy is counted whenever the weights are
narrower than fp32). DDP replicates all three on each of N GPUs;
ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 (FSDP's full
sharding) also the weights. Activations and temporary buffers are not included.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lockstep.plan.units import DType


class Strategy(Enum):
    """How the model states are spread over the data-parallel GPUs."""

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"

    @property
    def label(self) -> str:
        return {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3 / FSDP"}[
            self.value
        ]

    @property
    def sharded(self) -> tuple[bool, bool, bool]:
        """Whether (weights, gradients, optimizer state) are split over the GPUs."""
        return {
            "ddp": (False, False, False),
            "zero1": (False, False, True),
            "zero2": (False, True, True),
            "zero3": (True, True, True),
        }[self.value]


class Optimizer(Enum):
    """Optimizers by the number of state tensors they keep per trainable parameter."""

    ADAM = ("adam", 2)
    MOMENTUM = ("momentum", 1)
    SGD = ("sgd", 0)

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def states(self) -> int:
        return self.value[1]

    def bytes_per_param(self, state_dtype: DType, master_copy: bool) -> int:
        """Optimizer bytes per trainable parameter.

        Args:
            state_dtype: type of the state tensors.
            master_copy: count an fp32 copy of the weights, as mixed-precision training
                keeps when the weights themselves are fp16 or bf16.
        """
        return self.states * state_dtype.nbytes + (4 if master_copy else 0)


def parse_optimizer(text: str, arg: str) -> Optimizer:
    """Parse an optimizer name; the error lists the accepted ones."""
    for opt in Optimizer:
        if opt.label == text.strip().lower():
            return opt
    names = ", ".join(o.label for o in Optimizer)
    raise ValueError(f"{arg} expects one of {names}; found {text!r}")


@dataclass(frozen=True)
class StateBytes:
    """Bytes of the three model states on one GPU."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def replicated_bytes(
    total_params: int, trainable_params: int, weight_bytes: int, grad_bytes: int, optim_bytes: float
) -> StateBytes:
    """The unsharded model states: what one GPU holds under DDP."""
    return StateBytes(
        weights=total_params * weight_bytes,
        grads=trainable_params * grad_bytes,
        optimizer=trainable_params * optim_bytes,
    )


def per_gpu_bytes(full: StateBytes, strategy: Strategy, world_size: int) -> StateBytes:
    """The share of `full` that one of `world_size` GPUs holds under `strategy`.

    Raises:
        ValueError: world_size is not positive.
    """
    if world_size < 1:
        raise ValueError(f"the GPU count must be at least 1; found {world_size}")
    w, g, o = strategy.sharded
    return StateBytes(
        weights=full.weights / world_size if w else full.weights,
        grads=full.grads / world_size if g else full.grads,
        optimizer=full.optimizer / world_size if o else full.optimizer,
    )
