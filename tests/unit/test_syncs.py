"""The counters of tests/gpu/test_host_syncs.py, checked where no GPU is.

`count_cuda_syncs` counts torch's "called a synchronizing CUDA operation" warnings,
every one and from every thread (a CUDA backward runs its hooks on autograd's own
thread); here the warnings are raised by hand, without setting the CUDA mode.
`count_host_reads` counts `item`, `tolist` and the conversions, and leaves
`torch.Tensor` as it found it.
"""

from __future__ import annotations

import threading
import warnings

import torch

from lockstep.testing.syncs import SYNC_WARNING, count_cuda_syncs, count_host_reads


def _warn_sync() -> None:
    warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)


def test_every_sync_warning_counts_from_any_thread_and_nothing_else():
    with count_cuda_syncs(enable_debug_mode=False) as count:
        for _ in range(3):
            _warn_sync()  # the same line three times: each counts
        other = threading.Thread(target=_warn_sync)
        other.start()
        other.join()
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
    assert count.total == 4
    assert sum(count.places.values()) == 4


def test_host_reads_are_counted_by_kind_and_the_class_is_restored():
    before = {name: vars(torch.Tensor).get(name) for name in ("item", "__bool__")}
    t = torch.tensor([1.5, 2.0])
    with count_host_reads() as reads:
        t[0].item()
        t.tolist()
        if t[1] > 1:
            float(t[0])
        t.sum()  # stays a tensor: not a read
    assert reads == {"item": 1, "tolist": 1, "__bool__": 1, "__float__": 1}
    assert {name: vars(torch.Tensor).get(name) for name in before} == before
    with count_host_reads() as again:
        pass
    t[0].item()
    assert again == {}
