"""static_graph=True: the same graph every step, so a gradient may arrive in parts.

Reentrant activation checkpointing and a layer run twice make a parameter's
gradient arrive more than once per backward. Under a static graph the first
synchronised step only watches: its hooks count how often each gradient
arrives and when it arrived last; nothing travels during that backward. When
autograd is done (`StaticGraph._flush`) every parameter is marked ready in
last-arrival order (zeros for those that got none), all buckets launch, and one
vote fixes the parameters no rank uses. From the second step on a parameter is
ready when its hook has fired as often as in step one, unused parameters are
pre-marked without walking the graph, and there is no vote. A sink node on the
forward's outputs starts the step from the outermost backward, so the step ends
with the outer graph, not with a reentrant inner one (torch's DDPSink does this).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lockstep.engine.reducer import GradHook, Reducer
from lockstep.errors import LockstepError
from lockstep.runtime.streams import at_backward_end


class _Sink(torch.autograd.Function):
    """Identity on the forward's outputs whose backward starts the synchronised step."""

    @staticmethod
    def forward(ctx: Any, static: StaticGraph, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.static = static
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in outputs)  # a clone, so the caller may edit it in place

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.static.start()
        return (None, *grads)


class StaticGraph:
    """Replaces the reducer's hooks with counting ones; see the module docstring."""

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer
        count = len(reducer.params)
        self.expected: list[int] | None = None  # arrivals per backward, known after step one
        self._arrivals = [0] * count
        self._last = [0] * count
        self._clock = 0
        self._remaining = [0] * count
        reducer.static = True
        reducer.replace_hooks(self._hook_for)

    def unused(self) -> list[int]:
        """Parameters to pre-mark ready when a step starts (none during step one)."""
        if self.expected is None:
            return []
        return [i for i, n in enumerate(self.expected) if n == 0]

    def wrap_output(self, output: Any) -> Any:
        """Route the output tensors that need gradients through the sink."""
        leaves, spec = tree_flatten(output)
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not where:
            return output
        through = _Sink.apply(self, *[leaves[i] for i in where])
        for i, tensor in zip(where, through, strict=True):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def start(self) -> None:
        """Begin the armed step (from the sink, or a hook that came first); once per step."""
        reducer = self.reducer
        step = reducer.driver.step
        if step is None or step.started:
            return
        if self.expected is None:
            # Queued before the driver's `_finalize` (queued by `start`), so it runs first.
            at_backward_end(self._flush)
        else:
            self._remaining = list(self.expected)
        reducer.start(step)

    def _hook_for(self, index: int) -> GradHook:
        reducer = self.reducer

        def hook(param: torch.Tensor) -> None:
            step = reducer.driver.step
            if step is None:
                reducer.outside_step(index)
                return
            if not step.started:
                self.start()
            step.used[index] = True
            if self.expected is None:
                self._arrivals[index] += 1
                self._clock += 1
                self._last[index] = self._clock
                return
            self._remaining[index] -= 1
            if self._remaining[index] == 0:
                reducer.mark(step, index, param)
            elif self._remaining[index] < 0:
                raise self._changed(index)

        return hook

    def _flush(self) -> None:
        """End of step one: every parameter ready, in the order gradients last arrived."""
        step = self.reducer.driver.step
        assert step is not None
        self.expected = list(self._arrivals)
        order = sorted(
            range(len(self._last)), key=lambda i: (self._arrivals[i] == 0, self._last[i])
        )
        for index in order:
            self.reducer.mark(step, index, self.reducer.params[index])

    def _changed(self, index: int) -> LockstepError:
        reducer = self.reducer
        return LockstepError(
            f"on rank {reducer.rank}: parameter {reducer.names[index]!r} received more "
            f"gradients in this backward than the {self.expected[index] if self.expected else 0} "
            "of the first step, but static_graph=True promises the same graph every step. "
            "Pass static_graph=False (and find_unused_parameters=True if some parameters "
            "go unused), or keep the graph the same."
        )
