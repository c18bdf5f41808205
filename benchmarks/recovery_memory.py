"""What a fork server and a spare cost in memory, and what their replacements cost as workers.

    python benchmarks/recovery_memory.py            # two runs of one node x 2, ~1 min each

Run 1, `lockstep run --live-recovery` (the fork server): rank 1 SIGKILLs itself at
step KILL_STEP and a child of the fork server takes its place. Run 2, `--spares 1`:
a spare takes it, and a new idle spare is started after the recovery. In each run,
SETTLE_S after the recovery, /proc/PID/smaps_rollup of every process of interest is
read: RSS (resident), PSS (proportional: each shared page divided among the processes
that map it) and USS (pages private to the process: what ending it would free).
Printed as a markdown table, in MiB.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
STEPS, KILL_STEP = 1_000_000, 30
SETTLE_S = 15.0  # after the recovery: the refilled spare imports, the new worker steps
TIMEOUT_S = 240
FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty")


def rollup(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of `pid` in MiB (smaps_rollup's kB)."""
    found = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in FIELDS:
            found[name] = int(rest.split()[0]) / 1024
    uss = found["Private_Clean"] + found["Private_Dirty"]
    return {"rss": found["Rss"], "pss": found["Pss"], "uss": uss}


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen) -> re.Match:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit(f"expected {pattern!r} in {log}; see it")


def one_run(out: Path, flags: list[str]) -> dict[str, dict[str, float]]:
    """The processes of one killed run, by role, with their memory."""
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "lockstep.cli", "run", "--nproc-per-node", "2", *flags]
    argv += [str(HERE / "recovery_train.py"), "--out", str(out), "--steps", str(STEPS)]
    argv += ["--save-every", "1000000"]
    env = {**os.environ, "RECOVERY_KILL": f"1:{KILL_STEP}"}
    log = out / "launcher.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        started = _wait_for(log, r"started pid (\d+) as rank 1, generation 1", proc)
        _wait_for(log, r"generation 1 formed", proc)
        time.sleep(SETTLE_S)
        text = log.read_text(errors="replace")
        events = (out / "events.jsonl").read_text().splitlines()
        survivor = next(json.loads(e)["pid"] for e in events if json.loads(e)["rank"] == 0)
        roles = {"rank 0, started by torch's agent": survivor}
        replacement = int(started.group(1))
        server = re.search(r"fork server pid (\d+) started", text)
        if server:
            roles["fork server, idle"] = int(server.group(1))
        spares = [int(pid) for pid in re.findall(r"spare pid (\d+) started", text)]
        took = "spare" if replacement in spares else "fork server's child"
        roles[f"rank 1, replacement ({took})"] = replacement
        if len(spares) > 1:
            roles["spare, idle (refilled)"] = spares[-1]
        return {role: rollup(pid) for role, pid in roles.items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="recovery-memory-"))
    rows = {}
    runs = {"fork server": ["--live-recovery"], "spare": ["--live-recovery", "--spares", "1"]}
    for name, flags in runs.items():
        for role, got in one_run(root / name.replace(" ", "_"), flags).items():
            rows[f"{role} [{name} run]"] = got
            print(role, name, got, flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}; files in {root}")
    print("| process | RSS (MiB) | PSS (MiB) | USS, private (MiB) |\n|---|---|---|---|")
    for role, got in rows.items():
        print(f"| {role} | {got['rss']:.0f} | {got['pss']:.0f} | {got['uss']:.0f} |")


if __name__ == "__main__":
    main()
