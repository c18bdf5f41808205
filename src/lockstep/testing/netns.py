"""Two hosts on one machine: network namespaces joined by a veth pair, optionally shaped.

Tests and benchmarks use this to run `lockstep run --nnodes 2` as if on two machines:
each namespace has its own loopback and one veth end with its own address (10.213.N.1,
10.213.N.2), so processes inside reach each other over that link only, whose rate and
delay `tc` can set; `lan(n)` puts n hosts on one switch (a bridge in its own namespace)
for a host that watches or attacks; `cut`/`heal` drop every packet a host sends;
`kill_inside` ends a node's processes. Needs root and iproute2 (`ip`, `tc`). Use:

    with two_hosts(rate="1gbit") as (a, b):
        proc = b.popen(["python", "-c", "..."])
        print(a.counters().tx_bytes)
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from lockstep.errors import LockstepError

COMMAND_TIMEOUT_S = 20
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8}
_RATE_UNITS.update({"kbps": 8e3, "mbps": 8e6, "gbps": 8e9})
_serial = itertools.count()


class NetnsUnavailable(LockstepError):
    """Namespaces, a veth pair or a qdisc cannot be made here; the message says why."""


@dataclass(frozen=True)
class LinkCounters:
    """Byte and packet counters of one veth end, as the kernel counts them."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int


@dataclass(frozen=True)
class Host:
    """One side of the pair: a namespace, its veth end and that end's IPv4 address.

    Attributes:
        namespace: the network namespace's name (for `ip netns exec`).
        interface: the veth end inside it (what GLOO_SOCKET_IFNAME would name).
        address: the IPv4 address on that interface; the other host reaches this one here.
    """

    namespace: str
    interface: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped so that it runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start `argv` inside the namespace (keyword arguments go to subprocess.Popen)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(
        self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Run `argv` inside the namespace to completion (subprocess.run keywords apply)."""
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def counters(self) -> LinkCounters:
        """Bytes and packets sent and received so far on this host's veth end."""
        out = _ip("-n", self.namespace, "-s", "-j", "link", "show", "dev", self.interface)
        stats = json.loads(out)[0]["stats64"]
        return LinkCounters(
            rx_bytes=stats["rx"]["bytes"],
            tx_bytes=stats["tx"]["bytes"],
            rx_packets=stats["rx"]["packets"],
            tx_packets=stats["tx"]["packets"],
        )


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2), or None when they can."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 is not installed ({', '.join(missing)} not found on PATH)"
    return None


def _ip(*args: str) -> str:
    return _call(["ip", *args])


def _call(argv: list[str]) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NetnsUnavailable(f"`{' '.join(argv)}` could not run: {error}") from None
    if done.returncode != 0:
        raise NetnsUnavailable(
            f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def rate_bits(rate: str | int) -> int:
    """A rate in bits per second, from an int or a tc-style string such as '1gbit' or '200mbit'.

    Raises:
        ValueError: the string has no known unit (bit, kbit, mbit, gbit, tbit, bps, ...).
    """
    if isinstance(rate, int):
        return rate
    text = rate.strip().lower()
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * _RATE_UNITS[unit])
    raise ValueError(f"rate {rate!r} has no unit; expected for example '1gbit' or '200mbit'")


def delay_ms(delay: str | float) -> float:
    """A delay in milliseconds, from seconds (float) or a string such as '0.2ms' or '50us'."""
    if not isinstance(delay, str):
        return float(delay) * 1e3
    text = delay.strip().lower()
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"delay {delay!r} has no unit; expected for example '0.2ms' or '50us'")


