"""`BucketLayout`: which parameter sits in which slot of which bucket, as one object.

`bucketing.assign_buckets` decides the groups (a pure function); a layout
allocates one `Bucket` per group and maps each parameter to its bucket and its
slot (a view of the bucket's flat buffer). The DDP engine builds one at wrap
time and one more when it rebuilds the buckets in the order gradients became
ready; its hash goes into the step fingerprint, so ranks with different layouts
are caught at the first step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from lockstep.runtime.averaging import Averaging
from lockstep.runtime.bucket import Bucket

_HASH_MOD = 1 << 20  # keeps v*v*N far inside int64 in the fingerprint's sums


def layout_hash(groups: Sequence[Sequence[int]]) -> int:
    """A small stable hash of the bucket layout (parameter indices per bucket)."""
    digest = hashlib.blake2b(repr([list(g) for g in groups]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _HASH_MOD


class BucketLayout:
    """The buckets of a list of parameters, grouped as `groups` says (launch order).

    Args:
        params: the trainable parameters, in registration order.
        groups: parameter indices per bucket, in launch order.
        averaging_for: the bucket collective's 1/N rule for a dtype.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        groups: list[list[int]],
        averaging_for: Callable[[torch.dtype], Averaging | None],
    ) -> None:
        self.groups = groups
        self.hash = layout_hash(groups)
        self.buckets = [
            Bucket.build(b, [params[i] for i in idx], idx, averaging_for(params[idx[0]].dtype))
            for b, idx in enumerate(groups)
        ]
        slot = {i: (b, b.views[pos]) for b in self.buckets for pos, i in enumerate(b.param_indices)}
        self.bucket_of = [slot[i][0] for i in range(len(params))]
        self.view_of = [slot[i][1] for i in range(len(params))]

    def move_grads_into_views(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Existing gradients move into their slots, and `.grad` points there."""
        for param, view in zip(params, self.view_of, strict=True):
            if param.grad is not None:
                view.copy_(param.grad)
                param.grad = view
