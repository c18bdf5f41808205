"""`MixedPrecisionPolicy`: FSDP2's mixed precision for the sharded engine.

The shards the optimizer updates keep the model's dtype (they are the fp32
master weights). A flat's full buffer, the one forward and backward compute
with, is in `param_dtype`: stage 3 casts the shard and all-gathers in it,
stages 1 and 2 keep a `param_dtype` copy of the whole flat. A gradient arrives
in `param_dtype`, is cast to `reduce_dtype` on its way into the bucket (under
`no_sync` it accumulates there, in `reduce_dtype`, as FSDP2's does), reduced,
and cast back to the shard's dtype into `shard.grad`. torch's own
`torch.distributed.fsdp.MixedPrecisionPolicy` is accepted as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from lockstep.collectives.torch_compat import all_gather_single
from lockstep.runtime.handles import WorkHandle


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the sharded engine's compute, reduce and outputs (FSDP2's meaning).

    Attributes:
        param_dtype: dtype of the gathered parameters, hence of forward, backward and
            the stage-3 all-gather; None: the model's dtype.
        reduce_dtype: dtype of the gradient reduce-scatter (all-reduce in stage 1);
            None: `param_dtype`'s.
        output_dtype: floating outputs of the wrapper's forward are cast to it; None: no cast.
        cast_forward_inputs: cast the floating inputs of the wrapper's forward (and of
            each stage-3 unit's) to `param_dtype`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecisionPolicy.{name} expects a floating torch.dtype or None; "
                    f"found {value!r}"
                )

    def describe(self) -> str:
        """One line that every rank compares (the arguments check)."""
        return (
            f"param={self.param_dtype} reduce={self.reduce_dtype} "
            f"output={self.output_dtype} cast_inputs={self.cast_forward_inputs}"
        )


def as_policy(policy: Any) -> MixedPrecisionPolicy | None:
    """lockstep's policy from ours, torch's FSDP2 one (same fields), or None.

    Raises:
        TypeError: `policy` is neither.
    """
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if type(policy).__name__ == "MixedPrecisionPolicy" and all(hasattr(policy, f) for f in fields):
        return MixedPrecisionPolicy(*(getattr(policy, f) for f in fields))
    raise TypeError(
        "mp_policy expects lockstep.MixedPrecisionPolicy or "
        f"torch.distributed.fsdp.MixedPrecisionPolicy; found {type(policy).__name__}"
    )


@dataclass(frozen=True)
class FlatDtypes:
    """One flat's dtypes: the shard's (`orig`), compute (`param`), reduce (`reduce`).

    As FSDP2 resolves them per parameter: a non-floating flat, or no policy, computes
    in its own dtype; `reduce` defaults to the compute dtype.
    """

    orig: torch.dtype
    param: torch.dtype
    reduce: torch.dtype

    @property
    def casts(self) -> bool:
        """The full buffer is a `param` copy of the shards, not the shards' own dtype."""
        return self.param != self.orig

    @property
    def differ(self) -> bool:
        """Some dtype differs from the shard's: gradients are cast on their way."""
        return self.casts or self.reduce != self.orig


def flat_dtypes(policy: MixedPrecisionPolicy | None, orig: torch.dtype) -> FlatDtypes:
    """The dtypes of a flat whose parameters are `orig`, under `policy`."""
    if policy is None or not orig.is_floating_point:
        return FlatDtypes(orig, orig, orig)
    param = policy.param_dtype or orig
    return FlatDtypes(orig, param, policy.reduce_dtype or param)


class FlatGrads(Protocol):
    """What the gradient casts read of a `FlatParam` (`flat.py`, which imports this module)."""

    full: torch.Tensor
    accumulated: torch.Tensor | None
    dtypes: FlatDtypes


# ------------------------------------------------------------------ gathers
class _CastGather(WorkHandle):
    """An all-gather whose input is a cast copy of the shard, kept as long as the handle."""

    def __init__(self, work: dist.Work, sent: torch.Tensor) -> None:
        super().__init__(work)
        self.sent = sent


def gather_cast(
    full: torch.Tensor, shard: torch.Tensor, process_group: dist.ProcessGroup | None
) -> WorkHandle:
    """Start the all-gather of `shard` cast to `full`'s dtype (FSDP2 gathers in param_dtype)."""
    sent = shard.to(full.dtype)
    work = all_gather_single(full, sent, group=process_group, async_op=True)
    return _CastGather(work, sent)


