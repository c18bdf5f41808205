"""Which local address and network interface lead to the master: asked of the kernel, not DNS.

A node's hostname often resolves to 127.0.0.1 or to the wrong interface, and then
the rendezvous and gloo advertise an address the other nodes cannot reach. So
before launching, `lockstep run` asks the routing table which source address a
packet to the master would leave from (a UDP `connect()` sends nothing), and maps
that address to its interface. The launcher gives the address to the rendezvous
and the interface to gloo and NCCL (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Route:
    """How this node reaches the master.

    Attributes:
        local_addr: this node's address on the way to the master (what other nodes dial).
        interface: the interface holding it, or None when it cannot be found.
    """

    local_addr: str
    interface: str | None


def resolve(host: str) -> str:
    """The IP address of `host` (a name or an address); raises socket.gaierror if none."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    families = sorted(infos, key=lambda info: info[0] != socket.AF_INET)  # IPv4 first
    return str(families[0][4][0])


def source_address(master_ip: str) -> str:
    """The local address the kernel would send from to reach `master_ip` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in master_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((master_ip, 9))
        return str(probe.getsockname()[0])


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:  # the interface has no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    """IPv6 address -> interface, from /proc/net/if_inet6 (empty when absent)."""
    table = Path("/proc/net/if_inet6")
    found: dict[str, str] = {}
    if not table.exists():
        return found
    for line in table.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6:
            found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    return found


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address` (its primary address), or None."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    if ip.is_loopback:
        return "lo"
    return None


def route_to(master_ip: str, local_addr: str | None = None) -> Route:
    """The address and interface this node uses towards `master_ip`.

    Args:
        master_ip: the master's IP address (already resolved).
        local_addr: an address chosen by the user; when None, the routing table decides.
    """
    addr = local_addr or source_address(master_ip)
    return Route(local_addr=addr, interface=interface_of(resolve(addr)))


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1."""
    return ipaddress.ip_address(address).is_loopback
