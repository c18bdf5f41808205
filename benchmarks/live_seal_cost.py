"""What sealing live recovery's per-step posts costs: CPU time per post, sealed against plain.

    python benchmarks/live_seal_cost.py                  # 2000 posts of each kind
    python benchmarks/live_seal_cost.py --posts 5000 --buffers 4096

Under `--live-recovery` every rank posts its random state (`keys.RNG`, about 8 KB
packed) to the worker store in every synchronised step, and rank 0 its broadcast
buffers (`keys.BUFFERS`) after every synchronised forward. Both are sealed
(`live/sealed.py`: one HMAC-SHA256 pass over the packed bytes). This times, in one
process against a real TCPStore on loopback, a post as it was (pack, set) and as it
is (pack, seal, set), interleaved, and reports the median CPU time (process time,
so that other load on the machine counts less) of each and the difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from lockstep.checkpoint import rng
from lockstep.live import sealed, wire


def _timed(post) -> float:
    start = time.process_time_ns()
    post()
    return (time.process_time_ns() - start) / 1e3  # microseconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--posts", type=int, default=2000)
    parser.add_argument("--buffers", type=int, default=1024, help="BatchNorm channels posted")
    args = parser.parse_args()
    os.environ.setdefault(sealed.SECRET_VARIABLE, "a-secret-for-this-benchmark-only")
    os.environ.update(sealed.variables("benchmark", 0))
    timeout = timedelta(seconds=10)
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    store = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
    buffers = {"running_mean": torch.zeros(args.buffers), "running_var": torch.ones(args.buffers)}
    kinds = {
        "random state (RNG)": (
            "lockstep/live/rng/0/1",
            lambda: {"step": 1, "state": rng.capture()},
        ),
        "buffers (BUFFERS)": ("lockstep/live/buffers0/1", lambda: (1, buffers)),
    }
    for name, (key, value) in kinds.items():
        plain, sealed_posts = [], []
        for _ in range(args.posts):
            plain.append(_timed(lambda: store.set(key, wire.pack(value()))))  # noqa: B023
            sealed_posts.append(_timed(lambda: sealed.put_bytes(store, key, wire.pack(value()))))  # noqa: B023
        size = len(wire.pack(value()))
        before, after = statistics.median(plain), statistics.median(sealed_posts)
        print(
            f"{name}: {size} bytes packed; CPU per post {before:.1f} us plain, {after:.1f} us "
            f"sealed (+{after - before:.1f} us, {after / before:.2f}x), median of {args.posts}"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
