"""The launcher's two watches over its workers, and the folder they share with them.

Workers write their progress records and, on SIGUSR2, their stacks into one folder
whose path they read from the environment. The stall watch reads the records
(`launch/watches/stall.py`); the exit watch bounds a worker's exit after its script ended
(`launch/watches/exits.py`). Both find a stuck worker's stack in the same folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from lockstep.launch.cli.config import RunConfig
from lockstep.launch.recovery.stuck import StuckReplacer
from lockstep.launch.watches.exits import DIR_VARIABLE as EXIT_DIR_VARIABLE
from lockstep.launch.watches.exits import ExitWatch
from lockstep.launch.watches.stall import StallWatch
from lockstep.runtime import progress


def stall_watch(cfg: RunConfig, directory: Path) -> StallWatch | None:
    """The workers' progress watch (None with --stall-timeout 0); the folder is exported."""
    if not cfg.stall_timeout_s:
        return None
    directory.mkdir(exist_ok=True)
    os.environ[progress.DIR_VARIABLE] = str(directory)
    watch = StuckReplacer if cfg.replace_stuck else StallWatch  # `launch/recovery/stuck.py`
    return watch(directory, cfg.stall_timeout_s, cfg.nnodes)


def exit_watch(cfg: RunConfig, directory: Path) -> ExitWatch:
    """The bound on a worker's exit after its script ended; the folder is exported too."""
    directory.mkdir(exist_ok=True)
    os.environ[EXIT_DIR_VARIABLE] = str(directory)
    return ExitWatch(directory, cfg.exit_grace_s)
