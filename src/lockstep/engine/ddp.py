"""`DistributedDataParallel`: the bucketed, overlapping engine, as a drop-in for torch's.

Wrapping checks that every rank holds the same parameters, broadcasts rank 0's
weights and buffers, and builds a `Reducer` (buckets and hooks). Each forward
rebuilds the buckets once if due, broadcasts buffers when asked, runs the
module, and arms the reducer; the synchronisation itself happens inside
`loss.backward()`, and `optimizer.step()` stays purely local.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from lockstep.context import DistContext, group_context
from lockstep.engine.bucketing import MB, trainable_parameters
from lockstep.engine.checks import verify_same_parameters
from lockstep.engine.collective import AllReduceMean, CommHook, CommHookCollective
from lockstep.engine.reducer import Reducer, StepObserver
from lockstep.engine.replicas import broadcast_module, broadcast_tensors
from lockstep.engine.stats import StepStats
from lockstep.engine.transport import NATIVE, Transport
from lockstep.engine.unused import unreachable_parameters
from lockstep.observe.envtrace import attach_trace_from_env


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper with torch DDP's arguments and semantics.

    Args:
        module: the model; every rank builds the same one.
        process_group: the replicas' group; the default group when None.
        bucket_cap_mb: cap of every bucket but the first, in MiB.
        first_bucket_cap_mb: cap of the first bucket, in MiB (small, to start early).
        broadcast_buffers: broadcast rank 0's buffers before each forward.
        find_unused_parameters: tolerate parameters that get no gradient in a step.
        gradient_as_bucket_view: let `.grad` be views into the buckets (no extra copy).
        device_ids: for a module on one CUDA device, `[device index]`; inputs move there.
        output_device: accepted for compatibility; outputs stay where the module puts them.
        allreduce: "native" (the backend's), or "ring", "tree", "hierarchical" from
            `lockstep.collectives`.
        local_world_size: processes per node, for allreduce="hierarchical"; by default
            the launcher's LOCAL_WORLD_SIZE (one node when there is none).
        check_data_passes: the step fingerprint (`engine/fingerprint.py`) also compares
            which pass over its DataLoader fed each rank's step, so uneven data is caught
            at the first step it pairs wrongly. Turn off only for a loader that every rank
            restarts when it runs out, for a fixed number of steps.

    Raises:
        ValueError: an argument is out of range.
        RankMismatchError: ranks hold different parameters (raised on every rank).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        first_bucket_cap_mb: float = 1,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        allreduce: str = NATIVE,
        local_world_size: int | None = None,
        check_data_passes: bool = True,
    ) -> None:
        super().__init__()
        self._check_arguments(module, bucket_cap_mb, first_bucket_cap_mb, device_ids)
        self.module = module
        self.process_group = process_group
        self.ctx: DistContext = group_context(process_group, "DistributedDataParallel")
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.device_ids = device_ids
        self.output_device = output_device
        self._sync_grads = True
        self._sync_buffers_before_forward = True
        named = trainable_parameters(module)
        self._build_replicas(named)
        self.reducer = self._build_reducer(
            named,
            bucket_cap_mb,
            first_bucket_cap_mb,
            allreduce,
            local_world_size,
            check_data_passes,
        )
        self.env_tracer = attach_trace_from_env(self)  # LOCKSTEP_TRACE; None when unset

    @staticmethod
    def _check_arguments(
        module: nn.Module, cap_mb: float, first_cap_mb: float, device_ids: list | None
    ) -> None:
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                "DistributedDataParallel expected a module with at least one parameter that "
                "requires grad; found none. Unfreeze a parameter, or do not wrap this module."
            )
        if cap_mb <= 0 or first_cap_mb <= 0:
            raise ValueError(
                f"bucket_cap_mb and first_bucket_cap_mb must be positive; found {cap_mb} and "
                f"{first_cap_mb}"
            )
        if device_ids is not None and len(device_ids) != 1:
            raise ValueError(
                f"device_ids must be None or name exactly one device; found {device_ids}. "
                "Run one process per device."
            )

    def _build_replicas(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Check that every rank holds the same parameters, then copy rank 0's state."""
        verify_same_parameters(named, self.process_group)
        broadcast_module(self.module, self.process_group)

    def _build_reducer(
        self,
        named: list[tuple[str, nn.Parameter]],
        cap_mb: float,
        first_cap_mb: float,
        allreduce: str,
        local_world_size: int | None,
        check_data_passes: bool,
    ) -> Reducer:
        ctx = self.ctx
        transport = Transport(
            self.process_group, allreduce, local_world_size or ctx.local_world_size
        )
        return Reducer(
            named,
            AllReduceMean(transport, ctx.world_size),
            process_group=self.process_group,
            rank=ctx.rank,
            world_size=ctx.world_size,
            first_cap_bytes=int(first_cap_mb * MB),
            cap_bytes=int(cap_mb * MB),
            find_unused=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            check_data_passes=check_data_passes,
        )

    # ---------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        self.reducer.check_previous_step()
        grad_sync = torch.is_grad_enabled() and self._sync_grads
        if torch.is_grad_enabled():
            self.reducer.rebuild_if_needed()
        if self._sync_buffers_before_forward and self.broadcast_buffers:
            self._broadcast_buffers()
        if self.device_ids:
            args, kwargs = self._to_device((args, kwargs))
        output = self.module(*args, **kwargs)
        if not grad_sync:
            self.reducer.forward_without_sync(accumulating=torch.is_grad_enabled())
        else:
            unused = (
                unreachable_parameters(output, self.reducer.params)
                if self.find_unused_parameters
                else []
            )
            self.reducer.arm(unused, start, time.perf_counter())
        # Like torch DDP: buffers are synced before a forward that follows a synced one.
        self._sync_buffers_before_forward = grad_sync
        return output

    def _broadcast_buffers(self) -> None:
        buffers = list(self.module.buffers())
        if buffers and self.ctx.world_size > 1:
            src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
            broadcast_tensors(buffers, src=src, process_group=self.process_group)

    def _to_device(self, tree: Any) -> Any:
        device = (
            torch.device("cuda", self.device_ids[0])
            if isinstance(self.device_ids[0], int)
            else self.device_ids[0]
        )
        return tree_map(
            lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x,
            tree,
        )

    # ------------------------------------------------------------ user calls
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forward and backward inside skip the all-reduce.

        The next forward-backward outside the context reduces the accumulated sum.
        """
        previous = self._sync_grads
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = previous

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the bucket all-reduce with `hook(state, bucket) -> Future[Tensor]`.

        The hook receives the bucket's flat buffer unscaled and must return a future
        whose value is the averaged buffer (torch's comm-hook contract). Once only.
        """
        if not callable(hook):
            raise ValueError(f"hook must be callable; found {type(hook).__name__}")
        if isinstance(self.reducer.collective, CommHookCollective):
            raise RuntimeError(
                "register_comm_hook can only be called once; a hook is already registered"
            )
        self.reducer.set_collective(CommHookCollective(hook, state))

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer(stats)` at the end of every synchronised step (after averaging).

        Observers run inside backward's final callback, so they must be cheap; the
        tracer and the monitor use this to see every step without extra clock reads.
        """
        self.reducer.observers.append(observer)

    @property
    def stats(self) -> StepStats | None:
        """Figures of the last synchronised step, or None before the first."""
        return self.reducer.last_stats

    @property
    def payload_bytes(self) -> int:
        """Gradient bytes all-reduced per synchronised step (the sum of bucket sizes)."""
        return sum(bucket.nbytes for bucket in self.reducer.buckets)

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self.reducer.names[i] for i in idx] for idx in self.reducer.layout]

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict: same keys as without the wrapper."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict saved from the plain module (or from this wrapper)."""
        if any(key.startswith("module.") for key in state_dict):
            state_dict = {key.removeprefix("module."): v for key, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


DDP = DistributedDataParallel
