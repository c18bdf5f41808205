"""A script that trains, then keeps its process alive after it ended: the exit watch's case.

    lockstep run --exit-grace 2 --nproc-per-node 2 tests/launch/train_exit_blocks.py --block thread

`--block thread` leaves a thread that is not a daemon and never ends; `--block atexit`
registers an exit handler that never returns; `--late-rank R` ends rank R's script
1.5 s after the others, so it is still inside its grace when the watch ends them.
Both blocks run after the script's last line, so its result (exit code 0, or 1 with
`--fail-rank R`) is known before the block.
"""

from __future__ import annotations

import argparse
import atexit
import threading
import time

import torch
from torch import nn

import lockstep


def block_forever() -> None:
    while True:
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", choices=["thread", "atexit"], required=True)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--late-rank", type=int, default=-1, help="ends its script 1.5 s late")
    args = parser.parse_args()
    ctx = lockstep.init()
    model = lockstep.DistributedDataParallel(nn.Linear(4, 1))
    model(torch.ones(2, 4)).sum().backward()
    if args.block == "thread":
        threading.Thread(target=block_forever, name="never-ends", daemon=False).start()
    else:
        atexit.register(block_forever)
    if ctx.rank == args.fail_rank:
        raise RuntimeError(f"rank {ctx.rank} failed on purpose")
    lockstep.shutdown()
    if ctx.rank == args.late_rank:
        time.sleep(1.5)  # still inside its grace when the watch ends the other rank


if __name__ == "__main__":
    main()