def shape(host: Host, rate: str | int | None = None, delay: str | float | None = None) -> None:
    """Limit what `host` sends on its veth end: `rate` (tbf), `delay` (netem, rate included).

    Shaping both hosts shapes both directions. With neither argument, removes any shaping.

    Raises:
        NetnsUnavailable: the kernel lacks the qdisc (netem is often missing for delay).
    """
    base = ["tc", "qdisc", "replace", "dev", host.interface, "root"]
    if delay is not None:
        spec = ["netem", "delay", f"{delay_ms(delay)}ms"]
        if rate is not None:
            spec += ["rate", f"{rate_bits(rate)}bit"]
    elif rate is not None:
        bits = rate_bits(rate)
        burst = max(32 * 1024, bits // 8 // 1000)  # one millisecond of traffic, at least 32 KiB
        spec = ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "100ms"]
    else:
        subprocess.run(
            host.command(["tc", "qdisc", "del", "dev", host.interface, "root"]),
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        return
    try:
        _call(host.command(base + spec))
    except NetnsUnavailable as error:
        raise NetnsUnavailable(
            f"cannot shape {host.interface} with {spec[0]}: {error} The kernel may lack "
            f"the {spec[0]} qdisc (CONFIG_NET_SCH_{spec[0].upper()}); rate alone uses tbf."
        ) from None


def _names(prefix: str) -> tuple[str, str, int]:
    serial = next(_serial)
    tag = f"{prefix}{os.getpid() % 100000}x{serial}"
    return tag, tag[:13], serial % 250


def _build(tag: str, link: str, subnet: int, hosts: list[Host]) -> None:
    for suffix in "ab":
        _ip("netns", "add", f"{tag}{suffix}")
    _ip("link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b")
    for index, suffix in enumerate("ab"):
        host = Host(f"{tag}{suffix}", f"{link}{suffix}", f"10.213.{subnet}.{index + 1}")
        _ip("link", "set", host.interface, "netns", host.namespace)
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
        _ip("-n", host.namespace, "link", "set", host.interface, "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        hosts.append(host)


def kill_inside(namespace: str, remove: bool = False) -> None:
    """SIGKILL every process inside `namespace` (a lost node: its launcher, its workers)."""
    argv = ["ip", "netns", "pids", namespace]
    for pid in subprocess.run(argv, capture_output=True, text=True, check=False).stdout.split():
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    if remove:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def _destroy(tag: str, link: str) -> None:
    """Kill what still runs inside the namespaces (ours by construction), then delete them."""
    subprocess.run(["ip", "link", "del", f"{link}a"], capture_output=True, check=False)
    for suffix in "ab":
        kill_inside(f"{tag}{suffix}", remove=True)


@contextmanager
def two_hosts(
    rate: str | int | None = None, delay: str | float | None = None, prefix: str = "ls"
) -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair, torn down (with anything left inside) on exit.

    Args:
        rate: limit each direction to this rate ('1gbit', or bits per second); None: no limit.
        delay: one-way delay added in each direction ('0.2ms', or seconds); needs netem.
        prefix: start of the namespace names; the process id and a counter make them unique.

    Yields:
        The two `Host`s, addressed 10.213.N.1 and 10.213.N.2 (/24).

    Raises:
        NetnsUnavailable: not root, no iproute2, or the kernel refused (message says which).
    """
    reason = unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    tag, link, subnet = _names(prefix)
    hosts: list[Host] = []
    try:
        _build(tag, link, subnet, hosts)
        if rate is not None or delay is not None:
            for host in hosts:
                shape(host, rate, delay)
        yield hosts[0], hosts[1]
    finally:
        _destroy(tag, link)


def cut(host: Host) -> None:
    """Drop every packet `host` sends on its link (a queue of length 0); `heal` undoes it.

    Cutting both ends of a link is a silent partition: no reset, no error, no packet.
    """
    queue = ["pfifo", "limit", "0"]
    _call(host.command(["tc", "qdisc", "replace", "dev", host.interface, "root", *queue]))


def heal(host: Host) -> None:
    """Let `host` send again after `cut` (removes its qdisc)."""
    shape(host)


def _build_lan(tag: str, link: str, subnet: int, count: int, hosts: list[Host]) -> None:
    switch = f"{tag}s"
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    for index in range(count):
        host = Host(f"{tag}{index}", f"{link}{index}", f"10.214.{subnet}.{index + 1}")
        port = f"{link}p{index}"
        _ip("netns", "add", host.namespace)
        _ip("link", "add", host.interface, "type", "veth", "peer", "name", port)
        _ip("link", "set", host.interface, "netns", host.namespace)
        _ip("link", "set", port, "netns", switch)
        _ip("-n", switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
        _ip("-n", host.namespace, "link", "set", host.interface, "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        hosts.append(host)


@contextmanager
def lan(count: int = 3, prefix: str = "ln") -> Iterator[list[Host]]:
    """`count` namespaces on one switch, addressed 10.214.N.1, 10.214.N.2, ... (/24).

    Raises:
        NetnsUnavailable: as for `two_hosts`, or the kernel has no bridge.
    """
    reason = unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    tag, link, subnet = _names(prefix)
    hosts: list[Host] = []
    try:
        _build_lan(tag, link[:10], subnet, count, hosts)
        yield hosts
    finally:
        for index in range(count):
            kill_inside(f"{tag}{index}", remove=True)
        kill_inside(f"{tag}s", remove=True)
