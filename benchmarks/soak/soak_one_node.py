"""Soak: one node x 4, faults at random moments, every run checked against an uninterrupted one.

    python benchmarks/soak/soak_one_node.py      # make soak: 10 runs x 5 kills, 2 runs x 5 stops
    python benchmarks/soak/soak_one_node.py --runs 1 --stop-runs 0 --out runs/sample   # 5 kills

First an uninterrupted run of benchmarks/soak/random_train.py is the reference. Then
each soaked run is the same job under `lockstep run --live-recovery --max-restarts 8`
while this driver delivers `--faults-per-run` faults, one after another: it waits a
delay drawn uniformly from [0, --window] seconds (after the run's first step, then
after the previous fault's recovery), picks a rank uniformly and sends it SIGKILL;
in the stop runs it sends SIGSTOP instead and the launcher runs with
`--replace-stuck --stall-timeout S`, so the stall watch must find and replace the
frozen rank. A fault has landed when the victim rank's new process completed a step
(its recovery time is from the signal to that step); it was live when every other
rank kept its process; where the job ended first (a fault after the last step), the
job's exit code says how it ended.

At the end of every run, each rank's parameters, optimizer state, scheduler state,
random state and epoch must be bitwise equal to the same rank's in the reference,
and every sample id must have been consumed once per epoch (the last log line of a
step counts). A run that differs although no line said "falling back" is a silent
mismatch. Prints one line per fault and writes OUT/soak.json with the figure: live
k/N, fallbacks by reason, recovery time median and max, mismatches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from soak_kills import recovered_at
from soak_nodes import read_batches, read_pids

TRAIN = str(Path(__file__).with_name("random_train.py"))
WORLD_SIZE, SAMPLES, SAMPLES_PER_STEP = 4, 64, 8
FALLBACK = re.compile(
    r"live recovery not possible: (.*?)(?:; falling back|, and no whole-group|; the job ends)"
)
# A rank lost after its peers' scripts ended: the job is over, it ends failed, no restart
ENDED_FAILED = "the job ends failed, with no whole-group restart"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/soak_one_node")
    parser.add_argument("--runs", type=int, default=10, help="runs with SIGKILLs")
    parser.add_argument("--stop-runs", type=int, default=2, help="runs with SIGSTOPs")
    parser.add_argument("--faults-per-run", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--window", type=float, default=3.0, help="delays: U[0, window] s")
    parser.add_argument("--stall-timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--spares", default="0,1", help="--spares of each run in turn (standby workers per node)"
    )
    return parser.parse_args()


class Run:
    """One `lockstep run --nproc-per-node 4` of random_train.py, its output in OUT/launcher.log."""

    def __init__(self, out: Path, flags: list[str], args: argparse.Namespace) -> None:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        self.out, self.log_path, self.stopped = out, out / "launcher.log", set()
        argv = [sys.executable, "-m", "lockstep.cli", "run", "--nproc-per-node", str(WORLD_SIZE)]
        argv += [*flags, TRAIN, "--out", str(out), "--steps", str(args.steps)]
        argv += ["--step-sleep", str(args.step_sleep)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int | None:
        """The launcher's exit code, or None when it passed the deadline (then it is killed)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            return None
        finally:
            for pid in self.stopped:  # never leave a frozen worker behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def wait_for(self, what: str, check, timeout: float) -> bool:
        """True once `check()` holds; False when the job ended first. Raises past `timeout`."""
        deadline = time.monotonic() + timeout
        while not check():
            if self.ended():
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not within {timeout} s\n{self.log()[-3000:]}")
            time.sleep(0.05)
        return True


def steps_logged(out: Path, rank: int) -> int:
    try:
        return len((out / "steps" / str(rank)).read_text().splitlines())
    except OSError:
        return 0


