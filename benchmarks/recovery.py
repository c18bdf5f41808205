"""A lost worker or node: every recovery mode in every setup, side by side, one table.

    python benchmarks/recovery.py                                 # every setup, every mode
    python benchmarks/recovery.py --setups "one node x 2" --modes "live,restart,torchft manual"
    python benchmarks/recovery.py --repeats 3 --out /tmp/recovery

A setup (SETUPS) says where the job runs and what is killed; a mode (MODES) says how
it recovers: `lockstep run` flags ("live": the fork server's child takes the rank;
"live (no fork server)": a new process; "live + 1 spare": a standby process), or
torchft's own job. Each is one table entry, so a new mode is one line.
benchmarks/recovery_train.py (DDP, Adam, dropout, a checkpoint every 10 steps) runs
once uninterrupted per setup (the oracle), then once per mode and repeat, interleaved,
with the victim killed inside backward of step 13:
- one node x 2: rank 1 SIGKILLs itself;
- two nodes x 2: two network namespaces (root), rank 3 (on node 1) SIGKILLs itself;
- lost node: rank 3 holds at that point, every process of node 1's namespace (its
  launcher too) is SIGKILLed and `lockstep run --node-rank 1` is started again.
Columns: recovery_measure.py. A mode the launcher refuses (exit 2 before any step)
is reported as `refused: <its reason>`, and is not tried again in later repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from recovery_jobs import run_one_node, run_torchft, run_two_nodes
from recovery_measure import measure

from lockstep.testing.netns import unavailable_reason


@dataclass(frozen=True)
class Setup:
    """Where the job runs (`nodes` x 2 workers) and what is killed (rank `victim`, its node)."""

    nodes: int
    victim: int
    lose_node: bool = False

    @property
    def world(self) -> int:
        return 2 * self.nodes


@dataclass(frozen=True)
class Mode:
    """How the job recovers: launcher flags, and which job runs them."""

    flags: tuple[str, ...] = ()
    torchft: bool = False
    setups: tuple[str, ...] = field(default=())  # empty: every setup


SETUPS = {
    "one node x 2": Setup(nodes=1, victim=1),
    "two nodes x 2": Setup(nodes=2, victim=3),
    "lost node": Setup(nodes=2, victim=3, lose_node=True),
}
MODES = {
    "live": Mode(("--live-recovery",)),  # a child of the node's fork server takes the rank
    "live (no fork server)": Mode(("--live-recovery", "--no-fork-server")),  # a new process
    "live + 1 spare": Mode(("--live-recovery", "--spares", "1")),
    "live + 1 spare (no fork server)": Mode(
        ("--live-recovery", "--spares", "1", "--no-fork-server")
    ),
    "restart": Mode(("--max-restarts", "1")),
    "torchft": Mode(("--wrapper", "ddp"), torchft=True, setups=("one node x 2",)),
    "torchft manual": Mode(("--wrapper", "manual"), torchft=True, setups=("one node x 2",)),
    # A survivor that no longer waits finishes alone unless the steps last: 0.5 s each.
    "torchft manual 1s heartbeat": Mode(
        ("--wrapper", "manual", "--heartbeat-ms", "1000", "--step-sleep", "0.5"),
        torchft=True,
        setups=("one node x 2",),
    ),
}


def runner(setup: Setup, mode: Mode) -> Callable[[Path, list[str], int, str], str | None]:
    """The function that runs `mode`'s job in `setup` (see recovery_jobs.py)."""
    if mode.torchft:
        return run_torchft
    if setup.nodes == 1:
        return run_one_node
    return lambda out, flags, steps, kill: run_two_nodes(out, flags, steps, kill, setup.lose_node)


