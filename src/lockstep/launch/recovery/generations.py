"""Live-recovery generations, numbered once for the whole job, whichever node claims one.

Every launcher of a live job (`lockstep run --live-recovery`, one node or several)
announces a generation in the round's worker store, which node 0's launcher hosts.
Claiming and announcing are one compare-and-set on `live/keys.py` `GENERATION`: a launcher
reads the announced generation h, checks that every rank of the job joined h (no
recovery is forming), and swaps h for h + 1 with the ranks it replaces. Two nodes that
lose a worker at the same moment both read h; one swap wins, the other finds the
winner's value and falls back. So no number is announced twice and none is skipped.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch.distributed as dist

from lockstep.live import keys


def client(addr: str, port: int, timeout_s: float) -> dist.Store:
    """A launcher's client of the round's worker store (node 0's launcher hosts it)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)


def declared_refusal(store: dist.Store, world_size: int) -> str | None:
    """The first reason a rank of the job posted for not being recoverable, or None."""
    for rank in range(world_size):
        key = keys.READY.format(rank=rank)
        if not store.check([key]):
            return f"rank {rank} had not declared itself recoverable (before its restore())"
        said = store.get(key).decode()
        if said:
            return f"rank {rank}: {said}"
    return None


def _parse(value: bytes) -> tuple[int, list[int]]:
    if not value:
        return 0, []
    found = json.loads(value.decode())
    return int(found["generation"]), [int(r) for r in found["replaced"]]


def joined(store: dist.Store, generation: int, world_size: int) -> bool:
    """Whether every rank of the job posted that it is in `generation` (0: always)."""
    if generation == 0:
        return True
    joined = [keys.JOINED.format(generation=generation, rank=r) for r in range(world_size)]
    return store.check(joined)


def _current(store: dist.Store) -> bytes:
    return store.get(keys.GENERATION) if store.check([keys.GENERATION]) else b""


def announced(store: dist.Store) -> tuple[int, list[int]]:
    """(the announced generation, its replaced ranks); (0, []) before any."""
    return _parse(_current(store))


def claim_refusal(store: dist.Store, world_size: int) -> str | None:
    """Why no generation can be claimed now (the last one is still forming), or None."""
    generation, before = _parse(_current(store))
    if joined(store, generation, world_size):
        return None
    return f"the live recovery of generation {generation} (rank(s) {before}) was still forming"


def claim(store: dist.Store, replaced: list[int], world_size: int) -> int | str:
    """Announce the next generation with `replaced`; returns its number, or why not (a line).

    Args:
        store: a client of the round's worker store.
        replaced: the global ranks this launcher starts again in the new generation.
        world_size: ranks in the job (every node's).
    """
    current = _current(store)
    forming = claim_refusal(store, world_size)
    if forming is not None:
        return f"rank(s) {replaced} failed while {forming}"
    generation, _ = _parse(current)
    desired = json.dumps({"generation": generation + 1, "replaced": replaced})
    now = store.compare_set(keys.GENERATION, current.decode(), desired)
    if now.decode() == desired:
        return generation + 1
    other, theirs = _parse(now)
    return (
        f"rank(s) {replaced} failed while another node announced generation {other} for "
        f"rank(s) {theirs}"
    )
