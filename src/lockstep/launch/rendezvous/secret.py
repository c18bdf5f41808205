"""The job's secret, and the seal (HMAC-SHA256) on every value lockstep writes to the store.

Anyone who reaches the rendezvous port can read and write the store: torch's TCPStore
has no authentication. So every value the launchers act on (rendezvous claims,
failure reports, heartbeats) is JSON sealed with an HMAC of the job's secret over
the key and the text (RFC 2104, stdlib `hmac`); a value that does not open is
ignored. One node alone generates its secret; several nodes share one given by
the user (LOCKSTEP_JOB_SECRET, or --secret-file on a shared file system).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from lockstep.env import read_variable
from lockstep.errors import LockstepError

SECRET_VARIABLE = "LOCKSTEP_JOB_SECRET"
MIN_SECRET_CHARS = 16
FINGERPRINT_TEXT = b"lockstep job secret fingerprint"


class SecretError(LockstepError):
    """No usable job secret: the message says where lockstep looked and what to do."""


def load_secret(nnodes: int, secret_file: str | None, node_rank: int = 0) -> bytes:
    """The job's secret: --secret-file, else LOCKSTEP_JOB_SECRET, else (one node) a new one.

    The secret ends up in this process's LOCKSTEP_JOB_SECRET, which the workers inherit.

    Raises:
        SecretError: several nodes and no secret given, or one too short to guess-proof.
    """
    if secret_file:
        text = _read_secret_file(Path(secret_file), node_rank)
    else:
        text = (read_variable(SECRET_VARIABLE) or "").strip()
    if not text and nnodes == 1:
        text = secrets.token_hex(32)
    if not text:
        raise SecretError(
            f"node {node_rank}: a job on {nnodes} nodes needs a shared secret, so that no "
            "other host on the network can forge messages in its rendezvous store. Set "
            f"{SECRET_VARIABLE} to the same value on every node (for example "
            "`export LOCKSTEP_JOB_SECRET=$(openssl rand -hex 32)` in the job script), or pass "
            "--secret-file with a file every node reads (mode 600, on a shared file system)."
        )
    if len(text) < MIN_SECRET_CHARS:
        raise SecretError(
            f"node {node_rank}: the job secret has {len(text)} characters; expected at least "
            f"{MIN_SECRET_CHARS} (for example `openssl rand -hex 32`)."
        )
    os.environ[SECRET_VARIABLE] = text
    return text.encode()


def _read_secret_file(path: Path, node_rank: int) -> str:
    """The text of --secret-file: one line, readable by its owner alone.

    A secret that others on the machine (or the shared file system) can read lets
    them forge every value of the job, so a file with any group or other permission
    is refused, as ssh refuses such a private key; the fix is one `chmod`.
    """
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as error:
        raise SecretError(
            f"node {node_rank} cannot read --secret-file {path}: {error.strerror}"
        ) from None
    if mode & 0o077:
        raise SecretError(
            f"node {node_rank}: --secret-file {path} has mode {stat.S_IMODE(mode):o}, so other "
            f"users can read or change the job's secret; expected 600. Run `chmod 600 {path}`."
        )
    text = data.decode("utf-8", errors="replace")
    if "\ufffd" in text or "\0" in text:
        at = min(i for i, c in enumerate(text) if c in "\ufffd\0")
        raise SecretError(
            f"node {node_rank}: --secret-file {path} is not text (a byte that is not UTF-8 or "
            f"a NUL at character {at}); expected one line, for example written by "
            f"`openssl rand -hex 32 > {path}`."
        )
    return text.strip()


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
