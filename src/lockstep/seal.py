"""The seal on a value in a store: HMAC-SHA256 of the job's secret over its key and content.

torch's TCPStore has no authentication: whoever reaches its port can read and write
any key. So every value lockstep acts on is sealed with the job's secret over the key
it is stored under and its content (RFC 2104, stdlib `hmac`), and a value that does
not open is ignored. The key may name more than where the value lies (the launch's
nonce, the rendezvous round: `launch/rendezvous/rounds.py`, `live/sealed.py`), so a
value sealed for another job or round never opens. The secret itself is
`launch/rendezvous/secret.py`'s; here only the seal, which the workers use too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

FINGERPRINT_TEXT = b"lockstep job secret fingerprint"
BYTES_MAGIC = b"lockstep-seal1:"  # a sealed byte string opens with this
_FINGERPRINT_CHARS = 16
_MAC_CHARS = 64


class Seal(Enum):
    """What a value read from the store turned out to be."""

    ABSENT = "absent"
    OPEN = "sealed for this key with the job's secret"
    OTHER_SECRET = "sealed with another secret"
    NOT_OURS = "sealed for another key, job or round, or forged"
    MALFORMED = "not a sealed value"
    DELETED = "deleted (lockstep deletes no key of a round)"


@dataclass(frozen=True)
class Opened:
    """A value read from the store: its seal, its value (OPEN only), its secret's fingerprint."""

    seal: Seal
    value: Any = None
    fingerprint: str = ""


class Signer:
    """Seals values with the job's secret, and opens only those it sealed.

    Every sealed value also carries the secret's fingerprint (an HMAC of a constant:
    it tells secrets apart without revealing them), so a node whose secret differs
    is named as such instead of looking like a node that never wrote.
    """

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self.fingerprint = hmac.new(secret, FINGERPRINT_TEXT, hashlib.sha256).hexdigest()[:16]

    def _mac(self, key: str, text: str) -> str:
        message = key.encode() + b"\0" + text.encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def seal(self, key: str, value: Any) -> str:
        """`value` as JSON, with the HMAC of (key, JSON): the value to store under `key`."""
        text = json.dumps(value, sort_keys=True)
        return json.dumps({"v": text, "mac": self._mac(key, text), "id": self.fingerprint})

    def open(self, key: str, stored: str | bytes | None) -> Any | None:
        """The value sealed under `key`; None when absent, malformed or not sealed by us."""
        return self.inspect(key, stored).value

    def inspect(self, key: str, stored: str | bytes | None) -> Opened:
        """What `stored` (read under `key`) is: our sealed value, or why it is not one."""
        if not stored:
            return Opened(Seal.ABSENT)
        try:
            outer = json.loads(stored)
            text, mac = outer["v"], outer["mac"]
            if not (isinstance(text, str) and isinstance(mac, str)):
                return Opened(Seal.MALFORMED)
            if hmac.compare_digest(mac, self._mac(key, text)):
                return Opened(Seal.OPEN, json.loads(text), self.fingerprint)
            theirs = outer.get("id")
            if isinstance(theirs, str) and theirs != self.fingerprint:
                return Opened(Seal.OTHER_SECRET, None, theirs[:16])
            return Opened(Seal.NOT_OURS, None, self.fingerprint)
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            return Opened(Seal.MALFORMED)

    def seal_bytes(self, key: str, data: bytes) -> bytes:
        """`data` (any bytes: a packed tensor state) with the HMAC of (key, data).

        One HMAC-SHA256 pass over the bytes (about 1 GB/s): cheap enough for a post in
        every step (`live/sealed.py` measures it).
        """
        mac = self._mac_bytes(key, data)
        return b"".join((BYTES_MAGIC, self.fingerprint.encode(), mac, data))

    def _mac_bytes(self, key: str, data: bytes) -> bytes:
        """The hex HMAC of (key, data), with no copy of `data`."""
        mac = hmac.new(self._secret, key.encode() + b"\0", hashlib.sha256)
        mac.update(data)
        return mac.hexdigest().encode()

    def inspect_bytes(self, key: str, stored: bytes | None) -> Opened:
        """What `stored` (read under `key`) is: our sealed bytes (the value), or why not."""
        if not stored:
            return Opened(Seal.ABSENT)
        head = len(BYTES_MAGIC) + _FINGERPRINT_CHARS + _MAC_CHARS
        if not stored.startswith(BYTES_MAGIC) or len(stored) < head:
            return Opened(Seal.MALFORMED)
        theirs = stored[len(BYTES_MAGIC) : len(BYTES_MAGIC) + _FINGERPRINT_CHARS]
        mac, data = stored[head - _MAC_CHARS : head], stored[head:]
        if hmac.compare_digest(mac, self._mac_bytes(key, data)):
            return Opened(Seal.OPEN, data, self.fingerprint)
        fingerprint = theirs.decode(errors="replace")
        if fingerprint != self.fingerprint:
            return Opened(Seal.OTHER_SECRET, None, fingerprint)
        return Opened(Seal.NOT_OURS, None, self.fingerprint)
