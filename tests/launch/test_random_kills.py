"""Five SIGKILLs at random moments of a one-node x 4 job: the sample of `make soak`'s 50.

The driver is benchmarks/soak/soak_one_node.py (its docstring says what it checks);
here it runs one job with a standby worker (`--spares 1`, so that each recovery is
quick) and five kills, and must find every rank's parameters, optimizer, scheduler,
random state and epoch bitwise equal to the uninterrupted run's, with every sample id
once per epoch. Its comparison is checked first on a state that differs in one part.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak"
sys.path.insert(0, str(SOAK))
import soak_one_node  # noqa: E402  (benchmarks/soak is not a package)


def _final(folder: Path, rank: int, rng_byte: int = 0) -> None:
    rng = torch.zeros(8, dtype=torch.uint8)
    rng[0] = rng_byte
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "scheduler": {"n": 1}}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({**state, "rng": rng, "epoch": 2}, folder / f"{rank}.pt")


def test_the_comparison_names_a_rank_whose_random_state_alone_differs(tmp_path):
    for rank in range(soak_one_node.WORLD_SIZE):
        _final(tmp_path / "reference" / "final", rank)
        _final(tmp_path / "soaked" / "final", rank, rng_byte=int(rank == 2))
    found = soak_one_node.differences(tmp_path / "reference", tmp_path / "soaked")
    assert found == ["rank 2: rng differs from the uninterrupted run"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_five_random_kills_end_bitwise_with_no_silent_mismatch(tmp_path):
    argv = [sys.executable, "soak_one_node.py", "--out", str(tmp_path), "--runs", "1"]
    argv += ["--stop-runs", "0", "--spares", "1", "--steps", "100", "--seed", "3"]
    proc = subprocess.run(argv, cwd=SOAK, capture_output=True, text=True, timeout=840)
    report = proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "soak.json").read_text())
    kills = summary["SIGKILL, --spares 1"]
    assert kills["delivered"] == 5, report
    assert summary["silent_mismatches"] == 0, report
    assert summary["runs_bitwise"] == 1 and proc.returncode == 0, report
