"""The arithmetic of an all-reduce size sweep: sizes, bandwidths, the fit, the table, the JSON.

Pure functions, no process group: the worker (allreduce_worker.py) times the
collectives and hands the times here. Bandwidths follow nccl-tests: algbw = size /
time, busbw = algbw x 2(N-1)/N, the rate each link of a ring actually carried, which
does not depend on N and compares directly with a link's datasheet figure. The fit
t(s) = latency + s / rate over the whole sweep is what `lockstep plan` reads.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lockstep.plan.comm import ring_factor
from lockstep.plan.links import BENCH_FORMAT as FORMAT


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int, element_size: int) -> list[int]:
    """Sizes from `min_bytes` to `max_bytes`, each `factor` times the last, whole elements.

    Raises:
        ValueError: min above max, factor below 2, or a size under one element.
    """
    if min_bytes > max_bytes:
        raise ValueError(f"--min-bytes ({min_bytes}) must not exceed --max-bytes ({max_bytes})")
    if factor < 2:
        raise ValueError(f"--factor must be an integer >= 2; found {factor}")
    if min_bytes < element_size:
        raise ValueError(
            f"--min-bytes must hold at least one element ({element_size} bytes); found {min_bytes}"
        )
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size - size % element_size)
        size *= factor
    return sizes


@dataclass(frozen=True)
class Row:
    """One size of the sweep, as nccl-tests prints it."""

    size_bytes: int
    count: int
    type: str
    redop: str
    time_us: float
    algbw_GBps: float  # the unit is part of the name, as in the JSON
    busbw_GBps: float
    wrong: int


def make_row(
    size_bytes: int, element_size: int, dtype: str, seconds: float, world_size: int, wrong: int
) -> Row:
    """A table row from one size's mean time per all-reduce (GB/s = 1e9 bytes/s)."""
    algbw = size_bytes / seconds / 1e9
    return Row(
        size_bytes=size_bytes,
        count=size_bytes // element_size,
        type=dtype,
        redop="sum",
        time_us=seconds * 1e6,
        algbw_GBps=algbw,
        busbw_GBps=algbw * ring_factor(world_size),
        wrong=wrong,
    )


def fit_latency_bandwidth(rows: Sequence[Row]) -> tuple[float, float] | None:
    """Fit t = a + s x c to the sweep: the slope from least squares, the latency robustly.

    Plain least squares lets the large sizes, where time is mostly bytes over
    bandwidth, set the slope c. The latency a is then the median over all sizes of
    t - s x c, so one noisy small size cannot drag it below zero or far up.

    Returns:
        (latency a in seconds, seconds per byte c), or None with fewer than two sizes
        or no positive slope.
    """
    if len(rows) < 2:
        return None
    sizes = [float(r.size_bytes) for r in rows]
    times = [r.time_us * 1e-6 for r in rows]
    mean_s, mean_t = statistics.fmean(sizes), statistics.fmean(times)
    var = sum((x - mean_s) ** 2 for x in sizes)
    cov = sum((x - mean_s) * (t - mean_t) for x, t in zip(sizes, times, strict=True))
    slope = cov / var if var > 0 else 0.0
    if slope <= 0:
        return None
    latency = statistics.median(t - slope * x for x, t in zip(sizes, times, strict=True))
    return max(0.0, latency), slope


def result_json(rows: Sequence[Row], world_size: int, meta: dict[str, Any]) -> dict[str, Any]:
    """The `--json` document: the rows, the fit, and how it was measured."""
    doc: dict[str, Any] = {"format": FORMAT, "world_size": world_size, **meta}
    doc["rows"] = [asdict(r) for r in rows]
    largest = max(rows, key=lambda r: r.size_bytes)
    doc["busbw_GBps_at_largest"] = largest.busbw_GBps
    doc["avg_busbw_GBps"] = sum(r.busbw_GBps for r in rows) / len(rows)
    fit = fit_latency_bandwidth(rows) if world_size > 1 else None
    doc["fit"] = None
    if fit is not None:
        latency, slope = fit
        doc["fit"] = {
            "latency_us": latency * 1e6,
            "hop_latency_us": latency * 1e6 / (2 * (world_size - 1)),
            "busbw_GBps": ring_factor(world_size) / slope / 1e9,
            "model": "time = latency + 2(N-1)/N x size / busbw; hop = latency / (2(N-1))",
        }
    return doc


def format_table(rows: Sequence[Row], doc: dict[str, Any]) -> str:
    """The sweep in nccl-tests' layout, with the fit underneath."""
    head = (
        f"#{'size':>12}{'count':>12}{'type':>7}{'redop':>7}{'time':>11}"
        f"{'algbw':>9}{'busbw':>9}{'#wrong':>8}\n"
        f"#{'(B)':>12}{'(elements)':>12}{'':>7}{'':>7}{'(us)':>11}"
        f"{'(GB/s)':>9}{'(GB/s)':>9}{'':>8}"
    )
    body = [
        f" {r.size_bytes:>12}{r.count:>12}{r.type:>7}{r.redop:>7}{r.time_us:>11.1f}"
        f"{r.algbw_GBps:>9.3f}{r.busbw_GBps:>9.3f}{r.wrong:>8}"
        for r in rows
    ]
    tail = [f"# Avg bus bandwidth    : {doc['avg_busbw_GBps']:.3f} GB/s"]
    fit = doc.get("fit")
    if fit:
        tail.append(
            f"# Fit (all sizes)      : latency {fit['latency_us']:.1f} us "
            f"({fit['hop_latency_us']:.1f} us per ring hop), busbw {fit['busbw_GBps']:.3f} GB/s"
        )
    return "\n".join([head, *body, *tail])