def deliver(run: Run, fault: signal.Signals, rng: random.Random, window: float) -> dict | None:
    """One fault at a random moment to a random rank, and how it ended; None if the job
    ended before the moment came."""
    delay = rng.uniform(0.0, window)
    if _sleep_unless_ended(run, delay):
        return None
    rank, old = rng.randrange(WORLD_SIZE), read_pids(run.out)
    logged_before = len(run.log())
    signalled_at = time.time()
    try:
        os.kill(old[rank], fault)
    except ProcessLookupError:  # the rank's process ended on its own (the run's end)
        return None
    if fault == signal.SIGSTOP:
        run.stopped.add(old[rank])
    record = {"signal": fault.name, "rank": rank, "delay_s": round(delay, 2)}
    record["step"] = min(steps_logged(run.out, r) for r in range(WORLD_SIZE))
    done = run.wait_for(
        "the victim's new process completing a step",
        lambda: recovered_at(run.out, old, [rank], signalled_at) is not None,
        400,
    )
    new_lines = run.log()[logged_before:]
    reasons = FALLBACK.findall(new_lines)
    now = read_pids(run.out)
    record["live"] = (
        done and not reasons and all(now.get(r) == pid for r, pid in old.items() if r != rank)
    )
    record["fallback"] = reasons[0] if reasons else None
    if done:
        recovered = recovered_at(run.out, old, [rank], signalled_at)
        record["recover_s"] = round(recovered - signalled_at, 2)
    else:
        record["job_ended_first"] = True
    return record


