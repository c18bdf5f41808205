"""Soak: two nodes x 2 workers, 20 random SIGKILLs and one lost launcher, then bitwise checks.

    make soak        # or: python benchmarks/soak/soak_two_nodes.py [--steps 480 --seed 0]

Needs root (two network namespaces, lockstep.testing.netns). First an uninterrupted
two-node run of benchmarks/soak/soak_train.py is the reference. Then the same job
runs with --max-restarts 25 while this driver, at random moments, SIGKILLs 20
random workers (5 of them rank 0 held inside a checkpoint write, the temporary
file written but not committed) and once SIGKILLs node 1's launcher and starts
it again. At the end the parameters and the optimizer state must be bitwise
equal to the reference, and every sample id must have been consumed exactly
once per epoch. Prints one line per kill (time to recover: from the kill to the
first step that new workers completed) and writes OUT/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
from soak_nodes import Job, read_pids, read_progress

from lockstep.testing.netns import two_hosts

WORKER_KILLS, SAVE_KILLS, WORLD_SIZE, SAMPLES_PER_STEP, N_SAMPLES = 20, 5, 4, 12, 48


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--steps", type=int, default=480, help="a multiple of 4 (one epoch)")
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def wait_until(what: str, check, timeout: float, job: Job) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline or job.ended():
            raise RuntimeError(f"timed out or job ended waiting for {what}:\n{job.tail()}")
        time.sleep(0.05)


def kill_plan(rng: random.Random) -> list[str]:
    """The 21 kills in order: 'worker', 'save' (rank 0 in a write) and one 'launcher'."""
    plan = ["save"] * SAVE_KILLS + ["worker"] * (WORKER_KILLS - SAVE_KILLS)
    rng.shuffle(plan)
    plan.insert(rng.randrange(5, WORKER_KILLS - 5), "launcher")
    return plan


def kill_once(kind: str, job: Job, rng: random.Random) -> str:
    """Deliver one kill; returns what was killed."""
    out = job.out
    if kind == "launcher":
        job.kill_launcher(1)
        time.sleep(rng.uniform(0.5, 3.0))
        job.start_node(1)
        return "node 1's launcher (then started again)"
    if kind == "save":
        (out / "in_save").unlink(missing_ok=True)
        (out / "pause_in_save").write_text("")
        wait_until("rank 0 inside a save", (out / "in_save").exists, 60, job)
        os.kill(int((out / "in_save").read_text()), signal.SIGKILL)
        return "rank 0 inside a checkpoint write"
    rank = rng.randrange(WORLD_SIZE)
    os.kill(read_pids(out)[rank], signal.SIGKILL)
    return f"rank {rank}"


def soak(job: Job, steps: int, rng: random.Random) -> list[dict]:
    """Run the kill plan against a running job; one record per kill."""
    records: list[dict] = []
    for number, kind in enumerate(kill_plan(rng), start=1):
        wait_until("the first step", lambda: read_progress(job.out)[1] > 0, 300, job)
        old = set(read_pids(job.out).values())
        time.sleep(rng.uniform(0.2, 2.5))
        if read_progress(job.out)[1] >= steps - 8:
            print(f"kill {number}: training too close to its end; no more kills", flush=True)
            break
        step = read_progress(job.out)[1]
        what = kill_once(kind, job, rng)
        killed = time.monotonic()
        wait_until(
            f"recovery from kill {number}",
            lambda old=old: read_progress(job.out)[0] not in old,
            400,
            job,
        )
        took = time.monotonic() - killed
        records.append({"kill": number, "what": what, "step": step, "recover_s": round(took, 1)})
        print(f"kill {number:2d}: {what:40s} at step {step:4d}; recovered in {took:5.1f} s")
    return records


def compare(reference: dict, soaked: dict, steps: int) -> list[str]:
    """Every difference between the two runs' final states, and any miscounted sample."""
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
    epochs = steps * SAMPLES_PER_STEP // N_SAMPLES
    counts = soaked["counts"]
    if not (counts[:epochs] == 1).all() or counts[epochs:].any():
        bad = (counts[:epochs] != 1).nonzero().tolist()[:10]
        problems.append(f"sample ids not consumed exactly once per epoch: (epoch, id) {bad}")
    return problems


def main() -> int:
    args = parse_args()
    out = Path(args.out).resolve()
    rng = random.Random(args.seed)
    script = ["--steps", str(args.steps)]
    started = time.monotonic()
    with two_hosts(prefix="soak") as hosts:
        reference = Job(hosts, out / "reference", ["--max-restarts", "0"], script)
        if reference.wait(900) != [0, 0]:
            print(reference.tail(), file=sys.stderr)
            return 1
    with two_hosts(prefix="soak") as hosts:
        flags = ["--max-restarts", "25", "--rdzv-timeout", "60"]
        job = Job(hosts, out / "soaked", flags, [*script, "--step-sleep", str(args.step_sleep)])
        soak_started = time.monotonic()
        try:
            records = soak(job, args.steps, rng)
        finally:
            codes = job.wait(1200)
        soak_s = time.monotonic() - soak_started
    if codes != [0, 0]:
        print(f"the soaked job failed: {codes}\n{job.tail()}", file=sys.stderr)
    load = lambda run: torch.load(out / run / "final.pt", weights_only=True)  # noqa: E731
    problems = compare(load("reference"), load("soaked"), args.steps) if codes == [0, 0] else []
    survived = sum(1 for r in records if "launcher" not in r["what"]) if codes == [0, 0] else 0
    summary = {
        "worker_kills_survived": f"{survived}/{WORKER_KILLS}",
        "launcher_kills": sum(1 for r in records if "launcher" in r["what"]),
        "bitwise_equal_and_exactly_once": codes == [0, 0] and not problems,
        "problems": problems,
        "soak_s": round(soak_s, 1),
        "total_s": round(time.monotonic() - started, 1),
        "kills": records,
        "load_average": os.getloadavg(),
    }
    (out / "soak.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "kills"}, indent=1))
    return 0 if summary["bitwise_equal_and_exactly_once"] and survived == WORKER_KILLS else 1


if __name__ == "__main__":
    sys.exit(main())
