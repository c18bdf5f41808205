"""`FlatParam`: one unit's parameters as a flat buffer, its shard, and the module's views.

The full buffer `full` is a leaf that requires grad; every forward the module's
attributes are set to views of it (`use_views`: one `torch.split`, so backward
writes the unit's whole gradient in one piece into `full.grad`). The shard this
rank owns is `shard`, the `nn.Parameter` the optimizer sees. In stages 1 and 2
the shard is a view of `full` (no extra copy); in stage 3 it has its own storage
and `full`'s storage is allocated only while gathered (`gather`, `free`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lockstep.collectives.torch_compat import all_gather_single
from lockstep.runtime.handles import CollectiveHandle, WorkHandle
from lockstep.sharded.layout import flat_layout
from lockstep.sharded.precision import FlatDtypes, flat_dtypes, gather_cast
from lockstep.sharded.units import ParamSlots


class FlatParam:
    """The flat buffer of one unit's parameters of one dtype, sharded over the group.

    Args:
        index: position of this flat among all flats (launch order of stages 1 and 2).
        unit: name of the unit it belongs to.
        params: the parameters, with their places in the module.
        rank: this rank in `process_group`.
        world_size: size of `process_group`.
        process_group: the group the shards are spread over.
        keep_full: keep `full` allocated (stages 1 and 2) with `shard` a view of it.
        dtypes: the shard's, compute and reduce dtypes (`precision.py`); None: the
            parameters' own. A `full` in another dtype than the shard is a cast copy.
    """

    def __init__(
        self,
        index: int,
        unit: str,
        params: list[ParamSlots],
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None,
        keep_full: bool,
        dtypes: FlatDtypes | None = None,
    ) -> None:
        self.index, self.unit, self.slots = index, unit, params
        self.process_group = process_group
        self.shapes = [s.param.shape for s in params]
        self.layout = flat_layout([s.param.numel() for s in params], world_size)
        first = params[0].param
        self.dtypes = dtypes or flat_dtypes(None, first.dtype)
        self.accumulated: torch.Tensor | None = None  # no_sync's gradient in the reduce dtype
        full = torch.zeros(self.layout.padded_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            torch.cat([s.param.detach().reshape(-1) for s in params], out=full[: self.layout.numel])
        self.trainable = first.requires_grad
        start, end = self.layout.shard_range(rank)
        own = full.data[start:end]
        self.shard = nn.Parameter(
            own if keep_full and not self.dtypes.casts else own.clone(), self.trainable
        )
        if self.dtypes.casts:
            full = full.to(self.dtypes.param)
        self.full = full.requires_grad_(self.trainable)
        self.keep_full = keep_full
        self.gathered = True
        self._detach_from_module()
        if not keep_full:
            self.free()

    def _detach_from_module(self) -> None:
        """Remove the original parameters from their modules (views take their place)."""
        for slots in self.slots:
            for owner, attr in slots.owners:
                owner._parameters.pop(attr, None)

    @property
    def nbytes(self) -> int:
        """Bytes of the padded full buffer."""
        return self.layout.padded_numel * self.full.element_size()

    def use_views(self) -> None:
        """Point every owning module's attribute at a view of `full`, shaped like the parameter."""
        pieces = torch.split(self.full, self.layout.split_sizes)
        for slots, piece, shape in zip(self.slots, pieces, self.shapes, strict=False):
            view = piece.view(shape)
            for owner, attr in slots.owners:
                owner.__dict__[attr] = view

    def gather(self) -> CollectiveHandle:
        """Start the all-gather of every rank's shard into `full` (allocated again if freed).

        Writes through `full.data`, so autograd's version counter of `full` (and of the
        views saved for backward) is not bumped.
        """
        storage = self.full.data.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.nbytes)
        self.gathered = True
        if self.dtypes.casts:  # FSDP2: the all-gather runs in param_dtype
            return gather_cast(self.full.data, self.shard.data, self.process_group)
        work = all_gather_single(
            self.full.data, self.shard.data, group=self.process_group, async_op=True
        )
        return WorkHandle(work)

    def free(self) -> None:
        """Release `full`'s memory (stage 3); its metadata and views stay, without data."""
        if not self.keep_full and self.gathered:
            self.full.data.untyped_storage().resize_(0)
            self.gathered = False

    def full_tensors(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter tensors (copies) read from a gathered padded buffer `flat`."""
        pieces = torch.split(flat.detach(), self.layout.split_sizes)
        return [p.view(s).clone() for p, s in zip(pieces, self.shapes, strict=False)]
