"""The wrapper's constructor arguments, in torch's order, checked once at wrap time.

`DDPArguments` holds every argument of torch 2.13's `DistributedDataParallel`
(same names, same positional order) plus lockstep's keyword-only extras; its
`__post_init__` refuses what no module could make valid, and `check_module`
what this module cannot take. Both raise torch's exception types (a clearer
message, never a different type), before any collective runs, so a bad argument
fails on every rank at once. The wrapper (`engine/ddp.py`) then reads plain fields.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.runtime.bucketing import MB
from lockstep.runtime.finite import NonFinite
from lockstep.runtime.transport import NATIVE

DEFAULT_CAP_MB = 25
DEFAULT_FIRST_CAP_MB = 1


@dataclass(frozen=True)
class DDPArguments:
    """What the user passed to the wrapper, module aside; see `docs/compat.md` for each.

    Torch's fields keep torch's meaning and defaults, except `gradient_as_bucket_view`
    (True here: gradients live in the buckets, the same numbers with less memory).
    `first_bucket_cap_mb` is lockstep's: the first bucket's cap; None follows torch
    (1 MiB when `bucket_cap_mb` is left at its default, else `bucket_cap_mb`).
    """

    device_ids: Sequence[int | torch.device] | None = None
    output_device: int | torch.device | None = None
    dim: int = 0
    broadcast_buffers: bool | None = None
    init_sync: bool = True
    process_group: dist.ProcessGroup | None = None
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None
    param_to_hook_all_reduce: nn.Parameter | None = None
    mixed_precision: Any = None
    device_mesh: Any = None
    skip_all_reduce_unused_params: bool = False
    bucket_cap_mb_list: Sequence[float] | None = None
    batched_grad_copy: bool = False
    forward_sync_buffers: bool | None = None
    first_bucket_cap_mb: float | None = None
    allreduce: str = NATIVE
    local_world_size: int | None = None
    check_data_passes: bool = True
    nonfinite: str = "raise"
    check_replicas: bool | None = None  # None: on unless init_sync=False

    def __post_init__(self) -> None:
        NonFinite.parse(self.nonfinite)  # ValueError naming the choices, on every rank
        if (self.delay_all_reduce_named_params is None) != (self.param_to_hook_all_reduce is None):
            raise ValueError(
                "delay_all_reduce_named_params and param_to_hook_all_reduce must be given "
                "together; found only one of them. Pass both, or neither."
            )
        if self.process_group is not None and self.device_mesh is not None:
            raise RuntimeError(
                "pass either process_group or device_mesh to DistributedDataParallel, not both"
            )
        if self.device_mesh is not None:
            _check_mesh(self.device_mesh)
        if self.mixed_precision is not None:
            _check_mixed_precision(self.mixed_precision)
        caps = [self.bucket_cap_mb, self.first_bucket_cap_mb, *(self.bucket_cap_mb_list or [])]
        if any(cap is not None and cap <= 0 for cap in caps):
            raise ValueError(
                "bucket_cap_mb, first_bucket_cap_mb and bucket_cap_mb_list must be positive; "
                f"found {self.bucket_cap_mb}, {self.first_bucket_cap_mb} and "
                f"{self.bucket_cap_mb_list}"
            )
        if self.device_ids is not None and len(self.device_ids) > 1:
            raise ValueError(
                f"device_ids must be None or name exactly one device; found {self.device_ids}. "
                "Run one process per device."
            )
        self._warn_deprecated()

    def _warn_deprecated(self) -> None:
        if self.broadcast_buffers is not None:
            warnings.warn(
                "broadcast_buffers is deprecated (as in torch 2.13): use forward_sync_buffers. "
                "broadcast_buffers=False also skips buffers at wrap time; "
                "forward_sync_buffers=False does not.",
                FutureWarning,
                stacklevel=4,
            )
        if self.check_reduction:
            warnings.warn(
                "check_reduction is deprecated and has no effect (as in torch): an "
                "incomplete reduction is reported by the next forward anyway.",
                FutureWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------ derived
    def without_groups(self) -> DDPArguments:
        """A copy without process groups (they do not pickle): the default group is used."""
        copy = object.__new__(DDPArguments)
        # No __post_init__: these were checked at wrap time.
        copy.__dict__.update(self.__dict__, process_group=None, device_mesh=None)
        return copy

    @property
    def group(self) -> dist.ProcessGroup:
        """The replicas' group: process_group, the mesh's group, or the default group."""
        if self.device_mesh is not None:
            return self.device_mesh.get_group(mesh_dim=0)
        if self.process_group is not None:
            return self.process_group
        return dist.distributed_c10d._get_default_group()

    @property
    def forward_buffers(self) -> bool:
        """Whether buffers are broadcast before a forward (torch's forward_sync_buffers)."""
        if self.forward_sync_buffers is not None:
            return self.forward_sync_buffers
        return self.broadcast_buffers is not False

    @property
    def init_buffers(self) -> bool:
        """Whether buffers are broadcast at wrap time (only broadcast_buffers=False skips)."""
        return self.forward_sync_buffers is not None or self.broadcast_buffers is not False

    def caps_bytes(self) -> tuple[int, int, list[int] | None]:
        """(first bucket cap, later caps, per-bucket caps or None) in bytes."""
        if self.bucket_cap_mb_list:
            caps = [int(mb * MB) for mb in self.bucket_cap_mb_list]
            return caps[0], max(caps), caps
        cap_mb = DEFAULT_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb
        first_mb = self.first_bucket_cap_mb
        if first_mb is None:
            first_mb = DEFAULT_FIRST_CAP_MB if self.bucket_cap_mb is None else cap_mb
        return int(first_mb * MB), int(cap_mb * MB), None

    @property
    def ignored_names(self) -> set[str]:
        """Names the engine leaves alone: delayed ones (their own all-reduce)."""
        return {name for name, _ in self.delay_all_reduce_named_params or []}


def _check_mesh(mesh: Any) -> None:
    if mesh.ndim != 1:
        raise RuntimeError(
            f"device_mesh must be one-dimensional; found {mesh.ndim} dimensions. "
            "Pass the data-parallel sub-mesh, e.g. mesh['dp']."
        )
    if mesh._get_root_mesh() != mesh:
        raise NotImplementedError(
            "device_mesh is a slice of a larger mesh (data parallel beside tensor "
            "parallel); lockstep's DistributedDataParallel takes a whole 1-D mesh or a "
            "process_group only. Pass process_group=mesh.get_group(), with modules that "
            "hold no DTensor parameters."
        )


def _check_mixed_precision(config: Any) -> None:
    fields = ("param_dtype", "reduce_dtype", "buffer_dtype")
    if not all(hasattr(config, f) for f in fields):
        raise ValueError(
            f"mixed_precision expected torch's _MixedPrecision (fields {fields}); "
            f"found {type(config).__name__}"
        )


def ignore_for_model(module: nn.Module, names: Sequence[str]) -> None:
    """Before wrapping: the named parameters and buffers stay local to each rank.

    torch's `_set_params_and_buffers_to_ignore_for_model`: they are not broadcast,
    not bucketed, not averaged.
    """
    module._ddp_params_and_buffers_to_ignore = list(names)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name in names:
            tensor._ddp_ignored = True


def managed_parameters(module: nn.Module, ignored: set[str]) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters the buckets hold: not ignored, tied ones once, in order."""
    seen: set[int] = set()
    out = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.requires_grad and name not in ignored and id(param) not in seen:
            seen.add(id(param))
            out.append((name, param))
    return out


def check_module(module: nn.Module, args: DDPArguments, ignored: set[str]) -> None:
    """Refuse a module the wrapper cannot take, with torch's exception types.

    Raises:
        RuntimeError: no trainable parameter; an uninitialized (lazy) parameter.
        ValueError: parameters on several device types; device_ids or output_device
            with a CPU or multi-device module.
    """
    params = [p for n, p in module.named_parameters() if n not in ignored]
    if not any(p.requires_grad for p in params) and not args.delay_all_reduce_named_params:
        raise RuntimeError(
            "DistributedDataParallel expected a module with at least one parameter that "
            "requires grad; found none. Unfreeze a parameter, or do not wrap this module."
        )
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in params):
        raise RuntimeError(
            "DistributedDataParallel found uninitialized (lazy) parameters; run one dummy "
            "forward to initialize them, then wrap the module."
        )
    devices = {p.device for p in params}
    if len({d.type for d in devices}) > 1:
        raise ValueError(
            "DistributedDataParallel expected the module's parameters on one type of device; "
            f"found {sorted(d.type for d in devices)}. Move the module to one device type."
        )
    cpu_or_multi = len(devices) > 1 or next(iter(devices)).type == "cpu"
    if (args.device_ids or args.output_device) and cpu_or_multi:
        raise ValueError(
            f"device_ids ({args.device_ids}) and output_device ({args.output_device}) apply "
            f"only to a module on one accelerator; this module's parameters are on "
            f"{sorted(map(str, devices))}. Pass device_ids=None for a CPU or multi-device module."
        )
