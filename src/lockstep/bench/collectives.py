"""`lockstep bench collectives`: lockstep's collective algorithms timed beside the native one.

For one collective (all-reduce by default) and a list of sizes, every algorithm
of `lockstep.collectives` and the backend's own call are timed interleaved, and
the table gives the median time, algorithm bandwidth (size / time) and bus
bandwidth (algbw x the collective's nccl-tests factor), with the ratio to native.
The flags are checked here; then lockstep's launcher starts
`lockstep.bench.collectives_worker` on every worker, as `lockstep run` would.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import Enum

from lockstep.launch.cli.config import add_nproc_flag
from lockstep.plan.units import parse_bytes

WORKER = "lockstep.bench.collectives_worker"
DTYPES = ("fp32", "fp16", "bf16")


class Collective(str, Enum):
    """The collectives this bench can time."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"


ALGORITHMS = {
    Collective.ALL_REDUCE: ("native", "naive", "tree", "ring", "halving_doubling", "hierarchical"),
    Collective.BROADCAST: ("native", "linear", "tree"),
    Collective.REDUCE: ("native", "tree"),
    Collective.REDUCE_SCATTER: ("native", "ring"),
    Collective.ALL_GATHER: ("native", "ring"),
}


def bus_factor(collective: Collective, world_size: int) -> float:
    """busbw / algbw, as nccl-tests defines it: what each rank's link carries per byte of size."""
    n = world_size
    if collective is Collective.ALL_REDUCE:
        return 2 * (n - 1) / n
    if collective in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class BenchOptions:
    """What to time. Validated on construction.

    Attributes:
        collective: which collective.
        algorithms: names from ALGORITHMS[collective]; "native" always comes first.
        sizes: message sizes in bytes (the whole tensor: all-gather's output,
            reduce-scatter's input), as given.
        dtype: fp32, fp16 or bf16.
        iters: timed calls per algorithm and size; the median is reported.
        warmup: untimed calls first.
        ranks_per_node: node size for "hierarchical"; None takes LOCAL_WORLD_SIZE.
        json_path: where rank 0 writes the rows, or None.
    """

    collective: Collective
    algorithms: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str = "fp32"
    iters: int = 20
    warmup: int = 3
    ranks_per_node: int | None = None
    json_path: str | None = None

    def __post_init__(self) -> None:
        known = ALGORITHMS[self.collective]
        unknown = [name for name in self.algorithms if name not in known]
        if unknown or not self.algorithms:
            raise ValueError(
                f"--algorithms for {self.collective.value} expects names among "
                f"{', '.join(known)}; found {', '.join(unknown) or 'none'}"
            )
        if self.algorithms[0] != "native":
            raise ValueError("--algorithms must start with native (the reference)")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype expects one of {', '.join(DTYPES)}; found {self.dtype}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(
                f"--iters must be >= 1 and --warmup >= 0; found {self.iters}, {self.warmup}"
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node must be >= 1; found {self.ranks_per_node}")


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by `lockstep bench collectives` and its worker."""
    add = parser.add_argument
    add(
        "--collective",
        default="all_reduce",
        help=f"one of {', '.join(c.value for c in Collective)}",
    )
    add("--algorithms", default=None, help="comma-separated (default: all for the collective)")
    add("--sizes", default="64KiB,1MiB,4MiB,16MiB,64MiB", help="comma-separated sizes")
    add("--dtype", default="fp32", help=f"element type: {', '.join(DTYPES)}")
    add("--iters", type=int, default=20, help="timed calls per algorithm and size (default 20)")
    add("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    add(
        "--ranks-per-node",
        type=int,
        default=None,
        help="node size seen by 'hierarchical' (default: the launcher's LOCAL_WORLD_SIZE); "
        "set it to simulate several nodes on one",
    )
    add("--json", default=None, metavar="FILE", help="rank 0 writes the rows here")


def bench_options(ns: argparse.Namespace) -> BenchOptions:
    """Validate the flags; raises ValueError naming the flag."""
    try:
        collective = Collective(ns.collective)
    except ValueError:
        names = ", ".join(c.value for c in Collective)
        raise ValueError(f"--collective expects one of {names}; found {ns.collective!r}") from None
    if ns.algorithms is None:
        algorithms = ALGORITHMS[collective]
    else:
        algorithms = tuple(a.strip() for a in ns.algorithms.split(",") if a.strip())
        algorithms = ("native", *(a for a in algorithms if a != "native"))
    sizes = tuple(parse_bytes(s, "--sizes", unit_required=False) for s in ns.sizes.split(","))
    return BenchOptions(
        collective, algorithms, sizes, ns.dtype, ns.iters, ns.warmup, ns.ranks_per_node, ns.json
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "collectives",
        help="lockstep's collective algorithms against the native one, per size",
        description="Time each algorithm of a collective beside the backend's own call, "
        "interleaved, on this node's workers: median time, algbw = size / time, busbw = "
        "algbw x the nccl-tests factor (2(N-1)/N for all-reduce), and the ratio to native.",
    )
    add_nproc_flag(bench)
    add_bench_flags(bench)
    bench.set_defaults(handler=main)


def worker_argv(ns: argparse.Namespace) -> list[str]:
    """The worker's command line: the flags, passed on as given."""
    argv = ["--collective", ns.collective, "--sizes", ns.sizes, "--dtype", ns.dtype]
    argv += ["--iters", str(ns.iters), "--warmup", str(ns.warmup)]
    for flag, value in (
        ("--algorithms", ns.algorithms),
        ("--ranks-per-node", ns.ranks_per_node),
        ("--json", ns.json),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def main(ns: argparse.Namespace) -> int:
    from lockstep.launch import RunConfig, run
    from lockstep.launch.cli.config import parse_nproc

    opts = bench_options(ns)  # raises ValueError on bad flags before anything starts
    nproc = parse_nproc(ns.nproc_per_node)
    if opts.ranks_per_node is not None and nproc % opts.ranks_per_node:
        raise ValueError(
            f"--ranks-per-node ({opts.ranks_per_node}) must divide --nproc-per-node ({nproc})"
        )
    return run(RunConfig(target=["-m", WORKER, *worker_argv(ns)], nproc_per_node=nproc))
