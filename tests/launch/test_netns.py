"""`lockstep.testing.netns`: two hosts on one machine, link counters, a rate-limited link."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lockstep.testing.netns import NetnsUnavailable, delay_ms, rate_bits, shape, two_hosts

pytestmark = pytest.mark.netns
PAYLOAD = 1_000_000
RECEIVER = (
    "import socket\n"
    "server = socket.create_server(('{addr}', 5001))\n"
    "print('ready', flush=True)\n"
    "conn, _ = server.accept()\n"
    "total = 0\n"
    "while chunk := conn.recv(1 << 16):\n"
    "    total += len(chunk)\n"
    "print(total, flush=True)\n"
)
SENDER = (
    "import socket, time\n"
    "conn = socket.create_connection(('{addr}', 5001))\n"
    "start = time.monotonic()\n"
    "conn.sendall(b'x' * {size})\n"
    "conn.shutdown(socket.SHUT_WR)\n"
    "conn.recv(1)\n"  # returns when the receiver has read everything and closed
    "print(time.monotonic() - start)\n"
)


def _transfer(sender, receiver) -> tuple[int, float]:
    """Send PAYLOAD bytes from `sender` to `receiver`; (bytes received, seconds taken)."""
    code = RECEIVER.format(addr=receiver.address)
    rx = receiver.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        code = SENDER.format(addr=receiver.address, size=PAYLOAD)
        tx = sender.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        received = int(rx.communicate(timeout=30)[0])
    finally:
        rx.kill()
    return received, float(tx.stdout)


def test_two_hosts_reach_each_other_only_over_their_link(netns_ready):
    with two_hosts() as (a, b):
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert a.namespace in names and b.namespace in names
        before = a.counters(), b.counters()
        received, _ = _transfer(a, b)
        assert received == PAYLOAD
        assert a.counters().tx_bytes - before[0].tx_bytes >= PAYLOAD
        assert b.counters().rx_bytes - before[1].rx_bytes >= PAYLOAD
        # The host's own loopback is not reachable from inside: each host has its own.
        lo = b.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout
        assert b.address in lo and a.address not in lo
        sleeper = a.popen([sys.executable, "-c", "import time; time.sleep(300)"])
        listed = ["ip", "netns", "pids", a.namespace]
        for _ in range(200):  # `ip netns exec` enters the namespace after popen returns
            if subprocess.run(listed, capture_output=True, text=True).stdout.split():
                break
            time.sleep(0.05)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a.namespace not in names and b.namespace not in names
    assert sleeper.wait(timeout=10) != 0  # what ran inside was stopped with the hosts


def test_rate_limit_slows_the_link(netns_ready):
    rate = "20mbit"
    with two_hosts(rate=rate) as (a, b):
        qdisc = a.run(["tc", "qdisc", "show", "dev", a.interface], capture_output=True, text=True)
        assert "tbf" in qdisc.stdout and "20Mbit" in qdisc.stdout
        received, seconds = _transfer(a, b)
    assert received == PAYLOAD
    # A lower bound only: a busy machine can make it slower, never faster.
    assert seconds >= 0.8 * PAYLOAD * 8 / rate_bits(rate)


def test_delay_needs_netem_and_says_so(netns_ready):
    with two_hosts() as (a, _):
        try:
            shape(a, rate="1gbit", delay="0.2ms")
        except NetnsUnavailable as error:
            assert "netem" in str(error)
        else:
            qdisc = a.run(["tc", "qdisc", "show", "dev", a.interface], capture_output=True)
            assert b"netem" in qdisc.stdout


def test_units():
    assert rate_bits("1gbit") == 10**9
    assert rate_bits("200mbit") == 200 * 10**6
    assert rate_bits("10mbps") == 80 * 10**6
    assert delay_ms("0.2ms") == pytest.approx(0.2)
    assert delay_ms("50us") == pytest.approx(0.05)
    assert delay_ms(0.001) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="has no unit"):
        rate_bits("1000")
