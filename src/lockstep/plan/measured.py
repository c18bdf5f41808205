"""Per-rank memory of the model states, measured from tensor storages and predicted by the plan.

`measured_bytes` counts the bytes of the storages that hold parameters,
gradients and optimizer state on this rank (each storage once, so a gradient
that is a view into a bucket, or a shard that is a view of the full buffer, is
not counted twice; a freed stage-3 buffer counts zero). `planned_bytes` asks
`lockstep plan`'s memory model (`plan/memory.py`) about the same model, dtype,
optimizer and world size, so the two can be compared side by side; with a
mixed-precision policy (`mp_policy`) and, for stage 3, the parameters kept
gathered between forward and backward (`planned_gathered`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lockstep.plan.memory import Optimizer, StateBytes, Strategy
from lockstep.plan.model_count import count_module
from lockstep.plan.planner import PlanConfig, make_plan
from lockstep.plan.shape import full_trainable
from lockstep.plan.units import DType

STRATEGY_OF_STAGE = {0: Strategy.DDP, 1: Strategy.ZERO1, 2: Strategy.ZERO2, 3: Strategy.ZERO3}
DTYPE_OF = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16, torch.float16: DType.FP16}


def _storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measured_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> StateBytes:
    """Bytes of parameters, gradients and optimizer state this rank holds now.

    Works for a plain module, lockstep's DDP and `ShardedDataParallel` (whose full
    buffers are counted with the parameters while allocated).
    """
    seen: set[int] = set()
    params = list(model.parameters())
    fulls = [flat.full for flat in getattr(model, "flats", [])]
    weights = _storage_bytes([*params, *(f.data for f in fulls)], seen)
    grads = _storage_bytes([p.grad for p in [*params, *fulls]], seen)
    states: list[Any] = [v for s in optimizer.state.values() for v in s.values()]
    optim = _storage_bytes([v for v in states if isinstance(v, torch.Tensor)], seen)
    return StateBytes(weights=weights, grads=grads, optimizer=optim)


def _config(module: nn.Module, world_size: int, policy: Any, kept_params: int) -> PlanConfig:
    shape = count_module(module)
    param = getattr(policy, "param_dtype", None)
    reduce = getattr(policy, "reduce_dtype", None)
    return PlanConfig(
        model=shape,
        trainable=full_trainable(shape),
        gpus=world_size,
        weights_dtype=DType.FP32,
        optimizer=Optimizer.ADAM,
        param_dtype=DTYPE_OF[param] if param is not None else None,
        reduce_dtype=DTYPE_OF[reduce] if reduce is not None else None,
        kept_params=kept_params,
    )


def planned_bytes(
    module: nn.Module, world_size: int, stage: int, mp_policy: Any = None
) -> StateBytes:
    """`lockstep plan`'s per-GPU prediction for `module` in fp32 with Adam(W).

    Args:
        module: the plain (unwrapped) model.
        world_size: ranks.
        stage: 0 for DDP, else the ZeRO stage.
        mp_policy: the sharded engine's mixed-precision policy (`--param-dtype`,
            `--reduce-dtype`), or None.
    """
    plan = make_plan(_config(module, world_size, mp_policy, 0))
    rows = {row.strategy: row.bytes for row in plan.memory}
    return rows[STRATEGY_OF_STAGE[stage]]


def planned_gathered(
    module: nn.Module, world_size: int, kept_params: int, mp_policy: Any = None
) -> int:
    """The plan's ZeRO-3 bytes of `kept_params` parameters gathered from forward to backward."""
    return make_plan(_config(module, world_size, mp_policy, kept_params)).gathered_bytes
