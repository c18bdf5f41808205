"""Live-recovery generations, numbered once for the whole job, whichever node claims one.

Every launcher of a live job (`lockstep run --live-recovery`, one node or several)
announces a generation in the round's worker store, which node 0's launcher hosts.
Claiming and announcing are one compare-and-set on `live/keys.py` `GENERATION`: a launcher
reads the announced generation h, checks that every rank of the job joined h (no
recovery is forming), and swaps h for h + 1 with the ranks it replaces. Two nodes that
lose a worker at the same moment both read h; one swap wins, the other finds the
winner's value and falls back. So no number is announced twice and none is skipped.

Every value here is sealed for the job's launch and round (`live/sealed.py`): a
forged or garbage generation is ignored with a line (the swap replaces it), a
launcher never goes below the highest generation it announced itself, and a
`READY` or `JOINED` that does not open counts as not posted.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from lockstep.live import group as live_group
from lockstep.live import keys, sealed


def client(addr: str, port: int, timeout_s: float) -> dist.Store:
    """A launcher's client of the round's worker store (node 0's launcher hosts it)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)


def declared_refusal(store: dist.Store, world_size: int) -> str | None:
    """The first reason a rank of the job posted for not being recoverable, or None."""
    for rank in range(world_size):
        key = keys.READY.format(rank=rank)
        said = sealed.read(store, key)
        if not isinstance(said, str):  # absent, or a stranger's (named)
            return f"rank {rank} had not declared itself recoverable (before its restore())"
        if said:
            return f"rank {rank}: {said}"
    return None


def _parse(value: bytes, known: int) -> tuple[int, list[int]]:
    """The announced (generation, replaced); at least `known` (this launcher's own)."""
    generation, replaced = live_group.parse_announcement(value) or (0, [])
    return (generation, replaced) if generation >= known else (known, [])


def joined(store: dist.Store, generation: int, world_size: int) -> bool:
    """Whether every rank of the job posted that it is in `generation` (0: always)."""
    if generation == 0:
        return True
    joined = [keys.JOINED.format(generation=generation, rank=r) for r in range(world_size)]
    return store.check(joined) and all(sealed.read(store, key) == 1 for key in joined)


def _current(store: dist.Store) -> bytes:
    return store.get(keys.GENERATION) if store.check([keys.GENERATION]) else b""


def announced(store: dist.Store) -> tuple[int, list[int]]:
    """(the announced generation, its replaced ranks); (0, []) before any."""
    return _parse(_current(store), 0)


def claim_refusal(store: dist.Store, world_size: int, known: int = 0) -> str | None:
    """Why no generation can be claimed now (the last one is still forming), or None."""
    generation, before = _parse(_current(store), known)
    if joined(store, generation, world_size):
        return None
    return f"the live recovery of generation {generation} (rank(s) {before}) was still forming"


def claim(store: dist.Store, replaced: list[int], world_size: int, known: int = 0) -> int | str:
    """Announce the next generation with `replaced`; returns its number, or why not (a line).

    Args:
        store: a client of the round's worker store.
        replaced: the global ranks this launcher starts again in the new generation.
        world_size: ranks in the job (every node's).
        known: the last generation this launcher announced (a value below it, replayed
            by a stranger, is not believed).
    """
    current = _current(store)
    forming = claim_refusal(store, world_size, known)
    if forming is not None:
        return f"rank(s) {replaced} failed while {forming}"
    generation, _ = _parse(current, known)
    desired = live_group.announcement(generation + 1, replaced)
    now = store.compare_set(keys.GENERATION, current, desired)  # bytes: whatever is there
    if now.decode(errors="replace") == desired:
        return generation + 1
    other, theirs = _parse(now, 0)
    return (
        f"rank(s) {replaced} failed while another node announced generation {other} for "
        f"rank(s) {theirs}"
    )
