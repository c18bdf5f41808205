"""A sample of `make frameworks` in `make test`: Accelerate's own test_sync, on lockstep's engine.

`make frameworks` runs a selection of Accelerate's distributed test scripts on both
engines side by side (minutes); this runs the one that exercises DDP the most
(no_sync, accumulate, gradients compared against a local model) on lockstep's engine
alone, and checks that rank 0 said lockstep's engine was built.
"""

from __future__ import annotations

import pytest
from peer_scripts import ANNOUNCED, last_error, run_script

pytestmark = pytest.mark.slow  # frameworks' imports and ranks: make test, not the inner loop


@pytest.mark.soak
@pytest.mark.slow
def test_accelerates_test_sync_passes_on_lockstep_engine(tmp_path):
    code, _, out = run_script("test_sync", "lockstep", tmp_path, timeout_s=240)
    assert code == 0, last_error(out) or out[-3000:]
    assert ANNOUNCED in out, out[-3000:]
