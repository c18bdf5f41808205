"""The random soak's comparison, checked on a state that differs in one part.

benchmarks/soak/soak_one_node.py (`make soak`, in CI: 50 SIGKILLs and 10 SIGSTOPs at
random moments of a one-node x 4 job) must find every rank's parameters, optimizer,
scheduler, random state and epoch bitwise equal to the uninterrupted run's, and exits
1 otherwise. Its comparison must see a difference in any one part: here, the random
state of one rank alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

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
