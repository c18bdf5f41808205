"""Soak: two nodes x 2 workers, 20 random SIGKILLs and one lost node, then bitwise checks.

    make soak        # or: python benchmarks/soak/soak_two_nodes.py [--steps 480 --seed 0]
    python benchmarks/soak/soak_two_nodes.py --kills 3 --steps 120    # a short run
    python benchmarks/soak/soak_two_nodes.py --batchnorm --out runs/soak_bn   # BatchNorm

Needs root (two network namespaces, lockstep.testing.netns). First an uninterrupted
two-node run of benchmarks/soak/soak_train.py is the reference. Then the same job
runs with --live-recovery (where the launcher refuses that flag for two nodes, the
refusal is printed and the job runs with --max-restarts 25 alone) while this
driver, at random moments, delivers `--kills` worker kills (a quarter with rank 0
held inside a checkpoint write, a quarter with a rank held in backward while its
peers wait in the all-reduce, one of rank 0, the rest random ranks) and loses node 1
once (every process of its namespace SIGKILLed, its launcher started again):
benchmarks/soak/soak_kills.py. At the end the parameters and the optimizer state
must be bitwise equal to the reference, and every sample id must have been
consumed exactly once per epoch, counted from the ranks' logs of the batches they
drew (OUT/ids/RANK, a step's last line counting: `read_batches`), in both runs.
Prints one line per kill (live or restart; time to recover: from the kill to the
first step the victims' new processes completed) and writes OUT/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from soak_kills import deliver, kill_plan, wait_recovery, wait_until
from soak_nodes import Job, read_batches, read_pids, read_progress

from lockstep.testing.netns import two_hosts

WORLD_SIZE, SAMPLES_PER_STEP, N_SAMPLES = 4, 12, 48
RESTART = ["--max-restarts", "25", "--rdzv-timeout", "60"]
LIVE = ["--live-recovery", *RESTART]  # a fault live recovery cannot handle falls back


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--steps", type=int, default=480, help="a multiple of 4 (one epoch)")
    parser.add_argument("--kills", type=int, default=20, help="worker kills (plus one lost node)")
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batchnorm", action="store_true", help="buffers at every forward")
    return parser.parse_args()


def start_soaked(hosts, out: Path, script: list[str]) -> Job:
    """The job with --live-recovery, or, where the launcher refuses it, with restarts only."""
    job = Job(hosts, out, LIVE, script)
    while not job.ended() and read_progress(out)[1] == 0:
        time.sleep(0.1)
    if not job.ended():
        return job
    job.wait(30)
    lines = [line for line in job.tail().splitlines() if "error:" in line]
    print(f"--live-recovery refused: {lines[-1].split('error:', 1)[1].strip() if lines else '?'}")
    print(f"falling back to the whole-group restart ({' '.join(RESTART)})", flush=True)
    for node in (0, 1):
        (out / f"node{node}.log").rename(out / f"node{node}.refused.log")
    return Job(hosts, out, RESTART, script)


def soak(job: Job, steps: int, kills: int, rng: random.Random) -> list[dict]:
    """Run the kill plan against a running job; one record per kill."""
    records: list[dict] = []
    for number, kind in enumerate(kill_plan(kills, rng), start=1):
        wait_until("the first step", lambda: read_progress(job.out)[1] > 0, 300, job)
        time.sleep(rng.uniform(0.2, 2.5))
        if read_progress(job.out)[1] >= steps - 8:
            print(f"kill {number}: training too close to its end; no more kills", flush=True)
            break
        step, old = read_progress(job.out)[1], read_pids(job.out)
        what, victims, killed_at = deliver(kind, job, rng)
        took = wait_recovery(job, old, victims, killed_at, f"recovery from kill {number}")
        now = read_pids(job.out)
        live = all(now.get(r) == pid for r, pid in old.items() if r not in victims)
        records.append(
            {
                "kill": number,
                "kind": kind,
                "what": what,
                "step": step,
                "recover_s": round(took, 2),
                "live": live,
            }
        )
        how = "live" if live else "restart"
        print(f"kill {number:2d}: {what:42s} at step {step:4d}; {how:7s} {took:6.2f} s", flush=True)
    return records


def compare(reference: dict, soaked: dict) -> list[str]:
    """Every difference between the two runs' final parameters and optimizer states."""
    problems = []
    for name, value in reference["params"].items():
        if not torch.equal(value, soaked["params"][name]):
            problems.append(f"parameter {name} differs")
    ref_opt, soak_opt = reference["optimizer"], soaked["optimizer"]
    for index, state in ref_opt["state"].items():
        for key, value in state.items():
            if not torch.equal(
                torch.as_tensor(value), torch.as_tensor(soak_opt["state"][index][key])
            ):
                problems.append(f"optimizer state {index}.{key} differs")
    return problems


