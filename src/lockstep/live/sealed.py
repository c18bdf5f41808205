"""Live recovery's values in the worker store, sealed for this job's launch and round.

The worker store (node 0's launcher hosts it, every worker dials it) is a TCPStore:
whoever reaches its port can write any key. So every value live recovery acts on
(`live/keys.py`: the generation, who is recoverable and joined, where the survivors
stand, the random state and buffers, the script's end) is sealed with the job's
secret (`lockstep/seal.py`) over its key bound to the launch's nonce and the
rendezvous round, which the launcher gives its workers in their environment (never
on a command line): a forged value, garbage, or a value of another job or round
does not open. Every read is defensive: a value that does not open or has the wrong
shape is ignored, named once per key in one line: what the store holds never raises.

torch's own keys under a generation's group prefix (`keys.GROUP`) stay unsealed:
torch's gloo rendezvous reads them (a stranger can delay a group's forming there,
until its timeout, but not steer it).
"""

from __future__ import annotations

import json
import logging
from functools import cache
from typing import Any

import torch.distributed as dist

from lockstep.env import read_variable
from lockstep.errors import LockstepError
from lockstep.live import lines
from lockstep.seal import Opened, Seal, Signer

SECRET_VARIABLE = "LOCKSTEP_JOB_SECRET"  # `launch/rendezvous/secret.py`'s
NONCE_VARIABLE = "LOCKSTEP_JOB_NONCE"  # node 0's nonce for this launch
ROUND_VARIABLE = "LOCKSTEP_JOB_ROUND"  # the rendezvous round the workers run in
SHOWN_CHARS = 40

_named: set[tuple[str, Seal | str]] = set()  # (key, what was found): each named once


def variables(job: str, round_: int) -> dict[str, str]:
    """The launcher's: what its workers need to seal and open (with the secret it set)."""
    return {NONCE_VARIABLE: job, ROUND_VARIABLE: str(round_)}


@cache
def _signer(secret: str) -> Signer:
    return Signer(secret.encode())


def _binding() -> tuple[Signer, str]:
    """The job's signer and what every key is bound to ("<nonce>/r<round>/")."""
    secret = read_variable(SECRET_VARIABLE)
    if not secret:
        raise LockstepError(
            f"live recovery: {SECRET_VARIABLE} is not set in this process; expected the one "
            "`lockstep run --live-recovery` gives its workers (the store's values are sealed "
            "with it). Start the script with `lockstep run`."
        )
    job = read_variable(NONCE_VARIABLE) or ""
    return _signer(secret), f"{job}/r{read_variable(ROUND_VARIABLE) or '0'}/"


def _bound(key: str) -> tuple[Signer, str]:
    signer, prefix = _binding()
    return signer, prefix + key


def seal(key: str, value: Any) -> str:
    """`value` (JSON) sealed for `key` in this launch and round: what to store under it."""
    signer, bound = _bound(key)
    return signer.seal(bound, value)


def put(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, seal(key, value))


def put_bytes(store: dist.Store, key: str, data: bytes) -> None:
    """Bytes (a packed state) sealed for `key` in this launch and round."""
    signer, bound = _bound(key)
    store.set(key, signer.seal_bytes(bound, data))


def open_value(key: str, stored: bytes | None) -> Any | None:
    """The JSON value sealed under `key`, or None (absent; anything else is named)."""
    signer, bound = _bound(key)
    opened = signer.inspect(bound, stored)
    return opened.value if _opens(key, opened, stored) else None


def read(store: dist.Store, key: str) -> Any | None:
    """The JSON value sealed under `key` in the store, or None (absent, or named)."""
    return open_value(key, store.get(key)) if store.check([key]) else None


def read_bytes(store: dist.Store, key: str) -> bytes | None:
    """The bytes sealed under `key` in the store, or None (absent, or named)."""
    if not store.check([key]):
        return None
    stored = store.get(key)
    signer, bound = _bound(key)
    opened = signer.inspect_bytes(bound, stored)
    return opened.value if _opens(key, opened, stored) else None


def wrong_shape(key: str, value: Any, expected: str) -> None:
    """A value that opened but is not what its key holds: named once (ignored)."""
    shown = json.dumps(value)[:SHOWN_CHARS]
    _name(key, "shape", f"a sealed value of the wrong shape ({shown}; expected {expected})")


def _opens(key: str, opened: Opened, stored: bytes | None) -> bool:
    if opened.seal is Seal.OPEN:
        return True
    if opened.seal is not Seal.ABSENT:
        found = repr(bytes(stored or b"")[:SHOWN_CHARS])
        _name(key, opened.seal, f"{found}, {opened.seal.value}")
    return False


def _name(key: str, kind: Seal | str, found: str) -> None:
    if (key, kind) in _named:
        return
    _named.add((key, kind))
    line = lines.ignored(key, found)
    if read_variable("RANK") is None:  # a launcher: its log
        logging.getLogger("lockstep.run").warning("live recovery: %s", line)
    else:
        lines.say(line)
