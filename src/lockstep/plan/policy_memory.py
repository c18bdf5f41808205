"""Per-GPU model states under FSDP2's mixed-precision policy (`--param-dtype`, `--reduce-dtype`).

With a policy the shards keep the model's dtype (`--weights-dtype`, usually fp32):
they are the master weights, so the optimizer holds no extra copy. What changes
is the compute copy. ZeRO-1 and ZeRO-2 keep the whole model cast to `param_dtype`
beside the shards (Ψ x p more weight bytes); ZeRO-3 gathers a unit in `param_dtype`
only while it computes, plus the units kept gathered from forward to backward
(the root, and `reshard_after_forward=False`): `gathered_bytes`. Gradients land
in the shards' dtype, 1/N of them at every stage (ZeRO-1 under a policy keeps
no whole reduced gradient). The reduce dtype is the collective's payload.
"""

from __future__ import annotations

from lockstep.plan.memory import StateBytes, Strategy
from lockstep.plan.units import DType


def with_policy(
    share: StateBytes,
    strategy: Strategy,
    total_params: int,
    trainable_params: int,
    weights: DType,
    param: DType | None,
    reduce: DType | None,
    world_size: int,
) -> StateBytes:
    """`share` (the plan without a policy) corrected for a policy computing in `param`.

    Args:
        share: one GPU's model states under `strategy` as the ZeRO accounting gives them.
        strategy: DDP (returned unchanged: the policy is the sharded engine's) or a stage.
        total_params: every parameter (the shards cover them all).
        trainable_params: those with gradients.
        weights: the model's (the shards') dtype.
        param: the compute dtype; None or `weights`: no cast.
        reduce: the reduce dtype; None: `param`'s. With neither cast, `share` unchanged.
        world_size: GPUs the shards are spread over.
    """
    casts = param is not None and param != weights
    reduce = reduce or param or weights
    if strategy is Strategy.DDP or not (casts or reduce != weights):
        return share
    weight_bytes = share.weights
    if casts:  # the shards, and ZeRO-1/2's whole compute copy beside them
        assert param is not None
        weight_bytes = total_params * weights.nbytes / world_size
        weight_bytes += total_params * param.nbytes if strategy is not Strategy.ZERO3 else 0
    return StateBytes(
        weights=weight_bytes,
        grads=trainable_params * weights.nbytes / world_size,
        optimizer=share.optimizer,
    )


def gathered_bytes(kept_params: int, weights: DType, param: DType | None) -> int:
    """ZeRO-3: bytes of the units that stay gathered between forward and backward."""
    return kept_params * (param or weights).nbytes
