"""`make compat`: torch's DDP test suite with torch's class, then with lockstep's, side by side.

    PYTHONPATH=src python tests/compat/compare.py [--select ddp] [--out runs/compat]

Runs `torch_suite.py` once per class (each in its own process, one after the
other), then prints passed / failed / skipped per class, every test that passes
with torch's class but not with lockstep's (with rank 0's exception on one
line), the tests excused as torch-internal (`suite_lists.EXCLUDED`), and whether
`suite_lists.BEHAVIOUR_SUBSET` (what `make test` runs) still matches the
measurement. By default every test of the class; `--select ddp` only those that
build a DDP wrapper. Exits 1 when a test passes with torch's class and fails with
lockstep's outside the excused ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from suite_lists import BEHAVIOUR_SUBSET, EXCLUDED  # noqa: E402

Records = dict[str, dict[str, object]]
OUTCOMES = ("passed", "failed", "skipped")


def run_class(ddp: str, out: Path, select: str, timeout_s: int) -> tuple[Records, float]:
    """Run the suite with one class in a child process; return its records and seconds."""
    json_path = out / f"{ddp}.json"
    cmd = [sys.executable, str(HERE / "torch_suite.py"), "--ddp", ddp, "--json", str(json_path)]
    cmd += ["--select", select]
    src = str(HERE.parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    with open(out / f"{ddp}.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=log, timeout=timeout_s, check=False)
    seconds = time.perf_counter() - start
    if not json_path.exists():
        raise SystemExit(f"the {ddp} run wrote no results; see {out / (ddp + '.log')}")
    return json.loads(json_path.read_text()), seconds


def counts_table(runs: dict[str, tuple[Records, float]]) -> list[str]:
    counts = {
        ddp: Counter(r["outcome"] for r in records.values()) for ddp, (records, _) in runs.items()
    }
    lines = [f"{'':10}" + "".join(f"{ddp:>10}" for ddp in runs)]
    for outcome in OUTCOMES:
        lines.append(f"{outcome:10}" + "".join(f"{counts[ddp][outcome]:>10}" for ddp in runs))
    lines.append(f"{'seconds':10}" + "".join(f"{s:>10.0f}" for _, s in runs.values()))
    return lines


def regressions(torch_runs: Records, lockstep_runs: Records) -> dict[str, str]:
    """Tests that pass with torch's class and do not pass with lockstep's: name -> reason."""
    return {
        name: f"{lockstep_runs[name]['outcome']}: {lockstep_runs[name]['reason']}"
        for name, record in sorted(torch_runs.items())
        if record["outcome"] == "passed" and lockstep_runs[name]["outcome"] != "passed"
    }


def report(runs: dict[str, tuple[Records, float]], select: str) -> int:
    torch_runs, lockstep_runs = runs["torch"][0], runs["lockstep"][0]
    scope = "every test" if select == "all" else "the tests that build a DDP wrapper"
    print(
        f"torch's DDP test suite (DistributedTest._DistTestBase), "
        f"{os.environ.get('BACKEND', 'gloo')}, world size 2: {scope}"
    )
    print(*counts_table(runs), sep="\n")
    lost = regressions(torch_runs, lockstep_runs)
    unexcused = {k: v for k, v in lost.items() if k not in EXCLUDED}
    print(f"\npass with torch's class, not with lockstep's ({len(unexcused)}):")
    for name, reason in unexcused.items():
        print(f"  {name}: {reason}")
    print(f"\nexcused: they read torch's private internals ({len(EXCLUDED)}):")
    for name, reason in EXCLUDED.items():
        print(f"  {name} [{lockstep_runs.get(name, {}).get('outcome', 'not run')}]: {reason}")
    gained = [
        n for n, r in lockstep_runs.items() if r["outcome"] == "passed" != torch_runs[n]["outcome"]
    ]
    if gained:
        print(f"\npass with lockstep's class only: {gained}")
    measured = {n for n, r in torch_runs.items() if r["outcome"] == "passed"} - set(EXCLUDED)
    measured = {n for n in measured if n in BEHAVIOUR_SUBSET or _builds_wrapper(n)}
    if measured != set(BEHAVIOUR_SUBSET):
        print(
            "\nnote: suite_lists.BEHAVIOUR_SUBSET differs from this measurement: "
            f"missing {sorted(measured - set(BEHAVIOUR_SUBSET))}, "
            f"extra {sorted(set(BEHAVIOUR_SUBSET) - measured)}"
        )
    return 1 if unexcused else 0


def _builds_wrapper(name: str) -> bool:
    from torch_suite import uses_ddp

    return uses_ddp(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--select", choices=("all", "ddp"), default="all")
    parser.add_argument("--out", type=Path, default=Path("runs/compat"))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per class")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {
        ddp: run_class(ddp, args.out, args.select, args.timeout) for ddp in ("torch", "lockstep")
    }
    sys.exit(report(runs, args.select))


if __name__ == "__main__":
    main()
