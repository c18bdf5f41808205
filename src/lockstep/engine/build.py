"""What a DDP wrapper is made of, built from its checked arguments.

`build_reducer` picks the transport (native or one of lockstep's algorithms),
the bucket collective (the averaging all-reduce, or mixed precision's
reduce-dtype one, wrapped to skip unused buckets when asked) and builds the
`Reducer`; `build_mixed_precision` the parameter swap of torch's
`_MixedPrecision`, whose fp32 restore is an end-of-step action of the driver.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep.context import DistContext
from lockstep.engine.args import DDPArguments
from lockstep.engine.mixed_precision import MixedPrecision, MixedPrecisionReduce
from lockstep.engine.reducer import BucketCaps, Reducer
from lockstep.runtime.bucket_collective import AllReduceMean, BucketCollective, SkipUnusedBuckets
from lockstep.runtime.finite import FiniteGuard, bucket_params
from lockstep.runtime.replica_check import ReplicaGuard, wanted
from lockstep.runtime.transport import Transport


def with_skip(args: DDPArguments, collective: BucketCollective) -> BucketCollective:
    """`collective`, skipping buckets without gradients if skip_all_reduce_unused_params."""
    return SkipUnusedBuckets(collective) if args.skip_all_reduce_unused_params else collective


def build_nonfinite(
    args: DDPArguments, ctx: DistContext, named: list[tuple[str, nn.Parameter]], module: nn.Module
) -> FiniteGuard:
    """The check of non-finite gradients (`runtime/finite.py`), in the mode asked for."""

    def drop_grads() -> None:
        for param in module.parameters():
            param.grad = None

    locate = bucket_params([name for name, _ in named])
    return FiniteGuard(args.nonfinite, args.group, ctx.rank, locate, drop_grads)


def build_replicas(
    args: DDPArguments, ctx: DistContext, reducer: Reducer, state: list[tuple[str, torch.Tensor]]
) -> ReplicaGuard:
    """The replica check (`runtime/replica_check.py`) of the reducer's parameters and the
    rest of `state` (buffers, frozen parameters), attached to the reducer's driver (its
    end_step first of the driver's end-of-step actions)."""
    named = list(zip(reducer.names, reducer.params, strict=True))
    trained = {id(p) for p in reducer.params}
    others = [(n, t) for n, t in state if id(t) not in trained]
    # init_sync=False: torch lets each rank start from its own weights; not compared
    on = wanted(args.init_sync if args.check_replicas is None else args.check_replicas)
    guard = ReplicaGuard(on, args.group, ctx.rank, ctx.world_size, named, others)
    guard.attach(reducer.driver)
    return guard


def build_reducer(
    args: DDPArguments,
    ctx: DistContext,
    named: list[tuple[str, nn.Parameter]],
    guard: FiniteGuard,
    reducer_type: type[Reducer] = Reducer,
) -> Reducer:
    """The reducer over `named` with the collective the arguments ask for, checked by `guard`."""
    transport = Transport(args.group, args.allreduce, args.local_world_size or ctx.local_world_size)
    mp = args.mixed_precision
    collective: BucketCollective = AllReduceMean(transport, ctx.world_size, args.batched_grad_copy)
    if mp is not None:  # gradients in param_dtype cannot be views of full buckets
        collective = MixedPrecisionReduce(
            transport, ctx.world_size, mp.param_dtype, mp.reduce_dtype
        )
    return reducer_type(
        named,
        guard.wrap(with_skip(args, collective)),
        process_group=args.group,
        ctx=ctx,
        caps=BucketCaps(*args.caps_bytes()),
        find_unused=args.find_unused_parameters,
        gradient_as_bucket_view=args.gradient_as_bucket_view and mp is None,
        check_data_passes=args.check_data_passes,
    )


def build_mixed_precision(
    args: DDPArguments, reducer: Reducer, module: nn.Module, params: list[nn.Parameter]
) -> MixedPrecision | None:
    """torch's `_MixedPrecision` on this wrapper, or None; its restore ends every step."""
    if args.mixed_precision is None:
        return None
    buffers: list[torch.Tensor] = [
        b for b in module.buffers() if not getattr(b, "_ddp_ignored", False)
    ]
    mp = MixedPrecision(args.mixed_precision, params, buffers)
    reducer.driver.end_of_step.append(mp.after_step)
    return mp
