"""`ShardedDataParallel`: ZeRO stages 1, 2 and 3 behind DDP's training loop.

Wrapping checks the arguments and the parameters on every rank, broadcasts
rank 0's state, groups the trainable parameters into units (`units.py`) and
flattens each into a `FlatParam` whose shard is what `parameters()` yields, so
an unchanged optimizer holds 1/N of the optimizer state. Each forward first
all-gathers the shards the optimizer updated (stages 1 and 2) or schedules the
per-unit gathers (stage 3, `gather.py`); backward reduces gradients (`sync.py`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.context import DistContext, group_context
from lockstep.runtime import waits
from lockstep.runtime.bucketing import MB
from lockstep.runtime.driver import BackwardDriver
from lockstep.runtime.finite import FiniteGuard, NonFinite, flat_params
from lockstep.runtime.meta import refuse_meta
from lockstep.runtime.nesting import refuse_inside_torch_ddp, refuse_wrapped_inside
from lockstep.runtime.replicate import broadcast_module
from lockstep.runtime.same_parameters import verify_same_parameters
from lockstep.runtime.step_figures import StepFigures, SyncToggle
from lockstep.runtime.wrap_hooks import weakly, wrapped
from lockstep.sharded import optim_state
from lockstep.sharded import state as sharded_state
from lockstep.sharded.arguments import check_arguments
from lockstep.sharded.build import build_flats
from lockstep.sharded.clip import clip_grad_norm_
from lockstep.sharded.flat import FlatParam
from lockstep.sharded.gather import GatherScheduler, Unit
from lockstep.sharded.hybrid import grad_collective
from lockstep.sharded.mesh import build_mesh, resolve_shard_size
from lockstep.sharded.modes import resolve_modes
from lockstep.sharded.precision import cast_inputs, cast_output, unit_input_hook
from lockstep.sharded.reshard import ReshardRule
from lockstep.sharded.sync import GradSync
from lockstep.sharded.timeline import Timeline
from lockstep.sharded.units import UnitSpec, bucket_units, collect_params, wrap_units


class ShardedDataParallel(nn.Module, StepFigures, SyncToggle):
    """Data parallelism with the optimizer state (1), gradients (2), weights (3) sharded.

    Args:
        module: the model; every rank builds the same one.
        stage: 1, 2 or 3 (ZeRO's stages; 3 is what torch calls FSDP).
        process_group: the group to shard over; the default group when None.
        bucket_cap_mb: stages 1 and 2: cap of every bucket but the first, in MiB.
        first_bucket_cap_mb: stages 1 and 2: cap of the first bucket, in MiB.
        wrap: stage 3: module classes whose instances are gathered and freed as units.
        prefetch: stage 3: start the next unit's all-gather before the current one runs.
        check_data_passes: the step fingerprint compares passes over the data (as DDP's).
        nonfinite: "raise", "skip" or "off": what a step whose gradients hold NaN or inf
            on some rank does (`lockstep.runtime.finite`, docs/engine.md).
        mp_policy: FSDP2's mixed precision (`lockstep.MixedPrecisionPolicy` or torch's).
        reshard_after_forward: stage 3: free a unit after forward (True), keep it gathered
            until its backward (False), per unit by class, name or callable (`reshard.py`).
        hybrid: stages 2 and 3: HSDP, shard within groups of `shard_group_size` ranks,
            replicate across them (`sharded/mesh.py`, `sharded/hybrid.py`).
        shard_group_size: with hybrid, ranks per shard group; a node's (LOCAL_WORLD_SIZE)
            when None.

    Raises:
        ValueError: on every rank, for a stage outside 1..3, a wrap class that matches
            nothing, or arguments that differ between ranks.
        RankMismatchError: ranks hold different parameters (raised on every rank).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        first_bucket_cap_mb: float = 1,
        wrap: Sequence[type] | None = None,
        prefetch: bool = True,
        check_data_passes: bool = True,
        nonfinite: str = "raise",
        mp_policy: Any = None,
        reshard_after_forward: ReshardRule = True,
        hybrid: bool = False,
        shard_group_size: int | None = None,
    ) -> None:
        super().__init__()
        refuse_wrapped_inside(module, "lockstep.ShardedDataParallel")
        refuse_meta(module, process_group, "lockstep.ShardedDataParallel")
        self.ctx: DistContext = group_context(process_group, "ShardedDataParallel")
        setting = {"stage": stage, "wrap": [w.__name__ for w in wrap or []], "cap": bucket_cap_mb}
        setting["nonfinite"] = NonFinite.parse(nonfinite).value  # every rank ends such a step alike
        size = resolve_shard_size(hybrid, shard_group_size, self.ctx)
        setting.update(hybrid=hybrid, shard_group_size=size)
        shard_size = size if hybrid and size else self.ctx.world_size  # reshard's "True"
        modes = resolve_modes(module, stage, wrap, mp_policy, reshard_after_forward, shard_size)
        check_arguments(module, {**setting, **modes.setting()}, wrap, process_group, modes.problem)
        self.mp_policy, self._kept = modes.policy, set(modes.kept)
        self.mesh = build_mesh(process_group, self.ctx, stage, hybrid, size)
        self.module, self.stage, self.process_group = module, stage, process_group
        self.require_backward_grad_sync = True
        self._params_stale = False
        self._keys = list(module.state_dict().keys())
        self._plain_index = {id(p): i for i, p in enumerate(module.parameters())}
        trainable = collect_params(module)
        verify_same_parameters([(s.names[0], s.param) for s in trainable], process_group)
        broadcast_module(module, self.ctx.global_rank(0), process_group)
        if stage == 3:
            specs = wrap_units(module, collect_params(module, trainable_only=False), wrap or [])
        else:
            specs = bucket_units(trainable, int(first_bucket_cap_mb * MB), int(bucket_cap_mb * MB))
        self.flats, units = self._build_flats(specs)
        self.scheduler = self._build_scheduler(units, prefetch) if stage == 3 else None
        self.grad_sync = self._build_sync(check_data_passes, nonfinite)
        self.timeline: Timeline | None = None
        wrapped(self)  # upper layers attach here (LOCKSTEP_TRACE: `lockstep/observe/trace_hook.py`)

    @property
    def step_driver(self) -> BackwardDriver:
        """The shared backward driver (`runtime/driver.py`): fingerprint, waits, stats."""
        return self.grad_sync.driver

    def _build_flats(self, specs: list[UnitSpec]) -> tuple[list[FlatParam], list[Unit]]:
        """One FlatParam per (unit, dtype, trainable); shards become this wrapper's parameters."""
        flats, units = build_flats(specs, self.mesh, self.stage < 3, self.mp_policy)
        # Registered under "shards" so parameters(), .to() and named_parameters() see them.
        self.shards = nn.ParameterList([flat.shard for flat in flats])
        return flats, units

    def _build_scheduler(self, units: list[Unit], prefetch: bool) -> GatherScheduler:
        root = next((u for u in units if u.module is None), None)
        wrapped = [u for u in units if u.module is not None]
        hook = unit_input_hook(self.mp_policy)  # FSDP2 casts each unit's inputs too
        for unit in wrapped:
            unit.reshard_after_forward = unit.name not in self._kept
            if hook is not None and unit.module is not None:
                unit.module.register_forward_pre_hook(hook, with_kwargs=True)
        return GatherScheduler(root, wrapped, prefetch)

    def _build_sync(self, check_data_passes: bool, nonfinite: str) -> GradSync:
        ctx = self.ctx
        device = self.flats[0].full.device
        collective = grad_collective(
            self.stage, self.mesh, ctx.world_size, ctx.local_world_size, device
        )
        trainable = [flat for flat in self.flats if flat.trainable]
        if self.stage == 3:  # the last unit's gradient is ready first
            trainable.reverse()
        locate = flat_params(trainable, self.mesh.shard_rank)  # the shard of each result
        self.nonfinite = FiniteGuard(  # runtime/finite.py: checked per flat, decided at the end
            nonfinite, self.process_group, ctx.rank, locate, weakly(self._drop_grads)
        )
        sync = GradSync(
            trainable,
            collective,
            self.process_group,
            ctx.rank,
            ctx.world_size,
            keep_full_grad=self.stage == 1 and not any(f.dtypes.differ for f in trainable),
            after_grad=(lambda flat: flat.free()) if self.scheduler else (lambda flat: None),
            at_backward_end=weakly(self._at_backward_end),
            check_data_passes=check_data_passes,
        )
        sync.driver.collective = self.nonfinite.wrap(collective)  # buckets laid out unwrapped
        self.nonfinite.attach(sync.driver)
        sync.driver.wire_counter = getattr(collective, "take_wire_bytes", None)
        stop = getattr(collective, "stop", None)  # a worker thread: it ends with the wrapper,
        if stop is not None:  # which the hooks on the flat parameters outlive
            weakref.finalize(self, stop)
        return sync

    # ---------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        refuse_inside_torch_ddp("lockstep.ShardedDataParallel")
        start = time.perf_counter()
        span = self.timeline.begin("compute", "forward") if self.timeline else None
        driver = self.grad_sync.driver
        driver.check_previous_step()
        grad_enabled = torch.is_grad_enabled()
        if self.stage < 3:
            self._refresh_full()
            for flat in self.flats:
                flat.use_views()
        else:
            assert self.scheduler is not None
            self.scheduler.begin_forward(driver.steps + 1)
        args, kwargs = cast_inputs(self.mp_policy, args, kwargs)
        output = cast_output(self.mp_policy, self.module(*args, **kwargs))
        if self.scheduler is not None:
            self.scheduler.end_forward()
        if grad_enabled and self.require_backward_grad_sync:
            self.grad_sync.arm(start, time.perf_counter())
            self.nonfinite.note_forward()  # fp16 autocast: GradScaler owns overflow
        else:
            driver.forward_without_sync(accumulating=grad_enabled)
        if self.timeline is not None and span is not None:
            self.timeline.end(span)
        return output

    def _refresh_full(self) -> None:
        """Stages 1 and 2, after a synchronised backward: all-gather the updated shards.

        Stage 1's averaged gradient in `full.grad` has been consumed by then (the
        optimizer read its shard), so it is dropped and the next backward starts afresh.
        """
        if not self._params_stale:
            return
        for flat in self.flats:
            flat.full.grad = None
        step = self.step_driver.steps + 1
        for flat, handle in [(flat, flat.gather()) for flat in self.flats]:
            what = f"parameter all-gather {flat.index} before step"
            waits.wait(handle, what, step, -1, self.process_group)
        self._params_stale = False

    def _at_backward_end(self, synchronised: bool) -> None:
        if self.scheduler is not None:
            self.scheduler.free_all()
        if synchronised:
            self._params_stale = True

    def _drop_grads(self) -> None:
        for flat in self.flats:
            flat.shard.grad = None
            flat.full.grad = flat.accumulated = None

    def record_timeline(self, timeline: Timeline | None) -> None:
        """Record forward, backward and every collective into `timeline` (None: stop)."""
        self.timeline = timeline
        self.grad_sync.record_into(timeline)
        for unit in self.scheduler.all_units() if self.scheduler else []:
            unit.timeline = timeline

    # ------------------------------------------------------------ user calls
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the shards' gradients by the global norm over every rank's shards."""
        return clip_grad_norm_(
            [flat.shard for flat in self.flats], max_norm, norm_type, self.mesh.shard_group
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The full state dict with the plain module's keys; every rank must call it."""
        rest = self.module.state_dict()
        return sharded_state.full_state_dict(self.flats, self._keys, rest)

    def state_dict_keys(self) -> list[str]:
        """The plain module's state-dict keys, in order (what `state_dict` returns)."""
        return list(self._keys)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Any, strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a full state dict (from the plain module, DDP or this wrapper) into the shards."""
        state = {k.removeprefix("module."): v for k, v in state_dict.items()}
        missing = [k for k in self._keys if k not in state]
        unexpected = [k for k in state if k not in self._keys]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"ShardedDataParallel.load_state_dict expected the plain module's keys; "
                f"missing {missing[:6]}, unexpected {unexpected[:6]} (rank {self.ctx.rank})"
            )
        sharded_state.load_flats(self.flats, state, self.mesh.shard_rank)
        entries = sharded_state.flat_entries(self.flats)
        rest = {k: v for k, v in state.items() if k not in entries}
        return self.module.load_state_dict(rest, strict=False)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer`'s state as the plain model's per-parameter state dict (every rank)."""
        return optim_state.gather_optimizer_state(optimizer, self.flats, self._plain_index)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
    ) -> None:
        """Load a per-parameter optimizer state (ours, or a plain/DDP one), at any world size."""
        optim_state.load_optimizer_state(
            optimizer, self.flats, self._plain_index, saved, self.mesh.shard_rank
        )


def FSDP(module: nn.Module, **kwargs: Any) -> ShardedDataParallel:
    """Fully sharded data parallel: `ShardedDataParallel` with stage 3."""
    return ShardedDataParallel(module, stage=3, **kwargs)
