"""torch DDP scripts, unchanged, on lockstep's engine through the switch: equal to torch's.

Every scenario of `tests/dist/dropin_scenarios.py` (a script written for torch's
class) constructs `torch.nn.parallel.DistributedDataParallel` itself; it runs once
with `lockstep.adopt` installed (so torch's constructor builds `TorchFacedDDP`) and
once without, in the same ranks, and the results agree bitwise (world size 2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "dist"))  # the scenarios live there

from dropin_scenarios import SCENARIOS
from framework_results import assert_same

from lockstep import adopt
from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # frameworks' imports and ranks: make test, not the inner loop

# Counters and warning texts name the class; `seen` (collectives, bucket layouts) is each
# engine's own by design and is checked against torch in tests/dist/test_dropin.py.
SKIPPED = ("synced_steps", "warnings", "seen")


def _both(ctx, names: list[str]) -> dict:
    out = {}
    for name in names:
        for engine in ("adopted", "torch"):
            torch.distributed.barrier()
            (adopt.install if engine == "adopted" else adopt.uninstall)()
            try:
                got = SCENARIOS[name](nn.parallel.DistributedDataParallel, ctx)
                out[(name, engine)] = {k: v for k, v in got.items() if k not in SKIPPED}
            except Exception as error:  # reported by the test, with the scenario's name
                out[(name, engine)] = {"error": f"{type(error).__name__}: {error}"}
            finally:
                adopt.uninstall()
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_both, 2, list(SCENARIOS), deadline_s=240)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_adopted_matches_torch(per_rank, name):
    for rank, results in enumerate(per_rank):
        ours, theirs = results[(name, "adopted")], results[(name, "torch")]
        assert "error" not in theirs, f"rank {rank} (torch): {theirs['error']}"
        assert "error" not in ours, f"rank {rank} (adopted): {ours['error']}"
        assert_same(ours, theirs, f"{name}@rank{rank}")
