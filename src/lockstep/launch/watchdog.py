"""A last line of defence against a launcher that waits forever on a silent rendezvous store.

A store client blocks without end when its server stops answering without closing
the connection (node 0 frozen, a network partition, or another program listening
on the master port), whatever timeout it was given. The launcher's main thread
calls `pet(doing)` whenever it makes progress; if it does not for `limit_s`, the
watchdog logs what the launcher was doing and ends the process. Workers die with
it (see `lockstep.launch.bootstrap`), so nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger("lockstep.run")
EXIT_CODE = 1


class Watchdog:
    """Ends this process when the main thread stops making progress.

    Args:
        limit_s: seconds without a `pet` before giving up.
        endpoint: the rendezvous store's host:port, for the message.
    """

    def __init__(self, limit_s: float, endpoint: str) -> None:
        self.limit_s = limit_s
        self.endpoint = endpoint
        self._last = time.monotonic()
        self._doing = "starting"
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="lockstep-watchdog", daemon=True).start()

    def pet(self, doing: str) -> None:
        """Record progress; `doing` says what the main thread does next, for the message."""
        self._last = time.monotonic()
        self._doing = doing

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            stalled = time.monotonic() - self._last
            if stalled > self.limit_s:
                log.error(
                    "no progress for %.0f s while %s: the rendezvous store at %s does not "
                    "answer. Node 0 may be frozen, the network between the nodes may be cut, "
                    "or another program may listen on that port. Stopping this node.",
                    stalled,
                    self._doing,
                    self.endpoint,
                )
                sys.stderr.flush()
                os._exit(EXIT_CODE)
