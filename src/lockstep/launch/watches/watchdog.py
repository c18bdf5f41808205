"""A last line of defence against a launcher that waits forever on a silent rendezvous store.

A store client blocks without end when its server stops answering without closing
the connection (node 0 frozen, a network partition, or another program listening
on the master port), whatever timeout it was given. The launcher's main thread
calls `pet(doing, allow_s)` before each step; if the step takes longer than
allowed (plus a margin), the watchdog logs what the launcher was doing and ends
the process. Workers die with
it (see `lockstep.launch.supervise.bootstrap`), so nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("lockstep.run")
EXIT_CODE = 1


class Watchdog:
    """Ends this process when the main thread stops making progress.

    Args:
        endpoint: the rendezvous store's host:port, for the message.
        step_s: how long a step may take when `pet` names no other bound.
        margin_s: slack added to every bound (a loaded machine is slow).
        on_exit: called just before the process ends (cleanup that must not be skipped).
    """

    def __init__(
        self,
        endpoint: str,
        step_s: float = 30.0,
        margin_s: float = 10.0,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._on_exit = on_exit
        self.step_s = step_s
        self.margin_s = margin_s
        self._deadline = time.monotonic() + step_s + margin_s
        self._since = time.monotonic()
        self._doing = "starting"
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="lockstep-watchdog", daemon=True).start()

    def pet(self, doing: str, allow_s: float | None = None) -> None:
        """Record progress: next comes `doing`, which may take `allow_s` (default `step_s`)."""
        now = time.monotonic()
        self._since = now
        self._deadline = now + (self.step_s if allow_s is None else allow_s) + self.margin_s
        self._doing = doing

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            if time.monotonic() > self._deadline:
                log.error(
                    "no progress for %.0f s while %s: the rendezvous store at %s does not "
                    "answer. Node 0 may be frozen, the network between the nodes may be cut, "
                    "or another program may listen on that port. Stopping this node.",
                    time.monotonic() - self._since,
                    self._doing,
                    self.endpoint,
                )
                sys.stderr.flush()
                if self._on_exit is not None:
                    self._on_exit()
                os._exit(EXIT_CODE)
