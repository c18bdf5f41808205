"""Values in the launchers' store that this job did not seal: ignored, counted and named.

A value under one of the job's keys that does not open (`secret.Signer.inspect`) is
a forgery, a value replayed from another job, round or key, or the work of a node
given another secret. The first two are ignored, and when they keep coming a line
says so (a host on the network writes into the store: firewall it), so that what
they disturb is not blamed on the network. A node's own values sealed with another
secret are named as such within seconds (`SecretMismatchError`), on both sides.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousError

from lockstep.launch.rendezvous.secret import Opened, Seal, Signer

log = logging.getLogger("lockstep.run")
WINDOW_S = 10.0  # sightings counted over this long
REPEAT = 3  # this many sightings of one key in the window: "keep appearing"
QUIET_S = 30.0  # one such line at most this often
MISMATCH_S = 2.0  # another secret seen this long, every look, ends the rendezvous
SECURITY_DOC = "docs/design/store-security.md"


class SecretMismatchError(RendezvousError):
    """Another node of this job seals its values with another secret."""


class ForeignValues:
    """The values of this job's keys that did not open, by key, over the last `WINDOW_S` s.

    Args:
        me: this node's rank; fingerprint: its secret's (both for the mismatch line).
    """

    def __init__(self, me: int, fingerprint: str) -> None:
        self._me, self._fingerprint = me, fingerprint
        self._seen: dict[str, deque[tuple[float, Seal]]] = {}
        self._said = -QUIET_S
        self._other_since: dict[str, float] = {}
        self._said_hello = 0.0

    def note(self, key: str, opened: Opened) -> None:
        """Count `opened` (read under `key`) when it is present but not ours; log a run of them."""
        if opened.seal in (Seal.ABSENT, Seal.OPEN):
            return
        now = time.monotonic()
        seen = self._seen.setdefault(key, deque())
        seen.append((now, opened.seal))
        while seen and now - seen[0][0] > WINDOW_S:
            seen.popleft()
        if len(seen) >= REPEAT and now - self._said >= QUIET_S:
            self._said = now
            log.warning("%s", self.line())

    def count(self, fragment: str) -> int:
        """Sightings in the window under keys that contain `fragment`."""
        now = time.monotonic()
        return sum(
            sum(1 for when, _ in seen if now - when <= WINDOW_S)
            for key, seen in self._seen.items()
            if fragment in key
        )

    def line(self) -> str:
        """'values not sealed for this job keep appearing under KEY (...)', the busiest keys."""
        now = time.monotonic()
        counts = {k: sum(now - t <= WINDOW_S for t, _ in seen) for k, seen in self._seen.items()}
        keys = sorted((k for k in counts if counts[k]), key=lambda k: -counts[k])
        named = ", ".join(
            f"{k} ({counts[k]}, the latest {self._seen[k][-1][1].value})" for k in keys[:3]
        )
        more = f" and {len(keys) - 3} more key(s)" if len(keys) > 3 else ""
        return (
            f"values not sealed for this job keep appearing in the last {WINDOW_S:.0f} s under "
            f"{named}{more}: they are ignored. A host on the network writes into the "
            "launchers' store (values replayed from another job or round, or forged): allow "
            f"the store's port to the training nodes only ({SECURITY_DOC})"
        )

    def where(self, fragment: str) -> str:
        """' (meanwhile N values not sealed for this job ...)' for keys with `fragment`, or ''."""
        count = self.count(fragment)
        if not count:
            return ""
        return (
            f"; meanwhile {count} value(s) not sealed for this job appeared there in the last "
            f"{WINDOW_S:.0f} s: a host on the network writes into the store ({SECURITY_DOC})"
        )

    def say_hello(self, store: Any, signer: Signer, key: str, me: dict) -> None:
        """A node other than 0, waiting for a round: post `me`, sealed, under `key` (at most
        once a second), so that node 0 tells a secret that differs from a silent node."""
        if time.monotonic() - self._said_hello >= 1.0:
            self._said_hello = time.monotonic()
            store.call("set", key, signer.seal(key, me))

    def check_hello(self, store: Any, signer: Signer, key: str, node: int, where: str) -> None:
        """Node 0: raise when node `node`'s hello (`key`) keeps reading as another secret's."""
        hello = signer.inspect(key, store.read(key))
        self.check_secret(key, hello, f"node {node}", f"node {node}'s announcement at {where}")

    def check_secret(self, source: str, opened: Opened, other: str, what: str) -> None:
        """Raise once `source` (`what`, written by node `other`) read as sealed with another
        secret for `MISMATCH_S` s at every look (one stray value, a stranger's, does not
        end the job).

        Raises:
            SecretMismatchError: the node behind `source` seals with another secret.
        """
        if opened.seal is not Seal.OTHER_SECRET:
            self._other_since.pop(source, None)
            return
        since = self._other_since.setdefault(source, time.monotonic())
        if time.monotonic() - since >= MISMATCH_S:
            raise SecretMismatchError(
                f"node {self._me}: the job secret differs from {other}'s: {what} is sealed with "
                f"a secret whose fingerprint is {opened.fingerprint}, and this node's is "
                f"{self._fingerprint}. Give every node the same LOCKSTEP_JOB_SECRET or "
                "--secret-file (the fingerprint, an HMAC of a constant, reveals nothing of the "
                "secret). If every node has the same secret, another host writes into the "
                f"store: allow its port to the training nodes only ({SECURITY_DOC})."
            )
