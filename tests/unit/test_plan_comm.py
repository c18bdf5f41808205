"""The all-reduce cost model: ring and two-phase formulas, buckets, links, measured results."""

from __future__ import annotations

import json

import pytest

from lockstep.bench.sweep import fit_latency_bandwidth, make_row, result_json
from lockstep.plan.comm import (
    Topology,
    bucket_sizes,
    ring_factor,
    ring_seconds,
    step_seconds,
    two_phase_seconds,
)
from lockstep.plan.links import NAMED_LINKS, Link, parse_link, read_measured

MiB = 2**20


def test_ring_formula_is_2_n_minus_1_over_n_times_payload_over_bandwidth_plus_hops():
    assert ring_factor(2) == 1.0
    assert ring_factor(8) == 1.75
    # 14 GB over 8 GPUs at 100 GB/s: 1.75 x 14e9 / 100e9 = 0.245 s, plus 14 hops of 5 us
    assert ring_seconds(14e9, 8, 100e9, 5e-6) == pytest.approx(0.245 + 14 * 5e-6)
    assert ring_seconds(14e9, 1, 100e9, 5e-6) == 0.0  # one GPU: nothing to reduce


def test_buckets_follow_ddp_reverse_order_and_caps():
    # Registration order a, b, c, d; gradients become ready d, c, b, a.
    params = [3 * MiB, 10 * MiB, 20 * MiB, MiB // 2]
    assert bucket_sizes(params, sum(params), cap_bytes=25 * MiB) == [
        MiB // 2 + 20 * MiB,  # first bucket (cap 1 MiB) closes once d + c passes it
        10 * MiB + 3 * MiB,  # never reaches 25 MiB: the tail bucket
    ]
    # Without parameter sizes the payload is cut: 1 MiB first, then full caps, then the rest.
    assert bucket_sizes(None, 60 * MiB) == [MiB, 25 * MiB, 25 * MiB, 9 * MiB]
    assert bucket_sizes(None, 0) == []


def test_step_time_sums_buckets_and_uses_both_ends_of_a_range():
    link = NAMED_LINKS["ethernet"]  # 1 to 25 Gbit/s
    buckets = [MiB, 25 * MiB]
    slow = step_seconds(buckets, 4, link, fast=False)
    fast = step_seconds(buckets, 4, link, fast=True)
    expected_slow = sum(ring_seconds(b, 4, 1e9 / 8, link.hop_latency_s) for b in buckets)
    assert slow == pytest.approx(expected_slow)
    assert fast == pytest.approx(sum(ring_seconds(b, 4, 25e9 / 8, 30e-6) for b in buckets))


def test_two_phase_is_a_ring_in_the_node_then_a_ring_across_nodes():
    intra = Link("fast", 400e9, 400e9, 0.0)
    inter = Link("slow", 10e9, 10e9, 0.0)
    topo = Topology(gpus_per_node=8, nodes=4)
    got = two_phase_seconds([10**9], topo, intra, inter, fast=True)
    assert got == pytest.approx(1.75 * 1e9 / 400e9 + 1.5 * 1e9 / 10e9)
    # It beats the flat ring bounded by the slow link: 2(M-1)/M < 2(N-1)/N.
    assert got < step_seconds([10**9], 32, inter, fast=True)


def test_parse_link_names_rates_and_errors():
    assert parse_link("NVLink", "--link") is NAMED_LINKS["nvlink"]
    given = parse_link("25Gbit/s", "--link")
    assert given.low_bps == given.high_bps == 25e9 / 8
    with pytest.raises(ValueError, match=r"--link: unknown link 'token-ring'; expected .*nvlink"):
        parse_link("token-ring", "--link")


def _bench_doc(world_size: int, latency_s: float, busbw: float) -> dict:
    rows = []
    for size in (4096 * 4**k for k in range(6)):
        seconds = latency_s + ring_factor(world_size) * size / busbw
        rows.append(make_row(size, 4, "fp32", seconds, world_size, 0))
    return result_json(rows, world_size, {"backend": "gloo"})


def test_fit_recovers_latency_and_bus_bandwidth_from_an_exact_sweep():
    doc = _bench_doc(4, 50e-6, 2e9)
    assert doc["fit"]["latency_us"] == pytest.approx(50, rel=1e-6)
    assert doc["fit"]["hop_latency_us"] == pytest.approx(50 / 6, rel=1e-6)
    assert doc["fit"]["busbw_GBps"] == pytest.approx(2.0, rel=1e-6)
    for row in doc["rows"]:
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 1.5)
    assert fit_latency_bandwidth([]) is None


def test_fit_shrugs_off_a_slow_small_size():
    # A sweep like the default one (4 KiB to 64 MiB, factor 2), one small size 10x slow.
    sizes = [4096 * 2**k for k in range(15)]
    rows = [make_row(s, 4, "fp32", 500e-6 + s / 0.5e9, 2, 0) for s in sizes]
    rows[1] = make_row(sizes[1], 4, "fp32", 10 * rows[1].time_us * 1e-6, 2, 0)
    latency, slope = fit_latency_bandwidth(rows)
    assert latency == pytest.approx(500e-6, rel=0.05)
    assert 1 / slope == pytest.approx(0.5e9, rel=0.05)


def test_plan_reads_the_bench_json_and_predicts_with_both_fit_terms(tmp_path):
    path = tmp_path / "bw.json"
    path.write_text(json.dumps(_bench_doc(2, 40e-6, 1e9)))
    link = read_measured(str(path))
    assert link.low_bps == pytest.approx(1e9, rel=1e-6)
    assert link.hop_latency_s == pytest.approx(20e-6, rel=1e-6)
    # At the measured world size, the prediction is the measured curve itself.
    assert ring_seconds(10**6, 2, link.low_bps, link.hop_latency_s) == pytest.approx(
        40e-6 + 1e6 / 1e9, rel=1e-6
    )


def test_plan_falls_back_to_largest_size_without_a_fit(tmp_path):
    doc = _bench_doc(2, 40e-6, 1e9)
    doc["fit"] = None
    path = tmp_path / "bw.json"
    path.write_text(json.dumps(doc))
    link = read_measured(str(path))
    assert link.low_bps == pytest.approx(doc["busbw_GBps_at_largest"] * 1e9)
    assert link.hop_latency_s == 0.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("not json", "cannot read"),
        ('{"rows": []}', "is not a `lockstep bench allreduce --json` result"),
        ('{"format": "lockstep.bench.allreduce/1", "world_size": 1}', "world size 1"),
    ],
)
def test_bad_measured_files_are_refused(tmp_path, content, message):
    path = tmp_path / "bw.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"--bandwidth-from: .*{message}"):
        read_measured(str(path))
