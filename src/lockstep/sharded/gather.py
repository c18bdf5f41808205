"""Stage 3: gather each unit's weights just before use, free them after, prefetch the next.

Forward: the root unit is gathered when the wrapper's forward begins; a wrapped
unit in its forward pre-hook (waiting for the prefetch started by the unit
before it, then prefetching the unit after it), and freed in its forward
post-hook. Backward: a hook on the unit's outputs fires before its gradients are
computed; it gathers the unit again and prefetches the unit that ran before it
in forward. Once a flat's gradient is taken it is freed (`GradSync.after_grad`);
at the end of backward everything still gathered is freed.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lockstep.runtime import waits
from lockstep.runtime.handles import CollectiveHandle
from lockstep.sharded.flat import FlatParam
from lockstep.sharded.timeline import Timeline


class Unit:
    """A unit of stage 3: a module (None for the root) and its flats, one per dtype."""

    def __init__(self, name: str, module: nn.Module | None, flats: list[FlatParam]) -> None:
        self.name, self.module, self.flats = name, module, flats
        self.pending: list[CollectiveHandle] = []
        self.viewed = False
        self.timeline: Timeline | None = None
        self.step = 1  # the synchronised step these gathers serve, for stall reports
        self.reshard_after_forward = True  # False: stays gathered until its backward

    def start_gather(self) -> None:
        """Start the all-gathers of the flats that are not gathered (a prefetch)."""
        for flat in self.flats:
            if not flat.gathered:
                start = time.perf_counter()
                self.pending.append(flat.gather())
                if self.timeline is not None:
                    self.timeline.collective("all-gather", self.name, self.pending[-1], start)

    def ensure_gathered(self) -> None:
        """Gather (or finish gathering) every flat; point the module at its views once per step."""
        self.start_gather()
        if self.timeline is not None:
            self.timeline.poll()
        self._wait_pending()
        if not self.viewed:
            for flat in self.flats:
                flat.use_views()
            self.viewed = True

    def free(self) -> None:
        self._wait_pending()
        for flat in self.flats:
            flat.free()

    def _wait_pending(self) -> None:
        """Wait for the unit's all-gathers; a long wait is reported (`runtime/waits.py`)."""
        group = self.flats[0].process_group if self.flats else None
        for handle in self.pending:
            waits.wait(handle, f"all-gather of unit {self.name!r} in step", self.step, -1, group)
        self.pending = []


class GatherScheduler:
    """Registers the hooks of stage 3 and keeps the order units ran in.

    Args:
        root: the unit of parameters outside every wrapped module, if any.
        units: the wrapped units, in registration order (the first forward's guess).
        prefetch: start the next unit's all-gather before the current one runs.
    """

    def __init__(self, root: Unit | None, units: list[Unit], prefetch: bool) -> None:
        self.root, self.units, self.prefetch = root, units, prefetch
        self.order: list[Unit] = list(units)
        self._seen: list[Unit] = []
        for unit in units:
            assert unit.module is not None
            unit.module.register_forward_pre_hook(self._pre_forward_for(unit))
            unit.module.register_forward_hook(self._post_forward_for(unit))

    def begin_forward(self, step: int) -> None:
        """The wrapper's forward of `step` begins: gather the root, prefetch the first unit."""
        self._seen = []
        for unit in self.all_units():
            unit.viewed = False
            unit.step = step
        if self.root is not None:
            self.root.ensure_gathered()
        if self.prefetch and self.order:
            self.order[0].start_gather()

    def end_forward(self) -> None:
        """The wrapper's forward returned: remember the order; without grad, free the root."""
        if self._seen:
            self.order = list(self._seen)
        if not torch.is_grad_enabled() and self.root is not None:
            self.root.free()

    def free_all(self) -> None:
        """End of backward: nothing stays gathered."""
        for unit in self.all_units():
            unit.free()

    def all_units(self) -> list[Unit]:
        return ([self.root] if self.root is not None else []) + self.units

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        order = self.order
        if unit not in order:
            return None
        i = order.index(unit) + step
        return order[i] if 0 <= i < len(order) else None

    def _pre_forward_for(self, unit: Unit) -> Any:
        def pre_forward(module: nn.Module, args: Any) -> None:
            unit.ensure_gathered()
            self._seen.append(unit)
            nxt = self._neighbour(unit, +1)
            if self.prefetch and nxt is not None:
                nxt.start_gather()

        return pre_forward

    def _post_forward_for(self, unit: Unit) -> Any:
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                needing = [t for t in tree_leaves(output) if _needs_grad(t)]
                if needing:
                    torch.autograd.graph.register_multi_grad_hook(
                        needing, self._pre_backward_for(unit), mode="any"
                    )
                if not unit.reshard_after_forward:
                    return  # kept: backward finds it gathered, no second all-gather
            unit.free()

        return post_forward

    def _pre_backward_for(self, unit: Unit) -> Any:
        def pre_backward(_: Any) -> None:
            unit.ensure_gathered()
            before = self._neighbour(unit, -1)
            if self.prefetch and before is not None:
                before.start_gather()

        return pre_backward


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad
