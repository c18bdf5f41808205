"""Named interconnects with the bandwidth ranges the planner quotes, and measured ones.

A `Link` is what one all-reduce crosses: a bandwidth range (the low and high end
of what that family of hardware delivers per GPU or per node) and a per-hop
latency. The ranges are the nominal figures users meet in datasheets; the
latencies are typical one-way figures and only matter for small buckets. A
measured link (from `lockstep bench allreduce --json`) has one bandwidth and the
latency fitted from the sweep, and is the figure to trust on your own machines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lockstep.plan.units import RATE_FORMS, parse_rate

GB = 1e9
GBIT = 1e9 / 8


@dataclass(frozen=True)
class Link:
    """One interconnect as the cost model sees it.

    Attributes:
        name: how it is printed (`nvlink`, `ethernet`, `measured`, ...).
        low_bps: bandwidth at the low end of the range, bytes per second.
        high_bps: bandwidth at the high end; equal to `low_bps` for one figure.
        hop_latency_s: latency of one ring step (one message to the neighbour).
        note: where the figure comes from, printed beside it.
    """

    name: str
    low_bps: float
    high_bps: float
    hop_latency_s: float
    note: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.low_bps <= self.high_bps:
            raise ValueError(
                f"link {self.name!r}: bandwidth range must satisfy 0 < low <= high; "
                f"found {self.low_bps} .. {self.high_bps} bytes/s"
            )
        if self.hop_latency_s < 0:
            raise ValueError(
                f"link {self.name!r}: latency must be >= 0; found {self.hop_latency_s} s"
            )

    @property
    def is_range(self) -> bool:
        return self.low_bps != self.high_bps


NAMED_LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 300 * GB, 900 * GB, 2e-6, "NVLink 3/4, inside a node"),
    "pcie": Link("pcie", 16 * GB, 64 * GB, 3e-6, "PCIe gen3 x16 to gen5 x16"),
    "infiniband": Link("infiniband", 10 * GB, 100 * GB, 3e-6, "InfiniBand, per node"),
    "ethernet": Link("ethernet", 1 * GBIT, 25 * GBIT, 30e-6, "1 to 25 Gbit/s Ethernet"),
}

INTRA_NODE_DEFAULTS = ("nvlink", "pcie")
INTER_NODE_DEFAULTS = ("infiniband", "ethernet")

LINK_FORMS = f"a link name ({', '.join(NAMED_LINKS)}) or {RATE_FORMS}"


def parse_link(text: str, arg: str) -> Link:
    """A named link (`nvlink`), or a bandwidth (`25Gbit/s`) taken as a link of that speed.

    Raises:
        ValueError: neither a known name nor a rate; the message lists both forms.
    """
    name = text.strip().lower()
    if name in NAMED_LINKS:
        return NAMED_LINKS[name]
    if not name[:1].isdigit() and name[:1] not in "+-.":
        raise ValueError(f"{arg}: unknown link {text!r}; expected {LINK_FORMS}")
    rate = parse_rate(text, arg)
    return Link(text.strip(), rate, rate, 0.0, "given bandwidth, no latency")


def measured_link(busbw_bps: float, hop_latency_s: float, source: str) -> Link:
    """A link described by a measurement: one bus bandwidth and its fitted hop latency."""
    return Link("measured", busbw_bps, busbw_bps, hop_latency_s, source)


BENCH_FORMAT = "lockstep.bench.allreduce/1"


def read_measured(path: str) -> Link:
    """The measured link in a `lockstep bench allreduce --json FILE` result.

    Uses the latency-bandwidth fit of the sweep when present (bus bandwidth and
    latency per ring hop), else the bus bandwidth at the largest size with no latency.

    Raises:
        ValueError: the file is missing, not such a result, or measured on one rank.
    """
    arg = "--bandwidth-from"
    try:
        with open(path) as fp:
            data = json.load(fp)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{arg}: cannot read {path!r} ({error}); expected the file written by "
            "`lockstep bench allreduce --json FILE`"
        ) from None
    return measured_from_doc(data, path)


def measured_from_doc(data: object, path: str = "<result>") -> Link:
    """The measured link in a bench result already loaded from JSON (see `read_measured`).

    Raises:
        ValueError: not such a result, or measured on one rank.
    """
    arg = "--bandwidth-from"
    if not isinstance(data, dict) or data.get("format") != BENCH_FORMAT:
        raise ValueError(
            f"{arg}: {path!r} is not a `lockstep bench allreduce --json` result "
            f'(expected "format": "{BENCH_FORMAT}")'
        )
    if not isinstance(data.get("world_size"), int) or data["world_size"] < 2:
        raise ValueError(
            f"{arg}: {path!r} was measured at world size {data.get('world_size')}: no data "
            "crossed a link. Run the bench with --nproc-per-node 2 or more"
        )
    fit = data.get("fit") or {}
    source = f"{path}, world size {data['world_size']}"
    if fit.get("busbw_GBps", 0) > 0:
        hop = max(0.0, fit.get("hop_latency_us", 0.0)) * 1e-6
        return measured_link(fit["busbw_GBps"] * 1e9, hop, source + ", fitted")
    rows = data.get("rows") or []
    largest = max(rows, key=lambda r: r["size_bytes"], default=None)
    if largest is None or largest.get("busbw_GBps", 0) <= 0:
        raise ValueError(f"{arg}: {path!r} holds no positive bus bandwidth; re-run the bench")
    return measured_link(largest["busbw_GBps"] * 1e9, 0.0, source + ", largest size")
