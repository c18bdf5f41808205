"""What `--live-recovery` costs while nothing fails: step time with the flag against without.

    python benchmarks/live_cost.py                        # widths 256, 1024, 2048; 2 rounds
    python benchmarks/live_cost.py --widths 512,4096 --rounds 3 --steps 40
    python benchmarks/live_cost.py --batchnorm            # buffers broadcast at each forward

In live mode each rank keeps a copy of every bucket's local gradients when it
launches it (`LiveSteps.keep`: one clone, one more gradient-sized buffer) and posts
its random-number state to the launcher's store after each step; with `--batchnorm`
each broadcast's buffers are copied, and rank 0 posts its buffers to the store after
each forward (`live/buffers.py`). One node x 2,
`lockstep run` of benchmarks/live_cost_worker.py, the two settings alternating
(off/on, then on/off) for `--rounds` rounds per width. Reported: rank 0's median
step over all rounds (the first 5 steps of each run left out), the ratio on / off,
and the memory the copies take (4 bytes per parameter).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = str(Path(__file__).with_name("live_cost_worker.py"))
WARMUP = 5


def run(out: Path, live: bool, width: int, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "lockstep.cli", "run", "--nproc-per-node", "2"]
    argv += ["--live-recovery"] if live else []
    argv += [WORKER, "--width", str(width), "--layers", str(args.layers)]
    argv += ["--steps", str(args.steps), "--out", str(out)]
    argv += ["--batchnorm"] if args.batchnorm else []
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="256,1024,2048")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batchnorm", action="store_true")
    args = parser.parse_args()
    print(
        "| params | buffers (KB) | copies kept (MB) | step, off (ms) "
        "| step, --live-recovery (ms) | on / off |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for width in (int(w) for w in args.widths.split(",")):
            steps: dict[bool, list[float]] = {False: [], True: []}
            params = buffers = 0
            for index in range(args.rounds):
                for live in (False, True) if index % 2 == 0 else (True, False):
                    out = Path(tmp) / f"{width}-{index}-{int(live)}.json"
                    got = run(out, live, width, args)
                    steps[live] += got["seconds"][WARMUP:]
                    params, buffers = got["params"], got["buffer_bytes"]
            off, on = (statistics.median(steps[live]) * 1e3 for live in (False, True))
            print(
                f"| {params / 1e6:.2f} M | {buffers / 1e3:.1f} | {params * 4 / 1e6:.1f} "
                f"| {off:.2f} | {on:.2f} "
                f"| {on / off:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
