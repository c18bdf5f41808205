"""`lockstep plan --profile`'s predicted step time and overlap against the engine's measured ones.

    python benchmarks/plan_vs_measured.py                         # world size 2, loopback
    python benchmarks/plan_vs_measured.py --timeline-dir docs/img # also draw the small GPT
    sudo python benchmarks/plan_vs_measured.py --nodes 2 --rate 1gbit   # 2 nodes x 2, veth

benchmarks/plan_vs_measured_worker.py measures, per repetition and on every rank
at once: each workload's one-process profile, the link (the bench's sweep and its
slowdown while ranks compute) and the engine's steps. Here each repetition's
profile (rank 0's) is simulated on that repetition's link
(lockstep.plan.simulate, buckets from the engine's own bucketing function) and
compared with the engine's step time and overlap (mean over ranks of the median
step). Targets: step time within 15%, overlap within 10 points. The terms are
printed beside it (forward, backward, exposed, link time: predicted / measured),
so a miss names the term that was wrong, and how far apart the ranks finish
backward (median over steps): a rank's exposed time includes waiting for the other.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from plan_vs_measured_worker import add_flags, measure

from lockstep.observe.plot import plot_timeline
from lockstep.plan.comm import ring_seconds
from lockstep.plan.links import measured_from_doc
from lockstep.plan.simulate import SimStep, engine_buckets, simulate
from lockstep.plan.timeline import write_predicted
from lockstep.testing import run_ranks

WORKER = str(Path(__file__).with_name("plan_vs_measured_worker.py"))
PORT = 29571
TIMEOUT_S = 1500
# Both nodes need the same job secret; a scheduler would export it, this driver does.
os.environ.setdefault("LOCKSTEP_JOB_SECRET", secrets.token_hex(32))


def _rank_mean(values) -> float:
    return statistics.mean(values)


def _measured(results: list[dict], i: int, name: str) -> dict:
    """Repetition i of the engine: per rank the median step, then the mean over ranks."""
    per_rank = [r["reps"][i]["engine"][name] for r in results]

    def term(fn) -> float:
        return _rank_mean(statistics.median(fn(s) for s in e["stats"]) for e in per_rank)

    ends = zip(
        *([s.start + s.forward_seconds + s.backward_seconds for s in e["stats"]] for e in per_rank),
        strict=True,
    )
    return {
        "skew_s": statistics.median(max(step) - min(step) for step in ends),
        "step_s": _rank_mean(statistics.median(e["step_s"]) for e in per_rank),
        "overlap": term(lambda s: s.overlap),
        "forward_s": term(lambda s: s.forward_seconds),
        "backward_s": term(lambda s: s.backward_seconds),
        "exposed_s": term(lambda s: s.exposed_seconds),
        "comm_s": term(lambda s: s.comm_seconds),
        "layout": per_rank[0]["layout"],
    }


def predict(results: list[dict], i: int, name: str, slowdown: bool = True) -> SimStep:
    """Repetition i's prediction: rank 0's profile on the link and slowdown it measured."""
    rep, world = results[0]["reps"][i], len(results)
    link = measured_from_doc(rep["sweep"], "sweep")
    factor = rep["slowdown"]["factor"] if slowdown else 1.0
    profile = rep["profile"][name]
    cost = lambda b: ring_seconds(b, world, link.low_bps, link.hop_latency_s)  # noqa: E731
    return simulate(profile, engine_buckets(profile), cost, factor)


def _term(sim: SimStep, key: str) -> float:
    """A predicted term; link time as the engine counts it, launch to done, summed."""
    if key == "comm_s":
        return sum(b.done - b.launched for b in sim.buckets)
    return getattr(sim, key)


def summarize(results: list[dict], name: str) -> dict:
    rows = []
    for i in range(len(results[0]["reps"])):
        sim, plain = predict(results, i, name), predict(results, i, name, False)
        meas = _measured(results, i, name)
        rows.append((sim, plain, meas, results[0]["reps"][i]["slowdown"]["factor"]))
    med = statistics.median
    ratios = [s.step_s / m["step_s"] for s, _, m, _ in rows]
    points = [100 * (s.overlap - m["overlap"]) for s, _, m, _ in rows]
    sim, _, meas, _ = rows[-1]
    return {
        "name": name,
        "same_buckets": [b.nbytes for b in sim.buckets] == meas["layout"],
        "slowdown": med(f for *_, f in rows),
        "predicted_ms": 1e3 * med(s.step_s for s, *_ in rows),
        "no_slowdown_ms": 1e3 * med(p.step_s for _, p, _, _ in rows),
        "skew_ms": 1e3 * med(m["skew_s"] for *_, m, _ in rows),
        "measured_ms": 1e3 * med(m["step_s"] for _, _, m, _ in rows),
        "ratio": [med(ratios), min(ratios), max(ratios)],
        "overlap": [
            100 * med(s.overlap for s, *_ in rows),
            100 * med(m["overlap"] for _, _, m, _ in rows),
        ],
        "points": [med(points), min(points), max(points)],
        "terms": {
            k: [1e3 * med(_term(s, k) for s, *_ in rows), 1e3 * med(m[k] for *_, m, _ in rows)]
            for k in ("forward_s", "backward_s", "exposed_s", "comm_s")
        },
        "last_sim": sim,
    }


def table(rows: list[dict], where: str) -> str:
    lines = [
        f"| workload ({where}) | same buckets | slowdown | predicted step (ms) | without slowdown "
        "| measured step (ms) | predicted / measured, median (min-max) | overlap predicted / "
        "measured (%) | points, median (min-max) | forward, backward, exposed, link time (ms): "
        "predicted / measured | ranks' backward ends apart (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ra, pt, ov = r["ratio"], r["points"], r["overlap"]
        terms = ", ".join(f"{p:.1f} / {m:.1f}" for p, m in r["terms"].values())
        ok = "yes" if abs(ra[0] - 1) <= 0.15 and abs(pt[0]) <= 10 else "no"
        lines.append(
            f"| {r['name']} | {'yes' if r['same_buckets'] else 'no'} | x{r['slowdown']:.2f} | "
            f"{r['predicted_ms']:.1f} | {r['no_slowdown_ms']:.1f} | {r['measured_ms']:.1f} | "
            f"{ra[0]:.2f} ({ra[1]:.2f}-{ra[2]:.2f}) {ok} | {ov[0]:.0f} / {ov[1]:.0f} | "
            f"{pt[0]:+.0f} ({pt[1]:+.0f} to {pt[2]:+.0f}) | {terms} | {r['skew_ms']:.0f} |"
        )
    return "\n".join(lines)


def two_nodes(args: argparse.Namespace, out: Path) -> list[dict]:
    """Run the worker on 2 network namespaces x 2 processes over a `--rate` veth link."""
    from lockstep.testing.netns import two_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot run on two nodes here: {reason}")
    flags = ["--workloads", args.workloads, "--reps", str(args.reps), "--steps", str(args.steps)]
    flags += ["--warmup", str(args.warmup), "--out", str(out)]
    with two_hosts(rate=args.rate) as (a, b):
        procs = []
        for node, host in enumerate((a, b)):
            argv = [
                sys.executable,
                "-m",
                "lockstep.cli",
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--master-addr",
                a.address,
                "--master-port",
                str(PORT),
                "--nproc-per-node",
                "2",
                WORKER,
                *flags,
            ]
            log = open(out / f"node{node}.log", "w")  # noqa: SIM115  closed with the process
            procs.append((host.popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + TIMEOUT_S
        for proc, log in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
                log.close()
    if not (out / "done.json").exists():
        logs = "\n".join((out / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
        raise SystemExit(f"the two-node run failed:\n{logs}")
    return torch.load(out / "result.pt", weights_only=False)


def draw(results: list[dict], rows: list[dict], args: argparse.Namespace, trace_dir: str) -> None:
    """The small GPT's measured step (rank 0) and its prediction, drawn by the same code."""
    out = Path(args.timeline_dir)
    row = next(r for r in rows if r["name"] == args.trace_workload)
    measured = plot_timeline(Path(trace_dir) / "trace_rank0.json", out / "plan_measured_gpt.png", 1)
    predicted, _ = write_predicted(row["last_sim"], out / "plan_predicted_gpt.png")
    print(f"\ntimelines: {measured} (measured, rank 0), {predicted} (predicted)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1, choices=[1, 2])
    parser.add_argument("--rate", default="1gbit", help="the veth rate with --nodes 2 (tc)")
    parser.add_argument("--timeline-dir", default=None, help="draw the small GPT's PNGs here")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    names = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if args.nodes == 2:
            results, where = two_nodes(args, Path(tmp)), f"2 nodes x 2, {args.rate} veth"
        else:
            args.trace_dir = tmp if args.timeline_dir else None
            results = run_ranks(
                measure, args.world_size, names, args, deadline_s=TIMEOUT_S, timeout_s=300
            )
            where = f"world size {args.world_size}, loopback"
        rows = [summarize(results, name) for name in names]
        print(table(rows, where))
        if args.timeline_dir and args.nodes == 1:
            draw(results, rows, args, tmp)
    if args.json:
        keep = [{k: v for k, v in r.items() if k != "last_sim"} for r in rows]
        args.json.write_text(json.dumps(keep, indent=1))


if __name__ == "__main__":
    main()
