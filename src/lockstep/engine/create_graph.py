"""backward(create_graph=True): the gradients' values are averaged, their graph is not.

In such a backward the gradients handed to the hooks carry a graph of their
own. The reducer then marks them through `mark_keeping_graph`: the value is
copied into its bucket without recording anything in that graph, `.grad` keeps
the caller's tensor (and its graph, as torch leaves it), and when the step ends
the averaged value is copied back into it. A backward through those gradients
stays local to each rank, as in torch; `warn_once` says so, once per process.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from lockstep.runtime.step import StepState

MarkReady = Callable[[StepState, int, torch.Tensor], None]

_WARNED = [False]


def mark_keeping_graph(
    mark_ready: MarkReady, step: StepState, index: int, param: torch.Tensor
) -> None:
    """`mark_ready` for a gradient with a graph; the average is copied back later."""
    grad = param.grad
    with torch.no_grad():
        mark_ready(step, index, param)
    if grad is not None and param.grad is not grad:
        param.grad = grad
        step.copy_back.append(index)


def warn_once() -> None:
    if not _WARNED[0]:
        _WARNED[0] = True
        warnings.warn(
            "backward(create_graph=True) under DistributedDataParallel: first-order "
            "gradients are averaged across ranks as usual, but the graph they carry is "
            "not synchronised (as in torch): a backward through the gradients themselves "
            "stays local to each rank.",
            UserWarning,
            stacklevel=3,
        )
