"""One scratch folder per launcher, removed however the launcher ends.

Everything a run writes outside the user's folders (torch.distributed.elastic's
per-worker logs and error files, the workers' progress files for the stall watch)
lives in `<tmp>/lockstep-run-<launcher pid>-<random>`. A normal end, a failure, a
signal (SIGTERM, SIGINT) and a watchdog exit remove it; a launcher killed with
SIGKILL cannot, so every launcher first removes the folders of launchers that no
longer run (their pid is in the name).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREFIX = "lockstep-run-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep(root: Path | None = None) -> list[Path]:
    """Remove the scratch folders of launchers that are gone; return what was removed."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for path in root.glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        if match and path.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove(path: Path) -> None:
    """Remove a scratch folder; never raises (the watchdog calls it on its way out)."""
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """A fresh scratch folder for this launcher, after sweeping those of dead launchers."""
    sweep()
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    try:
        yield path
    finally:
        remove(path)
