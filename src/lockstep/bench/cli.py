"""`lockstep bench`: measurements on your own machines. Each benchmark is a sub-subcommand.

To add one (`lockstep bench collectives`, ...), write a module with
`add_parser(sub)` that sets `handler=` on its parser, and append it to BENCHES.
"""

from __future__ import annotations

import argparse

from lockstep.bench import allreduce, collectives

BENCHES = [allreduce, collectives]


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure collectives on this machine (see `lockstep bench -h`)",
        description="Measure communication on your own machines, launched like training.",
    )
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module in BENCHES:
        module.add_parser(benches)
