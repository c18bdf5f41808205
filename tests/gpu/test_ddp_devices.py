"""lockstep's DDP against torch's on a device, bitwise, every mode of tests/gpu/ddp_cases.py.

World size 1 runs in this process (NCCL on CUDA, gloo on the CPU); world size 2
runs two gloo ranks that both hold CUDA tensors on the one GPU (two processes
cannot share a GPU under NCCL), which exercises the same streams, device copies
and memory. The arithmetic of both engines is the same, so every parameter and
gradient must be bitwise equal after three steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_cases import CASES, differences, rank_main, run_all, skip_reason
from gpu_devices import DEVICES

from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # the CPU half of a GPU test: make test, not the inner loop

_RESULTS: dict[tuple[str, int], list[dict]] = {}


def _results(device: str, world: int) -> list[dict]:
    """Each rank's results, computed once per (device, world size) for all cases."""
    key = (device, world)
    if key not in _RESULTS:
        if world == 1:
            backend = "nccl" if device == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            try:
                _RESULTS[key] = [run_all(0, 1, device)]
            finally:
                dist.destroy_process_group()
        else:
            _RESULTS[key] = run_ranks(rank_main, world, device, deadline_s=240, timeout_s=60)
    return _RESULTS[key]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_lockstep_matches_torch_ddp_bitwise(device, name, world):
    reason = skip_reason(name, device)
    if reason is not None:
        pytest.skip(reason)
    for rank, results in enumerate(_results(device, world)):
        for engine in ("lockstep", "torch"):
            error = results[(name, engine)].get("error")
            assert error is None, f"rank {rank}, world {world}, {device}, {engine}:\n{error}"
        diff = differences(results[(name, "lockstep")], results[(name, "torch")])
        assert not diff, f"rank {rank}, world {world}, {device}: {diff}"
        if device == "cuda":
            assert torch.cuda.is_available()


def test_powersgd_on_the_cpu_is_skipped_where_cuda_is_visible(monkeypatch):
    """torch's hook synchronises CUDA whenever it is available, even for CPU tensors."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert skip_reason("hook_powersgd", "cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "torch.cuda.synchronize" in skip_reason("hook_powersgd", "cpu")
    assert skip_reason("hook_powersgd", "cuda") is None


def test_a_case_that_raises_is_recorded_and_the_others_still_run(monkeypatch):
    import ddp_cases

    real = ddp_cases.train

    def train(engine: str, name: str, *args):
        if name == "plain" and engine == "lockstep":
            raise ValueError("Expected a cuda device, but got: cpu")
        return real(engine, name, *args)

    monkeypatch.setattr(ddp_cases, "train", train)
    monkeypatch.setattr(ddp_cases, "CASES", {k: CASES[k] for k in ("plain", "no_sync")})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = run_all(0, 1, "cpu")
    finally:
        dist.destroy_process_group()
    assert "Expected a cuda device" in out[("plain", "lockstep")]["error"]
    assert "params" in out[("plain", "torch")] and "params" in out[("no_sync", "lockstep")]