class Bench:
    """Runs the chosen entries, keeps one oracle per (setup, job kind) and every result."""

    def __init__(self, root: Path, steps: int, kill_step: int):
        self.root, self.steps, self.kill_step = root, steps, kill_step
        self.oracles: dict[tuple, Path] = {}
        self.results: dict[tuple[str, str], list[dict] | str] = {}

    def oracle(self, name: str, setup: Setup, mode: Mode) -> Path:
        # lockstep's flags and the lighthouse's heartbeat change no numerics
        flags = list(mode.flags[:2]) if mode.torchft else []
        key = (name, mode.torchft, *flags)
        if key not in self.oracles:
            out = self.root / f"oracle-{len(self.oracles)}"
            runner(setup, mode)(out, flags, self.steps, "")
            self.oracles[key] = out
        return self.oracles[key]

    def once(self, name: str, mode_name: str, repeat: int) -> None:
        setup, mode = SETUPS[name], MODES[mode_name]
        if isinstance(self.results.get((name, mode_name)), str):
            return  # refused or skipped: not tried again
        out = self.root / f"{name}-{mode_name}-{repeat}".replace(" ", "_")
        kill = f"{setup.victim}:{self.kill_step}"
        refused = runner(setup, mode)(out, list(mode.flags), self.steps, kill)
        if refused:
            self.results[name, mode_name] = f"refused: {refused}"
            print(name, "|", mode_name, "| refused:", refused, flush=True)
            return
        got = measure(out, self.oracle(name, setup, mode), self.steps, setup.world)
        got["load"] = os.getloadavg()[0]  # the machine may be shared: say how busy it was
        self.results.setdefault((name, mode_name), []).append(got)  # type: ignore[union-attr]
        print(name, "|", mode_name, repeat, got, flush=True)


def row(setup: str, mode: str, runs: list[dict] | str) -> str:
    """One line of the markdown table."""
    if isinstance(runs, str):
        return f"| {setup} | {mode} | {runs} | | | | | |"
    rec, still = [r["recovery_s"] for r in runs], [r["still_s"] for r in runs]
    each = ", ".join(f"{v:.2f}" for v in rec)
    redo = ", ".join(map(str, sorted({int(r["recomputed"]) for r in runs})))
    lost = ", ".join(sorted({f"{int(r['lost'])} / {int(r['repeated'])}" for r in runs}))
    alone = ", ".join(map(str, sorted({int(r["alone"]) for r in runs})))
    same = sum(int(r["bitwise"]) for r in runs)
    return (
        f"| {setup} | {mode} | median {statistics.median(rec):.2f} ({each}) "
        f"| median {statistics.median(still):.2f} | {redo} | {lost} | {alone} "
        f"| {same}/{len(runs)} |"
    )


HEADER = (
    "| setup | mode | kill to first step after it (s) | survivors stood still (s) | steps "
    "computed again | samples lost / repeated | steps at part of the global batch "
    "| bitwise equal to the uninterrupted run |\n|---|---|---|---|---|---|---|---|"
)


def chosen(text: str | None, table: dict) -> list[str]:
    names = list(table) if not text else [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in table]
    if unknown:
        raise SystemExit(f"unknown {unknown}; expected some of {list(table)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default=None, help=f"comma-separated, of {list(SETUPS)}")
    parser.add_argument("--modes", default=None, help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=13)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="recovery-"))
    bench = Bench(root, args.steps, args.kill_step)
    setups, modes = chosen(args.setups, SETUPS), chosen(args.modes, MODES)
    cells = [(s, m) for s in setups for m in modes if not MODES[m].setups or s in MODES[m].setups]
    no_netns = unavailable_reason()
    for setup, mode in cells:
        if SETUPS[setup].nodes > 1 and no_netns:
            bench.results[setup, mode] = f"skipped: {no_netns}"
    for repeat in range(args.repeats):
        for setup, mode in cells:
            bench.once(setup, mode, repeat)
    (bench.root / "recovery.json").write_text(
        json.dumps({f"{s} | {m}": v for (s, m), v in bench.results.items()}, indent=1)
    )
    print(HEADER)
    print("\n".join(row(s, m, bench.results[s, m]) for s, m in cells))
    loads = [r["load"] for runs in bench.results.values() if isinstance(runs, list) for r in runs]
    if loads:
        print(f"load average (1 min) at the end of each run: {min(loads):.1f} to {max(loads):.1f}")


if __name__ == "__main__":
    main()
