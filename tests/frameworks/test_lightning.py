"""Lightning Fabric and Trainer: the same scripts with Lightning's DDP strategy and lockstep's.

One world-2 spawn runs every case of `lightning_cases.py` with both engines in the
same ranks; each test compares one case bitwise.
"""

from __future__ import annotations

import pytest
from framework_results import case_names, check_case, run_all

from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # frameworks' imports and ranks: make test, not the inner loop

CASES = [("lightning_cases", name) for name in case_names("lightning_cases")]
NAMES = [name for _, name in CASES]


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lightning"))
    return run_ranks(run_all, 2, tmp, CASES, timeout_s=30, deadline_s=240)


@pytest.mark.parametrize("name", NAMES)
def test_case_matches_torch_ddp(per_rank, name):
    check_case(per_rank, name, ("lockstep", "torch"))


def test_lockstep_engine_ran_and_saved_module_keys(per_rank):
    fabric = per_rank[0][("fabric", "lockstep")]
    assert fabric["wrapper"] == "TorchFacedDDP"
    assert not any(key.startswith("module.") for key in fabric["saved"]), list(fabric["saved"])
    trainer = per_rank[0][("trainer_accumulate", "lockstep")]
    assert trainer["wrapper"] == "TorchFacedDDP"
    assert not any(key.startswith("module.") for key in trainer["keys"]), trainer["keys"]
