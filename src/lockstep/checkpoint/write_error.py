"""Why a checkpoint write failed, in words a user can act on.

torch.save reports a full disk as a zip-writer error ("unexpected pos 9408 vs
9302") with the real OSError only in its context. `CheckpointFiles.write` calls
`describe_write_failure` after removing its partial file: it finds that OSError,
counts the bytes the checkpoint needs, reads the free space of the file system,
and says which checkpoint stays the restore point.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch


class _ByteCounter:
    """A write-only sink that counts what torch.save would write (to report the size)."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def os_cause(error: BaseException) -> OSError | None:
    """The OSError behind `error` (torch's zip writer hides ENOSPC in the context)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def describe_write_failure(
    final: Path, payload: dict[str, Any], committed: int | None, error: Exception
) -> str:
    """What failed, why, the bytes needed and free, what survived, and what to do.

    Args:
        final: the checkpoint file the save was writing.
        payload: what was being saved; serialised once more, to a counter, for its size.
        committed: the step `latest` named before the save, or None.
        error: what the write raised.
    """
    counter = _ByteCounter()
    try:
        torch.save(payload, counter)
        needed = f"{counter.size:,} bytes"
    except Exception:
        needed = "an unknown number of bytes"
    usage = shutil.disk_usage(final.parent)
    cause = os_cause(error)
    if cause is not None:
        reason = f"{cause.strerror} (errno {errno.errorcode.get(cause.errno, cause.errno)})"
    elif counter.size > usage.free:
        reason = f"{os.strerror(errno.ENOSPC)} (inferred from the free space; torch said: {error})"
    else:
        reason = f"{type(error).__name__}: {error}"
    restore = (
        "there was no committed checkpoint before it"
        if committed is None
        else f"step {committed} (the one `latest` names) stays the restore point"
    )
    return (
        f"writing {final.name} in {final.parent} failed: {reason}. The checkpoint needs "
        f"{needed}; {usage.free:,} of {usage.total:,} bytes are free on that file system. "
        f"The partial file was removed and {restore}. Free space there, keep fewer "
        "checkpoints (keep=), or choose another directory."
    )
