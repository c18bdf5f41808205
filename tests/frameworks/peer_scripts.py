"""`make frameworks`: Accelerate's own distributed test scripts, on torch's engine and lockstep's.

    PYTHONPATH=src python tests/frameworks/peer_scripts.py [--scripts test_sync ...] [--out DIR]

Code nobody here wrote, as a held-out check: each script that ships in the installed
accelerate package (`accelerate/test_utils/scripts/`) runs twice under torchrun with
2 CPU processes (`ACCELERATE_USE_CPU=1`, gloo), once as it is (torch's engine) and
once with `-m lockstep.adopt` (lockstep's), one run after the other. The table says
which pass with both, fail with both, or differ, whether lockstep's engine was built
(rank 0's line; "no DDP": the script builds none), the seconds of each run, and the
first error; each run's output is kept under DIR. Exits 1 when a script passes with
torch's engine and fails with lockstep's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Those that run on 2 CPU processes. Left out by default (pass --scripts to run them):
# test_distributed_data_loop hangs with both engines at "joining uneven inputs" (Accelerate
# makes join_uneven_inputs a no-op without GPUs, so rank 0 waits for rank 1's missing
# batch); external_deps/test_checkpointing needs the `evaluate` package.
SCRIPTS = ("test_sync", "test_script", "test_ops", "test_ddp_comm_hook")
ANNOUNCED = "built lockstep's engine on all 2 ranks"  # rank 0's line (adopt/torch_face.py)
ENGINES = {"torch": [], "lockstep": ["-m", "lockstep.adopt"]}


def scripts_folder() -> Path:
    import accelerate

    return Path(accelerate.__file__).parent / "test_utils" / "scripts"


def run_script(script: str, engine: str, out: Path, timeout_s: int) -> tuple[int, float, str]:
    """One torchrun launch; returns its exit code (124: timed out), seconds, and output."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    argv += [*ENGINES[engine], str(scripts_folder() / f"{script}.py")]
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    env.pop("LOCKSTEP_ENGINE", None)  # each run says its engine by its command alone
    log = out / f"{script.replace('/', '_')}.{engine}.log"
    workdir = out / "cwd" / f"{script.replace('/', '_')}.{engine}"  # files the script writes
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as fp:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=fp, stderr=fp)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its workers on SIGTERM (SIGKILL would orphan them)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = 124
    return code, time.perf_counter() - start, log.read_text()


def last_error(text: str) -> str:
    """The first exception line a rank printed (`[rankN]: SomeError: ...`), or ''."""
    for line in text.splitlines():
        body = line.split("]: ", 1)[-1]
        head = body.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return body[:160]
    return ""


def verdict(codes: dict[str, int]) -> str:
    if codes["torch"] == 0 and codes["lockstep"] == 0:
        return "pass with both"
    if codes["torch"] != 0 and codes["lockstep"] != 0:
        return "fail with both"
    return "DIFFER"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="*", default=list(SCRIPTS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "frameworks")
    parser.add_argument("--timeout-s", type=int, default=300, help="per launch")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, regressions = [], []
    for script in args.scripts:
        runs = {engine: run_script(script, engine, args.out, args.timeout_s) for engine in ENGINES}
        codes = {engine: code for engine, (code, _, _) in runs.items()}
        seconds = " / ".join(f"{s:.0f}" for _, s, _ in runs.values())
        ours = "yes" if ANNOUNCED in runs["lockstep"][2] else "no DDP"
        error = last_error(runs["lockstep"][2]) or last_error(runs["torch"][2])
        if 124 in codes.values():
            error = f"timed out after {args.timeout_s} s; {error}"
        rows.append(f"{script:28} {verdict(codes):15} {ours:>8} {seconds:>9}  {error}")
        if codes["torch"] == 0 and codes["lockstep"] != 0:
            regressions.append(script)
        print(rows[-1], flush=True)
    print(f"\n{'script':28} {'result':15} {'lockstep':>8} {'seconds':>9}  first error")
    print("\n".join(rows))
    print(f"\nlogs: {args.out}")
    if regressions:
        raise SystemExit(f"pass with torch's engine, fail with lockstep's: {regressions}")


if __name__ == "__main__":
    main()
