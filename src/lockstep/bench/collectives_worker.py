"""One worker of `lockstep bench collectives`: time each algorithm beside native, interleaved.

Started on every worker by `lockstep bench collectives`, or directly for several
nodes: `lockstep run --nnodes 2 ... -m lockstep.bench.collectives_worker --sizes 25MB`.
Per size, each round calls every algorithm once (the order rotates each round),
each call behind a barrier; a call's time is the slowest rank's, and the table
reports the median over rounds. Buffers start at zero, so repeated sums cannot
overflow; afterwards one call on known data counts the wrong elements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import lockstep
from lockstep import collectives as lc
from lockstep.bench.collectives import BenchOptions, Collective, add_bench_flags, bench_options
from lockstep.bench.collectives import bus_factor as _bus_factor
from lockstep.bench.timing import per_call_seconds
from lockstep.collectives.torch_compat import all_gather_single, reduce_scatter_single

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Row:
    """One algorithm at one size."""

    collective: str
    algorithm: str
    size_bytes: int
    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    vs_native: float
    wrong: int


@dataclass
class Case:
    """One algorithm's call on this size's buffers, and its check on known data."""

    run: Callable[[], None]
    inputs: list[torch.Tensor]
    result: torch.Tensor
    expected: torch.Tensor | None  # None: nothing to check on this rank


def _sum_of_ranks(numel: int, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """What summing rank+1 over the ranks gives: 1 + 2 + ... + N."""
    return torch.full((numel,), world_size * (world_size + 1) / 2, dtype=dtype)


def _all_reduce(name: str, numel: int, dtype: torch.dtype, ctx, made: dict) -> Case:
    fn = made[name]
    full = torch.zeros(numel, dtype=dtype)
    return Case(lambda: fn(full), [full], full, _sum_of_ranks(numel, dtype, ctx.world_size))


def _broadcast(name: str, numel: int, dtype: torch.dtype, ctx, made: dict) -> Case:
    call = {"native": dist.broadcast, "linear": lc.broadcast_linear, "tree": lc.broadcast_tree}
    full = torch.zeros(numel, dtype=dtype)
    return Case(lambda: call[name](full, 0), [full], full, torch.ones(numel, dtype=dtype))


def _reduce(name: str, numel: int, dtype: torch.dtype, ctx, made: dict) -> Case:
    full, workspace = torch.zeros(numel, dtype=dtype), lc.Workspace()

    def native() -> None:
        dist.reduce(full, 0)

    def ours() -> None:
        lc.reduce_tree(full, 0, workspace=workspace)

    run = native if name == "native" else ours
    expected = _sum_of_ranks(numel, dtype, ctx.world_size) if ctx.rank == 0 else None
    return Case(run, [full], full, expected)


def _reduce_scatter(name: str, numel: int, dtype: torch.dtype, ctx, made: dict) -> Case:
    full, workspace = torch.zeros(numel, dtype=dtype), lc.Workspace()
    part = torch.zeros(numel // ctx.world_size, dtype=dtype)

    def native() -> None:
        reduce_scatter_single(part, full)

    def ours() -> None:
        lc.reduce_scatter(part, full, workspace=workspace)

    run = native if name == "native" else ours
    return Case(run, [full], part, _sum_of_ranks(part.numel(), dtype, ctx.world_size))


def _all_gather(name: str, numel: int, dtype: torch.dtype, ctx, made: dict) -> Case:
    full = torch.zeros(numel, dtype=dtype)
    part = torch.zeros(numel // ctx.world_size, dtype=dtype)

    def native() -> None:
        all_gather_single(full, part)

    def ours() -> None:
        lc.all_gather(full, part)

    run = native if name == "native" else ours
    ranks = torch.arange(1, ctx.world_size + 1, dtype=dtype)
    return Case(run, [part], full, ranks.repeat_interleave(part.numel()))


_CASES = {
    Collective.ALL_REDUCE: _all_reduce,
    Collective.BROADCAST: _broadcast,
    Collective.REDUCE: _reduce,
    Collective.REDUCE_SCATTER: _reduce_scatter,
    Collective.ALL_GATHER: _all_gather,
}
_SPLIT = (Collective.REDUCE_SCATTER, Collective.ALL_GATHER)  # one chunk per rank


def _count_wrong(case: Case, rank: int) -> int:
    for tensor in case.inputs:
        tensor.fill_(rank + 1)
    case.run()
    if case.expected is None:
        return 0
    return int((case.result != case.expected).sum().item())


def _time_cases(cases: dict[str, Case], opts: BenchOptions) -> dict[str, float]:
    """Median seconds per call of each case, the slowest rank counting for each call."""
    calls = {name: case.run for name, case in cases.items()}
    samples = per_call_seconds(calls, opts.iters, opts.warmup)
    return {name: statistics.median(times) for name, times in samples.items()}


def run_bench(ctx: lockstep.DistContext, opts: BenchOptions) -> list[Row]:
    """Time every algorithm at every size; the same rows come back on every rank.

    Collective: every rank calls it with the same options. Sizes are rounded down
    to whole elements (to a multiple of the world size for reduce-scatter and
    all-gather), at least one element (per rank).
    """
    dtype = TORCH_DTYPES[opts.dtype]
    element = torch.tensor([], dtype=dtype).element_size()
    per = ctx.world_size if opts.collective in _SPLIT else 1
    made = {}
    if opts.collective is Collective.ALL_REDUCE:  # once: "hierarchical" makes groups
        nodes = opts.ranks_per_node or ctx.local_world_size
        made = {name: lc.make_allreduce(name, None, nodes) for name in opts.algorithms}
    rows: list[Row] = []
    for size in opts.sizes:
        numel = max(1, size // (element * per)) * per
        cases = {
            name: _CASES[opts.collective](name, numel, dtype, ctx, made) for name in opts.algorithms
        }
        seconds = _time_cases(cases, opts)
        wrong = torch.tensor([_count_wrong(cases[name], ctx.rank) for name in cases])
        dist.all_reduce(wrong)
        rows += _rows(opts, numel * element, seconds, wrong.tolist(), ctx.world_size)
    return rows


def _rows(opts: BenchOptions, nbytes: int, seconds: dict[str, float], wrong, n) -> list[Row]:
    factor = _bus_factor(opts.collective, n)
    native = seconds["native"]
    return [
        Row(
            opts.collective.value,
            name,
            nbytes,
            seconds[name] * 1e6,
            nbytes / seconds[name] / 1e9,
            nbytes / seconds[name] / 1e9 * factor,
            native / seconds[name],
            int(wrong[i]),
        )
        for i, name in enumerate(seconds)
    ]


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table, one line per algorithm and size."""
    head = (
        f"#{'size (B)':>11} {'algorithm':<17}{'time (us)':>11}{'algbw GB/s':>12}"
        f"{'busbw GB/s':>12}{'vs native':>11}{'#wrong':>8}"
    )
    body = [
        f" {r.size_bytes:>11} {r.algorithm:<17}{r.time_us:>11.1f}{r.algbw_GBps:>12.3f}"
        f"{r.busbw_GBps:>12.3f}{r.vs_native:>10.2f}x{r.wrong:>8}"
        for r in rows
    ]
    return "\n".join([head, *body])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lockstep.bench.collectives_worker")
    add_bench_flags(parser)
    opts = bench_options(parser.parse_args(argv))
    ctx = lockstep.init()
    try:
        rows = run_bench(ctx, opts)
    finally:
        lockstep.shutdown()
    if ctx.is_main:
        print(
            f"# lockstep bench collectives: {opts.collective.value}, world size "
            f"{ctx.world_size}, {ctx.backend}, {opts.dtype}, median of {opts.iters} calls",
            flush=True,
        )
        print(format_table(rows), flush=True)
        if opts.json_path:
            doc = {"world_size": ctx.world_size, "backend": ctx.backend, "dtype": opts.dtype}
            doc["iters"] = opts.iters
            doc["rows"] = [asdict(r) for r in rows]
            with open(opts.json_path, "w") as fp:
                json.dump(doc, fp, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