def check_ids(batches: dict[tuple[int, int], tuple[int, list[int]]], steps: int) -> list[str]:
    """Every step of every rank logged, every sample id once in each epoch, none after."""
    problems = []
    every_step = {(rank, step) for rank in range(WORLD_SIZE) for step in range(steps)}
    if odd := sorted(every_step ^ batches.keys()):
        problems.append(f"steps missing from the logs or beyond the run: (rank, step) {odd[:10]}")
    counts = Counter((epoch, i) for epoch, ids in batches.values() for i in ids)
    epochs = steps * SAMPLES_PER_STEP // N_SAMPLES
    expected = {(epoch, i) for epoch in range(epochs) for i in range(N_SAMPLES)}
    seen = expected | counts.keys()  # an epoch after the run's last must stay empty
    if bad := sorted((key, counts[key]) for key in seen if counts[key] != (key in expected)):
        problems.append(
            f"sample ids not consumed exactly once per epoch: ((epoch, id), count) {bad[:10]}"
        )
    return problems


def check_run(out: Path, steps: int) -> list[str]:
    """`check_ids` on a run's logs, each problem prefixed with the run's name."""
    try:
        problems = check_ids(read_batches(out, WORLD_SIZE), steps)
    except ValueError as error:
        problems = [str(error)]
    return [f"{out.name}: {problem}" for problem in problems]


def summarize(records: list[dict], codes: list, problems: list[str], kills: int) -> dict:
    """k/N recovered (and how many live), recovery times, the lost node, bitwise."""
    ok = codes == [0, 0]
    workers = [r for r in records if r["kind"] != "lost node"]
    times = sorted(r["recover_s"] for r in workers)
    return {
        "worker_kills_recovered": f"{len(workers) if ok else 0}/{kills}",
        "recovered_live": f"{sum(r['live'] for r in workers)}/{kills}",
        "recover_s_median": statistics.median(times) if times else None,
        "recover_s_max": max(times, default=None),
        "lost_node": [r for r in records if r["kind"] == "lost node"],
        "bitwise_equal_and_exactly_once": ok and not problems,
        "problems": problems,
    }


def main() -> int:
    args = parse_args()
    out = Path(args.out).resolve()
    for run in ("reference", "soaked"):  # a previous soak's checkpoints would be resumed
        shutil.rmtree(out / run, ignore_errors=True)
    rng = random.Random(args.seed)
    script = ["--steps", str(args.steps), *(["--batchnorm"] if args.batchnorm else [])]
    started = time.monotonic()
    with two_hosts(prefix="soak") as hosts:
        reference = Job(hosts, out / "reference", ["--max-restarts", "0"], script)
        if reference.wait(900) != [0, 0]:
            print(reference.tail(), file=sys.stderr)
            return 1
    with two_hosts(prefix="soak") as hosts:
        job = start_soaked(hosts, out / "soaked", [*script, "--step-sleep", str(args.step_sleep)])
        soak_started = time.monotonic()
        try:
            records = soak(job, args.steps, args.kills, rng)
        finally:
            codes = job.wait(1200)
        soak_s = time.monotonic() - soak_started
    if codes != [0, 0]:
        print(f"the soaked job failed: {codes}\n{job.tail()}", file=sys.stderr)
    load = lambda run: torch.load(out / run / "final.pt", weights_only=True)  # noqa: E731
    problems = check_run(out / "reference", args.steps)
    if codes == [0, 0]:
        problems += compare(load("reference"), load("soaked"))
        problems += check_run(out / "soaked", args.steps)
    summary = summarize(records, codes, problems, args.kills)
    summary |= {"flags": job.flags, "soak_s": round(soak_s, 1)}
    summary |= {"total_s": round(time.monotonic() - started, 1), "load_average": os.getloadavg()}
    (out / "soak.json").write_text(json.dumps({**summary, "kills": records}, indent=1))
    print(json.dumps(summary, indent=1))
    complete = summary["worker_kills_recovered"] == f"{args.kills}/{args.kills}"
    return 0 if summary["bitwise_equal_and_exactly_once"] and complete else 1


if __name__ == "__main__":
    sys.exit(main())
