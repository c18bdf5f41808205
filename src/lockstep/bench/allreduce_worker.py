"""One worker of `lockstep bench allreduce`: time all-reduce over a size sweep, as training would.

`lockstep bench allreduce` starts this module on every worker through lockstep's
launcher, exactly as `lockstep run -m lockstep.bench.allreduce_worker` does (use
that form for several nodes: `lockstep run --nnodes 2 ... -m
lockstep.bench.allreduce_worker --json bw.json`). Each worker joins the group with
`lockstep.init()`, warms up, times `iters` back-to-back all-reduces per size, and
takes the slowest rank's mean; rank 0 prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import lockstep
from lockstep.bench.slowdown import measure_slowdown
from lockstep.bench.sweep import Row, format_table, make_row, result_json, sweep_sizes
from lockstep.bench.timing import back_to_back_seconds
from lockstep.plan.units import parse_bytes, parse_dtype

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class SweepOptions:
    """What to sweep. Validated on construction.

    Attributes:
        sizes: message sizes in bytes, smallest first.
        dtype: label of the element type (fp32, fp16, bf16).
        iters: timed all-reduces per size.
        warmup: untimed all-reduces per size before them.
        json_path: where rank 0 writes the result, or None.
        backend: "gloo", "nccl", or None for lockstep's default.
    """

    sizes: tuple[int, ...]
    dtype: str
    iters: int
    warmup: int
    json_path: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise ValueError(f"--iters must be at least 1; found {self.iters}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be at least 0; found {self.warmup}")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(
                f"--dtype expects one of {', '.join(TORCH_DTYPES)}; found {self.dtype}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


def add_sweep_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by `lockstep bench allreduce` and this worker."""
    add = parser.add_argument
    add(
        "--min-bytes", default="4KiB", help="smallest message (default 4KiB; 4096 and 4KB work too)"
    )
    add("--max-bytes", default="256MiB", help="largest message (default 256MiB)")
    add("--factor", type=int, default=2, help="each size is this many times the last")
    add("--iters", type=int, default=20, help="timed all-reduces per size (default 20)")
    add("--warmup", type=int, default=5, help="untimed all-reduces per size first (default 5)")
    add("--dtype", default="fp32", help=f"element type: {', '.join(TORCH_DTYPES)}")
    add("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl on GPU")
    add("--json", default=None, metavar="FILE", help="write the result for `lockstep plan`")


def sweep_options(ns: argparse.Namespace) -> SweepOptions:
    """Validate the flags; raises ValueError naming the flag."""
    dtype = parse_dtype(ns.dtype, "--dtype").label
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"--dtype expects one of {', '.join(TORCH_DTYPES)}; found {ns.dtype!r}")
    if ns.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs CUDA devices and none are visible; use gloo")
    element_size = torch.tensor([], dtype=TORCH_DTYPES[dtype]).element_size()
    sizes = sweep_sizes(
        parse_bytes(ns.min_bytes, "--min-bytes", unit_required=False),
        parse_bytes(ns.max_bytes, "--max-bytes", unit_required=False),
        ns.factor,
        element_size,
    )
    return SweepOptions(tuple(sizes), dtype, ns.iters, ns.warmup, ns.json, ns.backend)


def time_allreduce(tensor: torch.Tensor, iters: int, warmup: int) -> float:
    """Mean seconds per all-reduce of `tensor` on the slowest rank."""
    return back_to_back_seconds(lambda: dist.all_reduce(tensor), iters, warmup, tensor.device)


def count_wrong(tensor: torch.Tensor, rank: int, world_size: int) -> int:
    """All-reduce rank+1 once and count the elements that differ from 1 + 2 + ... + N."""
    tensor.fill_(rank + 1)
    dist.all_reduce(tensor)
    expected = world_size * (world_size + 1) / 2
    return int((tensor != expected).sum().item())


def run_sweep(ctx: lockstep.DistContext, opts: SweepOptions) -> list[Row]:
    """Time every size of the sweep; the same rows come back on every rank."""
    rows = []
    for size in opts.sizes:
        element_size = torch.tensor([], dtype=opts.torch_dtype).element_size()
        # Zeros stay zeros however often they are summed: no overflow over many iterations.
        tensor = torch.zeros(size // element_size, dtype=opts.torch_dtype, device=ctx.device)
        seconds = time_allreduce(tensor, opts.iters, opts.warmup)
        wrong = count_wrong(tensor, ctx.rank, ctx.world_size)
        rows.append(make_row(size, element_size, opts.dtype, seconds, ctx.world_size, wrong))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lockstep.bench.allreduce_worker")
    add_sweep_flags(parser)
    opts = sweep_options(parser.parse_args(argv))
    ctx = lockstep.init(backend=opts.backend)
    try:
        rows = run_sweep(ctx, opts)
        slowdown = measure_slowdown(ctx.device, opts.iters, opts.warmup)
    finally:
        lockstep.shutdown()
    if ctx.is_main:
        meta = {
            "nodes": ctx.num_nodes,
            "backend": ctx.backend,
            "device": ctx.device.type,
            "dtype": opts.dtype,
            "iters": opts.iters,
            "warmup": opts.warmup,
        }
        doc = result_json(rows, ctx.world_size, meta)
        doc["overlap_slowdown"] = slowdown
        print(
            f"# lockstep bench allreduce: world size {ctx.world_size}, {ctx.backend}, "
            f"{ctx.device.type}, {opts.iters} iterations per size",
            flush=True,
        )
        print(format_table(rows, doc), flush=True)
        print(
            f"# Slowdown if computing : x{slowdown['factor']:.2f} at 4 MiB (all-reduce while "
            "every rank computes, against idle; read by `lockstep plan --profile`)",
            flush=True,
        )
        if opts.json_path:
            with open(opts.json_path, "w") as fp:
                json.dump(doc, fp, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
