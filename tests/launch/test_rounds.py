"""The sealed rendezvous on a real store (loopback), without launchers: one job, one round.

Two jobs share a secret, as a `--secret-file` on a shared file system invites. What
a host copies from the first job's store (the round node 0 opened and confirmed, a
failure report, a heartbeat) and writes into the second's must not move it: node 1
joins the second job's round, and the copied report and heartbeat do not open.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousInfo

from lockstep.launch.rendezvous.claims import NodeInfo
from lockstep.launch.rendezvous.rounds import LockstepRendezvous
from lockstep.launch.rendezvous.secret import Signer
from lockstep.launch.rendezvous.store import BoundedStore, host
from lockstep.launch.supervise import group

SECRET = b"one-secret-for-two-jobs-0123"


def _node(port: int, rank: int) -> LockstepRendezvous:
    me = NodeInfo(rank, f"host{rank}", "127.0.0.1")
    return LockstepRendezvous(
        BoundedStore("127.0.0.1", port, 5), Signer(SECRET), me, 2, "lockstep", 20
    )


def _join(node: LockstepRendezvous, into: dict[int, Any]) -> threading.Thread:
    def run() -> None:
        try:
            into[node.me.node_rank] = node.next_rendezvous()
        except Exception as error:  # handed to the test
            into[node.me.node_rank] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _read(node: LockstepRendezvous, key: str) -> bytes:
    value = node.store.read(key)
    assert value is not None, key
    return value


def test_values_copied_from_an_earlier_job_with_the_same_secret_do_not_move_the_next(caplog):
    caplog.set_level(logging.WARNING, logger="lockstep.run")
    server_a, port_a = host("127.0.0.1", 0, 20)
    a0, a1 = _node(port_a, 0), _node(port_a, 1)
    formed: dict[int, Any] = {}
    for thread in [_join(a0, formed), _join(a1, formed)]:
        thread.join(30)
    assert all(isinstance(formed[n], RendezvousInfo) for n in (0, 1)), formed
    group.post(a1, group.NodeReport(1, "host1", "127.0.0.1", "workers failed", [], final=True))
    a1.put(group.ALIVE_KEY.format(node=1), 10_000)
    names = ["node/0", "node/1", "start", "report/1", group.ALIVE_KEY.format(node=1)]
    copied = {
        a0.key(name): _read(a0, a0.key(name)) for name in names if a0.store.read(a0.key(name))
    }
    opened_a = _read(a0, "lockstep/lockstep/open")

    server_b, port_b = host("127.0.0.1", 0, 20)
    b0, b1 = _node(port_b, 0), _node(port_b, 1)
    joined: dict[int, Any] = {}
    first = _join(b0, joined)
    while b0.store.read("lockstep/lockstep/open") is None:
        threading.Event().wait(0.05)
    b0.store.call("set", "lockstep/lockstep/open", opened_a)  # the earlier round, confirmed
    for key, value in copied.items():
        if value is not None:
            b0.store.call("set", key, value)
    second = _join(b1, joined)
    for thread in (first, second):
        thread.join(30)
    assert all(isinstance(joined[n], RendezvousInfo) for n in (0, 1)), joined
    b_port = joined[0].bootstrap_store_info.master_port
    assert joined[1].bootstrap_store_info.master_port == b_port  # node 0's worker store of job B
    assert b_port != formed[0].bootstrap_store_info.master_port

    # The earlier job's report and heartbeat, written under this round's own keys.
    b0.store.call("set", b0.key("report/1"), copied[a0.key("report/1")])
    b0.store.call("set", b0.key(group.ALIVE_KEY.format(node=1)), copied[a0.key("alive/1")])
    for _ in range(3):  # as the agent reads them, every 0.1 s
        assert group.read_reports(b0, 2) == {}
        assert b0.take(group.ALIVE_KEY.format(node=1)) is None
    assert "values not sealed for this job keep appearing" in caplog.text
    for node in (a0, a1, b0, b1):
        node.shutdown()
    del server_a, server_b
