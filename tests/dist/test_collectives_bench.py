"""`lockstep bench collectives`: every collective's rows at world size 2, and bad flags.

The worker's `run_bench` runs on real gloo ranks (the launcher path is the one
`lockstep bench allreduce`'s test covers); the rows must be correct (no wrong
element) and their bandwidths must follow from their times by nccl-tests' rules.
"""

from __future__ import annotations

import argparse

import pytest

from lockstep.bench.collectives import ALGORITHMS, Collective, add_bench_flags, bench_options
from lockstep.bench.collectives_worker import format_table, run_bench
from lockstep.cli import main
from lockstep.testing import run_ranks

FACTORS = {"all_reduce": 1.0, "broadcast": 1.0, "reduce": 1.0}  # at N = 2: 2(N-1)/N = 1
FACTORS.update({"reduce_scatter": 0.5, "all_gather": 0.5})  # (N-1)/N


def _options(collective: str):
    parser = argparse.ArgumentParser()
    add_bench_flags(parser)
    args = ["--collective", collective, "--sizes", "1004,8KiB", "--iters", "2", "--warmup", "1"]
    return bench_options(parser.parse_args(args))


def _bench_all(ctx):
    return [run_bench(ctx, _options(c.value)) for c in Collective]


def test_every_collective_at_world_size_2():
    results = run_ranks(_bench_all, 2, timeout_s=30, deadline_s=110)
    assert results[0] == results[1]  # every rank returns the same rows
    for collective, rows in zip(Collective, results[0], strict=True):
        names = [row.algorithm for row in rows]
        assert names == list(ALGORITHMS[collective]) * 2, names
        for row in rows:
            assert row.wrong == 0, row
            algbw = row.size_bytes / (row.time_us * 1e-6) / 1e9
            assert row.algbw_GBps == pytest.approx(algbw)
            assert row.busbw_GBps == pytest.approx(algbw * FACTORS[collective.value])
            if row.algorithm == "native":
                assert row.vs_native == pytest.approx(1.0)
        split = collective in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER)
        assert {row.size_bytes for row in rows} == ({1000, 8192} if split else {1004, 8192})
    table = format_table(results[0][0])
    assert "busbw" in table and len(table.splitlines()) == 1 + len(results[0][0])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--collective", "gossip"], "--collective expects one of all_reduce"),
        (["--algorithms", "ring,spiral"], "found spiral"),
        (["--collective", "broadcast", "--algorithms", "ring"], "linear, tree"),
        (["--sizes", "4KQ"], "--sizes expects"),
        (["--dtype", "fp8"], "--dtype expects one of fp32, fp16, bf16"),
        (["--nproc-per-node", "3", "--ranks-per-node", "2"], "must divide --nproc-per-node"),
    ],
)
def test_bad_flags_are_one_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "collectives", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
