"""The job's secret: given by the user on several nodes, drawn by the launcher on one.

Anyone who reaches the rendezvous port can read and write the store: torch's TCPStore
has no authentication. So every value the launchers and the live workers act on is
sealed with an HMAC of the job's secret (`lockstep/seal.py`, re-exported here); a
value that does not open is ignored. One node alone generates its secret; several
nodes share one given by the user (LOCKSTEP_JOB_SECRET, or --secret-file on a shared
file system). The workers inherit it in LOCKSTEP_JOB_SECRET.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from lockstep.env import read_variable
from lockstep.errors import LockstepError
from lockstep.seal import Opened, Seal, Signer

__all__ = ["Opened", "Seal", "SecretError", "Signer", "load_secret"]

SECRET_VARIABLE = "LOCKSTEP_JOB_SECRET"
MIN_SECRET_CHARS = 16


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
