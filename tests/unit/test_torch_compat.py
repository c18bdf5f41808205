"""Running on torch 2.11 as on 2.13: renamed collectives and DDP arguments torch lacks.

torch 2.11 (the GPU machines' torch) has `all_gather_into_tensor` and
`reduce_scatter_tensor` but not 2.13's `*_single` names, and its DDP constructor
lacks `batched_grad_copy` and `forward_sync_buffers` (read from the 2.11.0
wheel's torch/nn/parallel/distributed.py). Both are simulated here on 2.13.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

import lockstep.collectives.torch_compat as torch_compat
from lockstep.testing import torch_features

TORCH_2_11_DDP = frozenset(
    [
        "module",
        "device_ids",
        "output_device",
        "dim",
        "broadcast_buffers",
        "init_sync",
        "process_group",
        "bucket_cap_mb",
        "find_unused_parameters",
        "check_reduction",
        "gradient_as_bucket_view",
        "static_graph",
        "delay_all_reduce_named_params",
        "param_to_hook_all_reduce",
        "mixed_precision",
        "device_mesh",
        "skip_all_reduce_unused_params",
        "bucket_cap_mb_list",
    ]
)


def test_without_the_new_names_the_old_collectives_are_used(monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    try:
        reloaded = importlib.reload(torch_compat)
        assert reloaded.all_gather_single is dist.all_gather_into_tensor
        assert reloaded.reduce_scatter_single is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(torch_compat)
    assert torch_compat.all_gather_single is getattr(
        dist, "all_gather_single", dist.all_gather_into_tensor
    )


def test_torch_2_11s_ddp_lacks_two_arguments_lockstep_follows(monkeypatch):
    monkeypatch.setattr(torch_features, "ddp_arguments", lambda: TORCH_2_11_DDP)
    assert torch_features.absent_from_installed_torch() == [
        "batched_grad_copy",
        "forward_sync_buffers",
    ]
