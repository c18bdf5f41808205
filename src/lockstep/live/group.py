"""The default process group of a live-recovery generation: join it, or re-form it.

Under `lockstep run --live-recovery` the job's group lives in generations. The first
is the one `init()` makes; after a worker is lost, the launcher starts a replacement
and announces generation g in the launcher's worker store (the TCPStore every worker
already dials). Survivors destroy their broken group and make a new gloo group on the
store prefix of generation g; the replacement joins that prefix directly. torch's
default group is the one replaced, so `torch.distributed.*` calls keep working.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

from lockstep import teardown
from lockstep.env import read_variable
from lockstep.live import keys, sealed

LIVE_VARIABLE = "LOCKSTEP_LIVE"  # "1": the launcher replaces a lost worker live
GENERATION_VARIABLE = "LOCKSTEP_LIVE_GENERATION"  # set in a replacement: its generation
POLL_S = 0.05


def live_enabled() -> bool:
    """True when this worker runs under `lockstep run --live-recovery`."""
    return read_variable(LIVE_VARIABLE) == "1"


_received = [False]  # a replacement: set once its state came from a survivor
_joined = [0]  # the generation whose group this process joined last (0: none)


def joining() -> bool:
    """True in a live replacement until a survivor sent it its state (no collectives of
    its own before then: the survivors are inside their step, not in a constructor)."""
    return live_enabled() and start_generation() > 0 and not _received[0]


def mark_received() -> None:
    _received[0] = True


def start_generation() -> int:
    """The generation this process was started in: 0, or a replacement's number."""
    return int(read_variable(GENERATION_VARIABLE) or 0)


def worker_store(timeout: timedelta) -> dist.Store:
    """A client of the launcher's worker store (MASTER_ADDR/MASTER_PORT, as torch's env://)."""
    host = read_variable("MASTER_ADDR") or "127.0.0.1"
    port = int(read_variable("MASTER_PORT") or 0)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)


def join(store: dist.Store, generation: int, rank: int, world_size: int, timeout: timedelta):
    """Make the default gloo group of `generation` (every member calls this).

    torch's function from its own module: in a replacement `torch.distributed`'s name
    is wrapped to come here (`live/torch_init.py`)."""
    distributed_c10d.init_process_group(
        "gloo",
        store=dist.PrefixStore(keys.GROUP.format(generation=generation), store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    _joined[0] = generation


def joined() -> int:
    """The generation whose group this process joined last (0: the job's first, or none)."""
    return _joined[0]


def reform(store: dist.Store, generation: int, timeout: timedelta) -> dist.ProcessGroup:
    """Destroy this survivor's broken default group and join the one of `generation`.

    The broken group is abandoned (`lockstep.teardown.abandon`), never freed: it may hold
    collectives that wait on another survivor for ever, and gloo's destructor would wait
    for them at exit.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    broken = dist.group.WORLD
    dist.destroy_process_group()
    teardown.abandon(broken)
    join(store, generation, rank, world_size, timeout)
    return dist.distributed_c10d._get_default_group()


def parse_announcement(stored: bytes | None) -> tuple[int, list[int]] | None:
    """(generation, replaced ranks) sealed in `stored` (what `keys.GENERATION` holds);
    None when absent, or when it does not open or parse (named once, `live/sealed.py`)."""
    value = sealed.open_value(keys.GENERATION, stored)
    if value is None:
        return None
    try:
        return int(value["generation"]), [int(r) for r in value["replaced"]]
    except (TypeError, KeyError, ValueError):
        sealed.wrong_shape(keys.GENERATION, value, '{"generation": g, "replaced": [ranks]}')
        return None


def announcement(generation: int, replaced: list[int]) -> str:
    """What a launcher stores under `keys.GENERATION`: the generation, sealed."""
    return sealed.seal(keys.GENERATION, {"generation": generation, "replaced": replaced})


def read_announcement(store: dist.Store) -> tuple[int, list[int]]:
    """(generation, replaced ranks) as the launcher announced them; (0, []) before any,
    or when the value there does not open (a stranger's: ignored, named once)."""
    stored = store.get(keys.GENERATION) if store.check([keys.GENERATION]) else None
    return parse_announcement(stored) or (0, [])


def await_generation(store: dist.Store, after: int, timeout_s: float) -> tuple[int, list[int]]:
    """Wait for a generation newer than `after`; raises TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        generation, replaced = read_announcement(store)
        if generation > after:
            return generation, replaced
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no replacement was announced within {timeout_s:.0f} s after generation {after}"
            )
        time.sleep(POLL_S)
