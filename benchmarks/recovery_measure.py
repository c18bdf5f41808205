"""What one killed run of benchmarks/recovery.py cost, read from the files it left.

From OUT/events.jsonl (one line per completed step and rank), OUT/kill.json (the
kill's time) and OUT/final_rank<R>.pt against the uninterrupted run's:
- recovery_s: from the kill to the first step every rank completed after it;
- still_s: rank 0's longest gap between two completed steps around the kill, less
  its median gap (how long the survivor stood still);
- recomputed: steps that some rank completed both before and after the kill;
- lost / repeated: samples of a (rank, step) share never taken into a step, or taken
  twice while not every rank computed that step again (a rollback of the whole group
  is counted in `recomputed`, not here);
- alone: steps rank 0 completed with fewer participants than the world (torchft);
- bitwise: final parameters and optimizer state of every rank equal the oracle's.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import Counter
from pathlib import Path

import torch


def _same_state(mine: dict, ref: dict) -> bool:
    if not all(torch.equal(mine["model"][k], v) for k, v in ref["model"].items()):
        return False
    for index, entry in ref["optimizer"]["state"].items():
        theirs = mine["optimizer"]["state"][index]
        for key, value in entry.items():
            if not torch.equal(torch.as_tensor(theirs[key]), torch.as_tensor(value)):
                return False
    return True


def bitwise(out: Path, oracle: Path) -> bool:
    """True if every rank's final state in `out` equals the same rank's in `oracle`."""
    ranks = sorted(path.name for path in oracle.glob("final_rank*.pt"))
    return bool(ranks) and all(
        (out / name).exists() and _same_state(torch.load(out / name), torch.load(oracle / name))
        for name in ranks
    )


def samples(events: list[dict], steps: int, world: int) -> tuple[int, int]:
    """(samples lost, samples repeated), counted per (rank, step) share."""
    taken = Counter((e["rank"], e["step"]) for e in events if e.get("participating", True))
    sizes = {
        (e["rank"], e["step"]): e["samples"][1] - e["samples"][0]
        for e in events
        if e.get("samples")
    }
    share = max(sizes.values(), default=0)
    lost = sum(share for r in range(world) for s in range(steps) if not taken[r, s])
    redone = {s for s in range(steps) if all(taken[r, s] > 1 for r in range(world))}
    repeated = sum(
        share * (count - 1) for (r, s), count in taken.items() if count > 1 and s not in redone
    )
    return lost, repeated


def measure(out: Path, oracle: Path, steps: int, world: int) -> dict[str, float]:
    """The columns of one run (see the module docstring)."""
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    kill_t = json.loads((out / "kill.json").read_text())["t"]
    before = {(e["rank"], e["step"]) for e in events if e["t"] < kill_t}
    after = [e for e in events if e["t"] >= kill_t]
    first_all = max(min(e["t"] for e in after if e["rank"] == r) for r in range(world))
    survivor = sorted(e["t"] for e in events if e["rank"] == 0)
    gaps = [b - a for a, b in itertools.pairwise(survivor)]
    around = max(b - a for a, b in itertools.pairwise(survivor) if b >= kill_t)
    lost, repeated = samples(events, steps, world)
    alone = {e["step"] for e in after if e["rank"] == 0 and e.get("participants", world) < world}
    return {
        "recovery_s": first_all - kill_t,
        "still_s": around - statistics.median(gaps),
        "recomputed": len({e["step"] for e in after if (e["rank"], e["step"]) in before}),
        "lost": lost,
        "repeated": repeated,
        "alone": len(alone),
        "bitwise": float(bitwise(out, oracle)),
    }
