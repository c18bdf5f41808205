"""One step of the user's model on one process: when each gradient is ready, and phase times.

`profile_step` runs a few training steps with no process group and a
post-accumulate-grad hook on every trainable parameter (the hook the engine's
Reducer uses, doing its copy into a bucket slot), and keeps the median of:
forward, backward (loss included, as the engine counts it), optimizer, and each
parameter's ready time from the start of backward. The simulation (simulate.py)
buckets these parameters as the engine would and replays the step on a link.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep.runtime.bucketing import trainable_parameters


@dataclass(frozen=True)
class ParamTiming:
    """One trainable parameter (or, from a trace, one whole bucket) and its ready time.

    Attributes:
        name: qualified parameter name (`bucket 3` when read from a trace).
        numel: elements of its gradient.
        element_size: bytes per element.
        dtype: torch dtype name (`float32`), for bucketing by dtype.
        ready_s: seconds from the start of backward until its gradient was ready.
    """

    name: str
    numel: int
    element_size: int
    dtype: str
    ready_s: float

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class StepProfile:
    """A training step as measured on one process (times in seconds).

    Attributes:
        params: trainable parameters in registration order, each with its ready time.
        forward_s: the model's forward.
        backward_s: from the end of forward to the end of backward (loss included).
        optimizer_s: `optimizer.step()` and `zero_grad()`.
        source: where the figures come from, printed beside the prediction.
        prebucketed: each entry of `params` is one engine bucket (read from a trace).
    """

    params: tuple[ParamTiming, ...]
    forward_s: float
    backward_s: float
    optimizer_s: float
    source: str
    prebucketed: bool = False

    def __post_init__(self) -> None:
        if not self.params:
            raise ValueError(f"{self.source}: no trainable parameter; nothing to all-reduce")
        for name in ("forward_s", "backward_s", "optimizer_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.source}: {name} must be >= 0; found {getattr(self, name)}")

    @property
    def compute_s(self) -> float:
        """The step on one process: forward + backward + optimizer."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def payload_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)


def profile_step(
    model: nn.Module,
    run_step: Callable[[], tuple[Any, Callable[[Any], torch.Tensor]]],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 5,
    warmup: int = 2,
    source: str = "profile",
) -> StepProfile:
    """Time `steps` steps of `model` (after `warmup`) and keep the median of each figure.

    Args:
        model: the model; its trainable parameters get a ready hook during profiling.
        run_step: runs the forward and returns `(output, loss_fn)`; backward starts
            from `loss_fn(output)`, so the loss counts as backward, as in the engine.
        optimizer: steps the model's parameters.
        steps: timed steps (the median is kept).
        warmup: untimed steps first (allocations, lazy initialisation).
        source: label printed with the prediction.

    Raises:
        ValueError: steps < 1 or warmup < 0, or the model has no trainable parameter.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"--profile-steps must be >= 1 and warmup >= 0; found {steps}, {warmup}")
    named = trainable_parameters(model)
    if not named:
        raise ValueError(f"{source}: the model has no parameter that requires grad")
    stamps: list[float | None] = [None] * len(named)
    handles = [
        p.register_post_accumulate_grad_hook(_stamp(stamps, i, torch.empty_like(p)))
        for i, (_, p) in enumerate(named)
    ]
    try:
        runs = [_one_step(run_step, optimizer, stamps) for _ in range(warmup + steps)][warmup:]
    finally:
        for handle in handles:
            handle.remove()
    return _median_profile(named, runs, source)


def _stamp(
    stamps: list[float | None], index: int, slot: torch.Tensor
) -> Callable[[torch.Tensor], None]:
    """The ready hook: copy the gradient into a slot scaled by 1/N, as the engine's hook
    does for a gradient autograd allocated afresh, then note the time."""

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            torch.mul(param.grad, 0.5, out=slot)
        stamps[index] = time.perf_counter()

    return hook


def _one_step(
    run_step: Callable[[], Any], optimizer: torch.optim.Optimizer, stamps: list[float | None]
) -> tuple[float, float, float, list[float]]:
    """(forward, backward, optimizer, ready time of each parameter from backward's start)."""
    stamps[:] = [None] * len(stamps)
    start = time.perf_counter()
    output, loss_fn = run_step()
    forward_end = time.perf_counter()
    loss_fn(output).backward()
    backward_end = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    optimizer_end = time.perf_counter()
    # A parameter that got no gradient is counted ready at the end of backward.
    ready = [(t if t is not None else backward_end) - forward_end for t in stamps]
    return forward_end - start, backward_end - forward_end, optimizer_end - backward_end, ready


def _median_profile(
    named: Sequence[tuple[str, nn.Parameter]], runs: list[tuple], source: str
) -> StepProfile:
    forward = statistics.median(r[0] for r in runs)
    backward = statistics.median(r[1] for r in runs)
    optimizer = statistics.median(r[2] for r in runs)
    params = tuple(
        ParamTiming(
            name,
            p.numel(),
            p.element_size(),
            str(p.dtype).removeprefix("torch."),
            statistics.median(r[3][i] for r in runs),
        )
        for i, (name, p) in enumerate(named)
    )
    return StepProfile(params, forward, backward, optimizer, source)
