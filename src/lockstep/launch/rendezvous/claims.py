"""What the rendezvous' sealed values hold: who claims a node, the round node 0 opened.

Every value read from the store is parsed here, defensively: a value of the wrong
shape (even one sealed with the job's secret) is None, never an exception, so no
launcher stops on what it reads (`launch/rendezvous/rounds.py` acts on these).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousError


@dataclass(frozen=True)
class NodeInfo:
    """Who a node is: its --node-rank, host name and address towards the master."""

    node_rank: int
    host: str
    addr: str


class NodeRankRendezvousError(RendezvousError):
    """The nodes that met do not hold distinct --node-rank values in [0, nnodes)."""


def fields(data: dict) -> dict:
    """The `NodeInfo` fields of a claim."""
    return {name: data[name] for name in ("node_rank", "host", "addr")}


def node_of(data: Any) -> tuple[NodeInfo, str] | None:
    """(who, nonce) of a claim, a contest or an echo; None when it is not one."""
    try:
        info = NodeInfo(**fields(data))
        nonce = data["nonce"]
    except (TypeError, KeyError):
        return None
    ok = isinstance(info.node_rank, int) and isinstance(nonce, str)
    return (info, nonce) if ok else None


def round_of(data: Any) -> dict | None:
    """The `open` value when it is one: {"round": int, "job": str, "worker_store": [addr, port]}."""
    if not isinstance(data, dict):
        return None
    where = data.get("worker_store")
    if not (isinstance(data.get("round"), int) and isinstance(data.get("job"), str)):
        return None
    if not (isinstance(where, list) and len(where) == 2 and isinstance(where[1], int)):
        return None
    return data


def describe(node: int, info: NodeInfo | None) -> str:
    """'1 (host, addr)', or '1' when the node is not known."""
    return f"{node} ({info.host}, {info.addr})" if info else str(node)


def duplicate_message(first: NodeInfo, second: NodeInfo, nnodes: int) -> str:
    """The line that names two launchers started with one --node-rank."""
    return (
        f"two nodes were started with --node-rank {second.node_rank}: {first.host} "
        f"({first.addr}) and {second.host} ({second.addr}); expected each of "
        f"0..{nnodes - 1} exactly once. Fix the --node-rank of one of them."
    )


def next_round(claim: Any) -> int:
    """The round a claimant would take next in this job (0 for a claim without one)."""
    later = claim.get("next_round") if isinstance(claim, dict) else None
    return later if isinstance(later, int) and not isinstance(later, bool) else 0
