"""torch's own DDP behaviour tests, run with lockstep's class swapped in (part of `make test`).

The tests are torch's (`DistributedTest._DistTestBase`), unchanged: the ones that
build a DDP wrapper and pass with torch's class on CPU (gloo, world size 2), less
those that read torch's internals (`suite_lists`). They run in one child process
(`torch_suite.py --ddp lockstep`), so torch's test harness and its environment
variables never touch this process; each is then asserted here by name.
`make compat` runs the whole comparison with torch's class side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from suite_lists import BEHAVIOUR_SUBSET

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # torch's own suite: make test


@pytest.fixture(scope="module")
def lockstep_records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    out = tmp_path_factory.mktemp("torch_suite") / "lockstep.json"
    cmd = [sys.executable, str(HERE / "torch_suite.py"), "--ddp", "lockstep", "--json", str(out)]
    cmd += ["--timeout", "90", "--only", *BEHAVIOUR_SUBSET]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, check=False)
    if not out.exists():
        pytest.fail(f"torch_suite.py wrote no results:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", BEHAVIOUR_SUBSET)
def test_passes_with_lockstep(name: str, lockstep_records: dict[str, dict[str, object]]) -> None:
    record = lockstep_records[name]
    assert record["outcome"] == "passed", f"{name} {record['outcome']}: {record['reason']}"
