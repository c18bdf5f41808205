"""The sharded engine, checkpoints, the stall watch and the fingerprint on a device.

Two gloo ranks; with "cuda" both hold CUDA tensors on the one GPU. At world
size 2 every stage's arithmetic is DDP's and stage 3's is torch FSDP2's, so
losses and final states must be bitwise equal (as tests/dist/test_sharded_parity.py
shows on the CPU). A checkpoint saved from the device restores onto the device
and onto the CPU with the same values.
"""

from __future__ import annotations

import pytest
import torch
from gpu_devices import DEVICES
from gpu_sharded import all_engines, checkpoint_round_trip, stall_and_fingerprint

from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # the CPU half of a GPU test: make test, not the inner loop

_ENGINES: dict[str, list[dict]] = {}


def _engines(device: str) -> list[dict]:
    if device not in _ENGINES:
        _ENGINES[device] = run_ranks(all_engines, 2, device, deadline_s=240, timeout_s=60)
    return _ENGINES[device]


def _assert_same(out: dict, ref: dict, what: str) -> None:
    pairs = [("losses", out["losses"], ref["losses"])]
    pairs += [(k, out["state"][k], ref["state"][k]) for k in ref["state"]]
    for key, a, b in pairs:
        diff = (a.float() - b.float()).abs().max().item()
        assert torch.equal(a, b), f"{what}: {key} differs by {diff:.3g}"


@pytest.mark.parametrize("engine", ["stage1", "stage2", "stage3"])
@pytest.mark.parametrize("device", DEVICES)
def test_each_stage_matches_ddp_bitwise(device, engine):
    for rank, results in enumerate(_engines(device)):
        _assert_same(results[engine], results["ddp"], f"rank {rank} {device} {engine} vs ddp")


@pytest.mark.parametrize("device", DEVICES)
def test_stage3_matches_fully_shard_bitwise(device):
    for rank, results in enumerate(_engines(device)):
        _assert_same(results["stage3"], results["fsdp2"], f"rank {rank} {device} stage3 vs fsdp2")


@pytest.mark.parametrize("engine", ["ddp", "stage3"])
@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_from_the_device_restores_on_device_and_cpu(device, engine, tmp_path):
    results = run_ranks(checkpoint_round_trip, 2, device, str(tmp_path), engine, deadline_s=120)
    for rank, out in enumerate(results):
        for target in (device, "cpu"):
            step, state = out[target]
            assert step == 2 and out[target + "_device"] == target
            for key, value in out["saved"].items():
                assert torch.equal(state[key], value), f"rank {rank} {target}: {key}"


@pytest.mark.parametrize("device", DEVICES)
def test_stall_watch_and_fingerprint_on_the_device(device):
    env = {"LOCKSTEP_STALL_WARN_S": "0.4"}
    results = run_ranks(stall_and_fingerprint, 2, device, env=env, deadline_s=120)
    assert "rank(s) 1 have not launched it" in results[0]["stall"], results[0]["stall"]
    for out in results:
        assert out["grad_device"] == device
        assert "rank 0: step 4, data pass 0, 2 micro-batch(es)" in out["mismatch"], out["mismatch"]
        assert "rank 1: step 4, data pass 0, 1 micro-batch(es)" in out["mismatch"], out["mismatch"]