def _sleep_unless_ended(run: Run, seconds: float) -> bool:
    """Sleep `seconds`; True when the job ended meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if run.ended():
            return True
        time.sleep(0.02)
    return run.ended()


FINAL_PARTS = ("model", "optimizer", "scheduler", "rng", "epoch")


def differences(reference: Path, soaked: Path, lost: set[int] = frozenset()) -> list[str]:
    """Every part of every rank's final state that differs from the reference's (the
    ranks in `lost`, which may have died before writing theirs, only where they did)."""
    problems = []
    for rank in range(WORLD_SIZE):
        try:
            mine = torch.load(soaked / "final" / f"{rank}.pt", weights_only=False)
        except OSError:
            if rank not in lost:
                problems.append(f"rank {rank} wrote no final state")
            continue
        theirs = torch.load(reference / "final" / f"{rank}.pt", weights_only=False)
        for part in FINAL_PARTS:
            if not _equal(mine[part], theirs[part]):
                problems.append(f"rank {rank}: {part} differs from the uninterrupted run")
    return problems


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def id_problems(out: Path, steps: int) -> list[str]:
    """Every step of every rank logged, every sample id once in each epoch."""
    batches = read_batches(out, WORLD_SIZE)
    every = {(rank, step) for rank in range(WORLD_SIZE) for step in range(steps)}
    if odd := sorted(every ^ batches.keys()):
        return [f"(rank, step) missing from the logs or beyond the run: {odd[:8]}"]
    counts = Counter((epoch, i) for epoch, ids in batches.values() for i in ids)
    full_epochs = steps * SAMPLES_PER_STEP // SAMPLES
    expected = {(e, i) for e in range(full_epochs) for i in range(SAMPLES)}
    bad = sorted(k for k in expected | counts.keys() if k[0] < full_epochs and counts[k] != 1)
    return [f"sample ids not consumed once per epoch: (epoch, id) {bad[:8]}"] if bad else []


def soak_run(
    out: Path, fault: signal.Signals, spares: int, args, rng: random.Random, reference: Path
) -> dict:
    flags = ["--live-recovery", "--max-restarts", "8", "--spares", str(spares)]
    if fault == signal.SIGSTOP:
        flags += ["--replace-stuck", "--stall-timeout", str(args.stall_timeout)]
    run = Run(out, flags, args)
    faults: list[dict] = []
    try:
        first = lambda: all(steps_logged(out, r) > 0 for r in range(WORLD_SIZE))  # noqa: E731
        if run.wait_for("the first step", first, 600):
            for _ in range(args.faults_per_run):
                record = deliver(run, fault, rng, args.window)
                if record is None:
                    break
                faults.append(record)
                print(f"{out.name}: {_describe(record)}", flush=True)
                if record.get("job_ended_first"):
                    break
    finally:
        code = run.wait(900)
    # a rank lost after the others' scripts ended: failed on purpose (nothing to recover),
    # every final state written must still be the reference's
    ended_failed = code != 0 and ENDED_FAILED in run.log() and "falling back" not in run.log()
    problems = [] if code == 0 or ended_failed else [f"the launcher exited {code}"]
    if code == 0:
        problems += differences(reference, out) + id_problems(out, args.steps)
    elif ended_failed:
        problems += differences(reference, out, lost={faults[-1]["rank"]} if faults else set())
    fell_back = "falling back" in run.log()
    return {
        "run": out.name,
        "spares": spares,
        "exit": code,
        "lost_after_the_end": ended_failed,
        "faults": faults,
        "problems": problems,
        "silent_mismatch": bool(problems) and code == 0 and not fell_back,
    }


def _describe(record: dict) -> str:
    what = f"{record['signal']} rank {record['rank']} at step ~{record['step']}"
    if record.get("job_ended_first"):
        how = "the job ended before a new process of that rank completed a step"
    elif record["live"]:
        how = f"live, {record['recover_s']:.2f} s"
    else:
        how = f"fallback ({record['fallback']}), {record['recover_s']:.2f} s"
    return f"{what}: {how}"


def summarize(runs: list[dict]) -> dict:
    """Per signal and --spares: live k/N, fallbacks by reason, live recovery times."""
    summary: dict = {}
    for name, spares in sorted({(f["signal"], r["spares"]) for r in runs for f in r["faults"]}):
        faults = [
            f for r in runs if r["spares"] == spares for f in r["faults"] if f["signal"] == name
        ]
        times = sorted(f["recover_s"] for f in faults if f.get("live"))
        summary[f"{name}, --spares {spares}"] = {
            "delivered": len(faults),
            "live": sum(bool(f["live"]) for f in faults),
            "fallbacks_by_reason": dict(Counter(f["fallback"] for f in faults if f["fallback"])),
            "ended_before_recovery": sum(bool(f.get("job_ended_first")) for f in faults),
            "live_recover_s_median": statistics.median(times) if times else None,
            "live_recover_s_max": max(times, default=None),
        }
    summary["runs"] = len(runs)
    summary["runs_bitwise"] = sum(not r["problems"] for r in runs)
    summary["silent_mismatches"] = sum(r["silent_mismatch"] for r in runs)
    summary["lost_after_the_end"] = sum(r["lost_after_the_end"] for r in runs)
    summary["problems"] = {r["run"]: r["problems"] for r in runs if r["problems"]}
    return summary


def main() -> int:
    args = parse_args()
    out = Path(args.out).resolve()
    rng = random.Random(args.seed)
    started = time.monotonic()
    reference = Run(out / "reference", ["--max-restarts", "0"], args)
    if reference.wait(900) != 0:
        print(reference.log()[-3000:], file=sys.stderr)
        return 1
    plan = [signal.SIGKILL] * args.runs + [signal.SIGSTOP] * args.stop_runs
    spares = [int(n) for n in args.spares.split(",")]
    runs = [
        soak_run(
            out / f"{fault.name.lower()}{number}",
            fault,
            spares[number % len(spares)],
            args,
            rng,
            out / "reference",
        )
        for number, fault in enumerate(plan)
    ]
    summary = summarize(runs) | {"seconds": round(time.monotonic() - started, 1)}
    summary["load_average"] = os.getloadavg()
    (out / "soak.json").write_text(json.dumps({**summary, "details": runs}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if summary["runs_bitwise"] == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
