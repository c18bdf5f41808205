"""What the planner knows about a model: parameter counts, their sizes, the Linear layers.

A `ModelShape` comes from a bare count (`7B`), a preset architecture, or a module
counted on the meta device. `trainable_for` turns it and the user's choice (full
fine-tune, LoRA rank r on target layers, or an explicit count) into the trainable
parameters, whose gradients are the all-reduce payload. LoRA adds, to each target
Linear(in, out), a down projection r x in and an up projection out x r (Hu et al.,
2021); targets match a module's qualified name or its last components, as peft does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LinearInfo:
    """One Linear layer: its qualified name and its input and output features."""

    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelShape:
    """A model as counted.

    Attributes:
        label: how the user named it.
        kind: "count", "preset" or "module".
        total_params: every parameter, tied ones counted once.
        trainable_numels: sizes of the parameters that require grad, registration
            order; None when only a count is known.
        linears: the Linear layers, module order (empty for a bare count).
    """

    label: str
    kind: str
    total_params: int
    trainable_numels: tuple[int, ...] | None = None
    linears: tuple[LinearInfo, ...] = ()

    def __post_init__(self) -> None:
        if self.total_params < 1:
            raise ValueError(f"a model needs at least 1 parameter; found {self.total_params}")


@dataclass(frozen=True)
class Trainable:
    """The parameters that train, hence whose gradients travel.

    Attributes:
        count: trainable parameters.
        numels: their sizes in registration order, or None when unknown.
        added_params: parameters added to the model (LoRA adapters), 0 otherwise.
        description: one line for the report ("full fine-tune", "LoRA r=8 on q_proj").
    """

    count: int
    numels: tuple[int, ...] | None
    added_params: int
    description: str


def matches_target(name: str, target: str) -> bool:
    """Whether module `name` is a LoRA target: the same name, or ending in `.target`."""
    return name == target or name.endswith("." + target)


def lora_numels(linears: Sequence[LinearInfo], rank: int, targets: Sequence[str]) -> list[int]:
    """Adapter parameter sizes for every targeted Linear, in module order.

    Raises:
        ValueError: a target matches no Linear layer; the message lists some that exist.
    """
    numels: list[int] = []
    for target in targets:
        if not any(matches_target(lin.name, target) for lin in linears):
            names = sorted({lin.name.rsplit(".", 1)[-1] for lin in linears})
            raise ValueError(
                f"--lora-targets: {target!r} matches no Linear layer; layer names here "
                f"end in: {', '.join(names[:12]) or '(no Linear layers)'}"
            )
    for lin in linears:
        if any(matches_target(lin.name, t) for t in targets):
            numels += [rank * lin.in_features, lin.out_features * rank]
    return numels


def full_trainable(shape: ModelShape) -> Trainable:
    """A full fine-tune: every parameter that requires grad trains."""
    numels = shape.trainable_numels
    count = sum(numels) if numels is not None else shape.total_params
    return Trainable(count, numels, 0, "full fine-tune")


def lora_trainable(shape: ModelShape, rank: int, targets: Sequence[str]) -> Trainable:
    """LoRA of rank `rank` on `targets`: only the adapters train; the base is frozen.

    Raises:
        ValueError: the rank is not positive, no targets, or the model has no layer
            shapes (a bare count).
    """
    if rank < 1:
        raise ValueError(f"--lora-rank must be a positive integer; found {rank}")
    if not targets:
        raise ValueError("--lora-targets expects layer names such as q_proj,v_proj; found none")
    if not shape.linears:
        raise ValueError(
            "--lora-rank needs the model's layer shapes: give --model as a preset or as "
            "pkg.module:factory, or give --trainable COUNT (for example 4M) instead"
        )
    numels = lora_numels(shape.linears, rank, targets)
    count = sum(numels)
    return Trainable(count, tuple(numels), count, f"LoRA r={rank} on {','.join(targets)}")


def counted_trainable(shape: ModelShape, count: int) -> Trainable:
    """An explicit trainable count (part of the model, e.g. the unfrozen top layers).

    Raises:
        ValueError: more trainable than total parameters.
    """
    if count > shape.total_params:
        raise ValueError(
            f"--trainable must not exceed the model's {shape.total_params} parameters; "
            f"found {count}"
        )
    return Trainable(count, None, 0, f"{count} trainable (given)")
