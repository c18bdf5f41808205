"""A worker lost on one node x 2: live recovery against the whole-group restart, side by side.

    python benchmarks/recovery.py                       # 3 kills each, interleaved
    python benchmarks/recovery.py --repeats 5 --out /tmp/recovery

`lockstep run --nproc-per-node 2` runs benchmarks/recovery_train.py (DDP, Adam,
dropout, a checkpoint every 10 steps) once uninterrupted (the oracle), then, in
turns, with `--live-recovery` and with `--max-restarts 1`, each time SIGKILLing
rank 1 inside backward of step 13 (3 steps after the last checkpoint). From the
steps' completion times it reports: time from the kill to the first step every rank
completed after it; how long the survivor (rank 0) stood still (its longest gap
between two completed steps around the kill, less its median step); steps computed
again; and whether the final parameters and Adam state are bitwise the oracle's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SCRIPT = str(Path(__file__).with_name("recovery_train.py"))
MODES = {"live": ["--live-recovery"], "restart": ["--max-restarts", "1"]}
MODES["spare"] = ["--live-recovery", "--spares", "1"]  # live, a standby worker takes the rank
TIMEOUT_S = 300


def run(out: Path, flags: list[str], steps: int, kill: str) -> None:
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "lockstep.cli", "run", "--nproc-per-node", "2", *flags]
    argv += [SCRIPT, "--out", str(out), "--steps", str(steps)]
    env = {**os.environ, "RECOVERY_KILL": kill}
    with open(out / "launcher.log", "w") as log:
        done = subprocess.run(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT_S
        )
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}); see {out / 'launcher.log'}")


def bitwise(out: Path, oracle: Path) -> bool:
    for rank in (0, 1):
        mine, ref = (torch.load(d / f"final_rank{rank}.pt") for d in (out, oracle))
        if not all(torch.equal(mine["model"][k], v) for k, v in ref["model"].items()):
            return False
        for index, entry in ref["optimizer"]["state"].items():
            theirs = mine["optimizer"]["state"][index]
            if not all(torch.equal(torch.as_tensor(theirs[k]), torch.as_tensor(v))
                       for k, v in entry.items()):  # fmt: skip
                return False
    return True


def measure(out: Path, oracle: Path) -> dict[str, float]:
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    kill_t = json.loads((out / "kill.json").read_text())["t"]
    before = [e for e in events if e["t"] < kill_t]
    after = [e for e in events if e["t"] >= kill_t]
    done_before = {(e["rank"], e["step"]) for e in before}
    first_all = max(min(e["t"] for e in after if e["rank"] == r) for r in (0, 1))
    survivor = sorted(e["t"] for e in events if e["rank"] == 0)
    gaps = [b - a for a, b in itertools.pairwise(survivor)]
    around = max(b - a for a, b in itertools.pairwise(survivor) if b >= kill_t)
    return {
        "recovery_s": first_all - kill_t,
        "survivor_still_s": around - statistics.median(gaps),
        "recomputed": len({e["step"] for e in after if (e["rank"], e["step"]) in done_before}),
        "bitwise": float(bitwise(out, oracle)),
    }


def table(results: dict[str, list[dict[str, float]]]) -> str:
    lines = [
        "| | kill to first step after it (s) | survivor stood still (s) | steps computed "
        "again | bitwise equal to the uninterrupted run |",
        "|---|---|---|---|---|",
    ]
    for mode, runs in results.items():
        rec = [r["recovery_s"] for r in runs]
        still = [r["survivor_still_s"] for r in runs]
        redo = sorted({int(r["recomputed"]) for r in runs})
        same = sum(int(r["bitwise"]) for r in runs)
        each = ", ".join(f"{v:.2f}" for v in rec)
        lines.append(
            f"| {mode} | median {statistics.median(rec):.2f} ({each}) "
            f"| median {statistics.median(still):.2f} | {', '.join(map(str, redo))} "
            f"| {same}/{len(runs)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=13)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="recovery-"))
    oracle = root / "oracle"
    run(oracle, [], args.steps, "")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode, flags in MODES.items():
            out = root / f"{mode}{repeat}"
            run(out, flags, args.steps, f"1:{args.kill_step}")
            results[mode].append(measure(out, oracle))
            print(mode, repeat, results[mode][-1], flush=True)
    (root / "recovery.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
