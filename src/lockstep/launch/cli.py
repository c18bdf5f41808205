"""`lockstep run`: the subcommand's flags, turned into a `RunConfig`."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.launch.config import RunConfig, parse_nproc


def add_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="launch a training script on this node's workers",
        description="Launch SCRIPT (or -m MODULE) once per worker, with RANK, WORLD_SIZE, ... set.",
    )
    run.add_argument(
        "--nproc-per-node",
        default="auto",
        help="workers on this node: an integer, or 'auto' (one per GPU, else one "
        "per CPU core up to 4)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole group up to this many times after a failure",
    )
    run.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="run the target as a module, like `python -m`",
    )
    run.add_argument("target", help="the script (or module with -m) to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=main)


def run_config(ns: argparse.Namespace) -> RunConfig:
    """Validate the flags; raises ValueError with a message naming the flag."""
    if not ns.module and not Path(ns.target).is_file():
        raise ValueError(
            f"script {ns.target!r} not found; expected a path to a Python file "
            "(or `-m package.module`)"
        )
    target = ["-m", ns.target, *ns.args] if ns.module else [ns.target, *ns.args]
    return RunConfig(
        target=target,
        nproc_per_node=parse_nproc(ns.nproc_per_node),
        max_restarts=ns.max_restarts,
    )


def main(ns: argparse.Namespace) -> int:
    from lockstep.launch.runner import run

    return run(run_config(ns))
