"""Checkpoint formats side by side: lockstep's single file against DCP, stage 3 at world size 2.

    PYTHONPATH=src python benchmarks/checkpoint_formats.py --width 512 --layers 4 --repeats 5

A TinyGPT-shaped model (tests/dist/sharded_cases.py's blocks, `--width`, `--layers`)
is wrapped by lockstep stage 3 with AdamW state, then saved and restored through
`Checkpointer(format="lockstep")` and `Checkpointer(format="dcp")`, alternating,
`--repeats` times each. Prints the median save and restore time, and the bytes each
rank wrote (the single file: rank 0 writes everything it gathered; DCP: each rank its
own pieces). Real gloo ranks over loopback, CPU; a shared machine adds noise.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "dist"))
from sharded_cases import Block, TinyGPT

import lockstep
from lockstep.testing import run_ranks


def _run(ctx, root: str, width: int, layers: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = lockstep.ShardedDataParallel(TinyGPT(width=width, layers=layers), stage=3, wrap=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 32, (4, 9))
    model(idx[:, :-1]).sum().backward()
    opt.step()
    times: dict[str, list[float]] = {}
    written: dict[str, int] = {}
    for i in range(repeats):
        for fmt in ("lockstep", "dcp"):
            directory = f"{root}/{fmt}"
            checkpointer = lockstep.Checkpointer(directory, format=fmt, keep=1)
            start = time.perf_counter()
            path = checkpointer.save(i, model=model, optimizer=opt)
            times.setdefault(f"{fmt} save", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpointer.restore(model=model, optimizer=opt)
            times.setdefault(f"{fmt} restore", []).append(time.perf_counter() - start)
            mine = [path] if fmt == "lockstep" else list(path.glob(f"__{ctx.rank}_*.distcp"))
            written[fmt] = (
                sum(p.stat().st_size for p in mine if p.is_file())
                if (fmt == "dcp" or ctx.rank == 0)
                else 0
            )
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "written": written}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="lockstep-ckpt-bench-")
    try:
        results = run_ranks(
            _run, 2, root, args.width, args.layers, args.repeats, deadline_s=600, timeout_s=120
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in TinyGPT(width=args.width, layers=args.layers).parameters())
    print(f"TinyGPT width {args.width}, {args.layers} layers: {params:,} parameters, AdamW")
    print("| format | save (s) | restore (s) | bytes written by rank 0 | by rank 1 |")
    print("|---|---|---|---|---|")
    for fmt in ("lockstep", "dcp"):
        t = results[0]["times"]
        w0, w1 = results[0]["written"][fmt], results[1]["written"][fmt]
        print(f"| {fmt} | {t[f'{fmt} save']:.3f} | {t[f'{fmt} restore']:.3f} | {w0:,} | {w1:,} |")


if __name__ == "__main__":
    main()
