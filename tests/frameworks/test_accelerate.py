"""Accelerate and the transformers Trainer: the same scripts on torch's DDP and on lockstep's.

One world-2 spawn runs every case of `accelerate_cases.py` and `trainer_cases.py`
with both engines in the same ranks; each test compares one case bitwise
(world size 2: sums of two numbers do not depend on order, 1/2 is exact).
"""

from __future__ import annotations

import pytest
import torch
from framework_results import case_names, check_case, run_all

from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # frameworks' imports and ranks: make test, not the inner loop

CASES = [("accelerate_cases", name) for name in case_names("accelerate_cases")]
CASES += [("trainer_cases", name) for name in case_names("trainer_cases")]
NAMES = [name for _, name in CASES if name != "fingerprint"]  # differs by design


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("accelerate"))
    return run_ranks(run_all, 2, tmp, CASES, timeout_s=30, deadline_s=240)


@pytest.mark.parametrize("name", NAMES)
def test_case_matches_torch_ddp(per_rank, name):
    check_case(per_rank, name, ("lockstep", "torch"))


def test_lockstep_engine_ran_under_torchs_class_name(per_rank):
    for results in per_rank:
        assert results[("accumulate_clip", "torch")]["wrapper"] == "DistributedDataParallel"
        assert results[("accumulate_clip", "lockstep")]["wrapper"] == "TorchFacedDDP"


def test_unwrap_and_saved_keys_have_no_wrapper_prefix(per_rank):
    saved = per_rank[0][("save_load", "lockstep")]
    assert saved["unwrapped"] == "Branchy"
    assert all(not key.startswith("module.") for key in saved["saved"]), list(saved["saved"])
    assert per_rank[0][("peft_lora", "lockstep")]["unwrapped"].startswith("PeftModel")


def test_trigger_sync_in_backward_averaged_the_gradients(per_rank):
    """Both ranks hold the same gradients: the second backward was synchronised."""
    grads = [results[("trigger_sync", "lockstep")]["grads"] for results in per_rank]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_trainer_checkpoint_keys_and_engine(per_rank):
    results = per_rank[0][("trainer", "lockstep")]
    assert results["wrapper"] == "TorchFacedDDP"
    assert results["saved_keys"] and not any(k.startswith("module.") for k in results["saved_keys"])


def test_step_fingerprint_catches_mismatched_accumulation_under_accelerate(per_rank):
    for rank, results in enumerate(per_rank):
        assert results[("fingerprint", "torch")]["raised"] is None  # torch pairs silently
        ours = results[("fingerprint", "lockstep")]
        assert ours["raised"] == "RankMismatchError", f"rank {rank}: {ours}"
        assert "micro-batches" in ours["message"], ours["message"]
