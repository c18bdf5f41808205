"""The `lockstep` command. Each subcommand lives beside the code it drives and registers here.

A subcommand module has `add_parser(sub)`, which sets `handler` to a function
`(namespace) -> exit code`. A ValueError raised by a handler is bad input: it is
printed as one line naming the problem, with exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from lockstep.bench import cli as bench_cli
from lockstep.launch.cli import parser as run_cli
from lockstep.observe import cli as trace_cli
from lockstep.plan import cli as plan_cli

SUBCOMMANDS = [run_cli, plan_cli, bench_cli, trace_cli]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep", description="Distributed data-parallel training for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as error:
        parser.exit(2, f"lockstep {ns.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
