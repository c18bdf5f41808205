"""Bounds on what node 0's stores hold: a flood of keys is named, and ends the job.

torch's TCPStore server keeps every key anyone who reaches its port sets: one value
is capped (8 MiB), their number is not, and the server lives in node 0's launcher,
so a host on the network can fill that launcher's memory in seconds. lockstep's own
keys are a few dozen per round. Node 0 looks every `CHECK_S` at the number of keys
in the stores it hosts (the launchers' and the round's workers') and at how much its
launcher's resident memory grew since it started; past `MAX_KEYS` or
`MAX_GROWTH_BYTES` it ends the job with a line that names the flood, before the
memory runs out (`StoreFloodError`). Only a firewall keeps the flood out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from lockstep.errors import LockstepError

MAX_KEYS = 100_000  # in one store; lockstep's own: a few dozen per round
MAX_GROWTH_BYTES = 512 << 20  # node 0's launcher, since it started
CHECK_S = 0.5
FIREWALL_DOC = "docs/design/store-security.md"


class StoreFloodError(LockstepError):
    """A store node 0 hosts holds more keys, or its launcher more memory, than the bounds."""


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class FloodWatch:
    """Node 0's bounds on its stores, checked at most every `CHECK_S`.

    Args:
        endpoint: the launchers' store, for the message.
        max_keys, max_growth_bytes: the bounds (`MAX_KEYS`, `MAX_GROWTH_BYTES`).
    """

    def __init__(
        self, endpoint: str, max_keys: int = MAX_KEYS, max_growth_bytes: int = MAX_GROWTH_BYTES
    ) -> None:
        self.endpoint = endpoint
        self.max_keys, self.max_growth_bytes = max_keys, max_growth_bytes
        self._base = resident_bytes()
        self._checked = 0.0

    def look(self, store: Any, workers: Any | None) -> None:
        """Check the launchers' store (a `BoundedStore`) and the round's worker store."""
        counts = {"the launchers' store": lambda: int(store.call("num_keys"))}
        if workers is not None:
            counts["the round's worker store"] = workers.num_keys
        self.check(counts)

    def check(self, counts: dict[str, Callable[[], int]]) -> None:
        """Count the keys of each store (`counts`: its name, a call that counts them).

        Raises:
            StoreFloodError: a store holds more than `max_keys` keys, or this launcher
                grew by more than `max_growth_bytes`.
        """
        if time.monotonic() - self._checked < CHECK_S:
            return
        self._checked = time.monotonic()
        grown = resident_bytes() - self._base
        found = {name: count() for name, count in counts.items()}
        over = {name: n for name, n in found.items() if n > self.max_keys}
        if not over and grown <= self.max_growth_bytes:
            return
        held = ", ".join(f"{name}: {n} keys" for name, n in found.items())
        raise StoreFloodError(
            f"node 0's stores are flooded ({held}; the launcher's memory grew by "
            f"{grown >> 20} MiB since it started; bounds: {self.max_keys} keys per store, "
            f"{self.max_growth_bytes >> 20} MiB): a host on the network writes keys into the "
            f"store at {self.endpoint} (lockstep's own are a few dozen per round). The job "
            "ends here, before node 0 runs out of memory; allow the store's port to the "
            f"training nodes only ({FIREWALL_DOC}), then start it again."
        )