# ------------------------------------------------------------------ gradients
def reduce_input(flat: FlatGrads) -> torch.Tensor:
    """The flat's gradient of this backward in the reduce dtype, with what no_sync kept.

    Returns `full.grad` itself when no cast is needed (the engine's old path);
    otherwise a new tensor, and `full.grad` is dropped (its memory is freed at once).
    """
    grad, kept = flat.full.grad, flat.accumulated
    assert grad is not None
    if kept is None and grad.dtype == flat.dtypes.reduce:
        return grad
    flat.full.grad, flat.accumulated = None, None
    if kept is None:
        return grad.to(flat.dtypes.reduce)
    return kept.add_(grad)


def keep_local_grad(flat: FlatGrads) -> None:
    """A backward under no_sync: move `full.grad` into the reduce-dtype accumulator.

    FSDP2 accumulates a skipped reduce's gradients in `reduce_dtype`; when that is
    the compute dtype autograd's own accumulation into `full.grad` does it.
    """
    grad = flat.full.grad
    if grad is None or grad.dtype == flat.dtypes.reduce:
        return
    flat.full.grad = None
    if flat.accumulated is None:
        flat.accumulated = grad.to(flat.dtypes.reduce)
    else:
        flat.accumulated.add_(grad)


def to_shard_dtype(shard_grad: torch.Tensor, flat: FlatGrads) -> torch.Tensor:
    """The reduced shard gradient in the shard's dtype, as FSDP2 casts it before `.grad`.

    Without a policy, the tensor itself. Under one, always a copy: stage 1's shard
    gradient is a slice of the whole reduced buffer, which need not outlive the step.
    """
    if not flat.dtypes.differ:
        return shard_grad
    return shard_grad.to(flat.dtypes.orig, copy=True)


# --------------------------------------------------------------------- forward
def _cast_floating(dtype: torch.dtype | None, value: Any) -> Any:
    if dtype is None or not isinstance(value, torch.Tensor):
        return value
    if not value.is_floating_point() or value.dtype == dtype:
        return value
    return value.to(dtype)


def cast_inputs(policy: MixedPrecisionPolicy | None, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Floating tensors of (args, kwargs) cast to `param_dtype` if the policy says so."""
    if policy is None or not policy.cast_forward_inputs or policy.param_dtype is None:
        return args, kwargs
    dtype = policy.param_dtype
    cast = tree_map(lambda v: _cast_floating(dtype, v), (args, kwargs))
    return cast[0], cast[1]


def cast_output(policy: MixedPrecisionPolicy | None, output: Any) -> Any:
    """Floating tensors of `output` cast to `output_dtype`, if set."""
    if policy is None or policy.output_dtype is None:
        return output
    return tree_map(lambda v: _cast_floating(policy.output_dtype, v), output)


def unit_input_hook(policy: MixedPrecisionPolicy | None) -> Any:
    """A forward pre-hook (with kwargs) casting a stage-3 unit's inputs; None if not needed."""
    if policy is None or not policy.cast_forward_inputs or policy.param_dtype is None:
        return None

    def pre_forward(module: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return cast_inputs(policy, args, kwargs)

    return pre_forward


def policy_problem(
    module: torch.nn.Module, stage: int, policy: MixedPrecisionPolicy | None
) -> str | None:
    """What keeps `policy` from applying to `module` at `stage`, or None.

    Stages 1 and 2 flatten trainable parameters only: a frozen floating parameter
    would stay in the model's dtype and meet `param_dtype` activations.
    """
    if policy is None or policy.param_dtype is None or stage == 3:
        return None
    frozen = [
        name
        for name, p in module.named_parameters()
        if not p.requires_grad and p.is_floating_point() and p.dtype != policy.param_dtype
    ]
    if not frozen:
        return None
    return (
        f"mp_policy with param_dtype={policy.param_dtype} at stage {stage} needs every "
        f"floating parameter trainable; found frozen {frozen[:4]}. Use stage 3 (frozen "
        "parameters are sharded and cast there too) or cast them to param_dtype first."
    )
