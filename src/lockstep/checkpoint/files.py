"""The checkpoint directory on disk: atomic writes, the `latest` pointer, checks on load, pruning.

    step_00000100.pt   one checkpoint (torch's zip format; every record has a CRC32)
    latest             the name of the newest committed checkpoint, one line

A save writes `.step_00000100.pt.tmp`, fsyncs it, renames it into place and
fsyncs the directory, then replaces `latest` the same way. A checkpoint counts
once `latest` names it, so a crash at any point leaves the previous one in charge.
On load, the zip's CRCs are checked before torch.load(weights_only=True), so a
truncated, corrupt or code-carrying file is refused and the next older one is tried.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.steps import POINTER, StepEntries
from lockstep.checkpoint.write_error import describe_write_failure
from lockstep.errors import CheckpointError

FORMAT_KEY = "lockstep_checkpoint"
FORMAT_VERSION = 1
# Where `on_point` is called during a save; the crash tests stop the process at each.
POINTS = ("temp_written", "temp_synced", "renamed", "pointer_written", "pointer_updated")
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def _fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointFiles(StepEntries):
    """One checkpoint directory. Only rank 0 writes; any rank may read.

    Args:
        directory: where the checkpoints live; created on the first save.
        keep: how many committed checkpoints to keep (the newest ones).
        on_point: called with each name in POINTS as a save passes it (for tests).
    """

    pattern, folders, noun, suffix = _STEP_FILE, False, "file", ".pt"

    def __init__(
        self, directory: Path, keep: int, on_point: Callable[[str], None] | None = None
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1; found {keep}")
        self.directory = directory
        self.keep = keep
        self.on_point = on_point
        self.last_written: int | None = None  # in this process: a deleted folder is named

    def _point(self, name: str) -> None:
        if self.on_point is not None:
            self.on_point(name)

    def write(self, step: int, payload: dict[str, Any]) -> Path:
        """Write `payload` as the checkpoint of `step` and commit it; returns its path.

        Raises:
            OSError: the directory cannot be created; nothing committed changed.
            CheckpointError: writing failed (a full disk, say); the message names the
                directory, the bytes needed and free, and the cause. The partial file
                is removed and the last committed checkpoint stays the restore point.
        """
        make_directory(self.directory, self.last_written)
        self._remove_temp_files()
        final = self.path_for(step)
        committed, _ = self.committed_step()
        try:
            self._write_and_commit(payload, final)
        except Exception as error:
            self._remove_temp_files()
            if committed != step and self.committed_step()[0] != step:
                final.unlink(missing_ok=True)  # renamed into place but never named by `latest`
            raise CheckpointError(
                describe_write_failure(final, payload, committed, error)
            ) from error
        self.prune(step)
        self.last_written = step
        return final

    def _write_and_commit(self, payload: dict[str, Any], final: Path) -> None:
        tmp = self.directory / f".{final.name}.tmp"
        with open(tmp, "wb") as fp:
            torch.save(payload, fp)
            fp.flush()
            self._point("temp_written")
            os.fsync(fp.fileno())
        self._point("temp_synced")
        os.replace(tmp, final)
        _fsync_directory(self.directory)
        self._point("renamed")
        self._write_pointer(final.name)
        self._point("pointer_updated")

    def _write_pointer(self, name: str) -> None:
        tmp = self.directory / f".{POINTER}.tmp"
        with open(tmp, "w") as fp:
            fp.write(name + "\n")
            fp.flush()
            os.fsync(fp.fileno())
        self._point("pointer_written")
        os.replace(tmp, self.directory / POINTER)
        _fsync_directory(self.directory)

    def _remove_temp_files(self) -> None:
        for path in self.directory.glob(".*.tmp"):
            path.unlink(missing_ok=True)

    def load(self, path: Path, map_location: Any, *, verify: bool = True) -> dict[str, Any]:
        """Load and check one checkpoint file.

        Args:
            path: the checkpoint file.
            map_location: the device its tensors are loaded onto.
            verify: check every record's CRC32 first (reads the file once more).

        Raises:
            CheckpointError: naming the file and what is wrong with it.
        """
        if not path.is_file():
            raise CheckpointError(f"{path} is missing although {POINTER} names it")
        if verify:
            self._verify_zip(path)
        try:
            payload = torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            reason = str(error).strip().splitlines()[-1][:300]
            raise CheckpointError(
                f"{path} was refused: it holds Python objects that torch.load(weights_only="
                f"True) does not load, since loading them could run code ({reason})"
            ) from None
        except Exception as error:
            raise CheckpointError(f"{path} cannot be read: {error}") from None
        return self._check_payload(path, payload)

    @staticmethod
    def _verify_zip(path: Path) -> None:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise CheckpointError(
                f"{path} is truncated or not a checkpoint file ({error})"
            ) from None
        if bad is not None:
            raise CheckpointError(
                f"{path} is corrupt: the CRC32 of its record {bad} does not match"
            )

    def _check_payload(self, path: Path, payload: Any) -> dict[str, Any]:
        if not isinstance(payload, dict) or payload.get(FORMAT_KEY) != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} is not a lockstep checkpoint (expected a dict with "
                f"{FORMAT_KEY}={FORMAT_VERSION}); was it written by Checkpointer.save?"
            )
        match = _STEP_FILE.match(path.name)
        if match and int(match.group(1)) != payload.get("step"):
            raise CheckpointError(
                f"{path} holds step {payload.get('step')}, not the step in its name"
            )
        return payload

    def find_latest(self, map_location: Any) -> tuple[Path | None, dict[str, Any], list[str]]:
        """The newest valid committed checkpoint, its payload, and notes on what was skipped.

        Returns:
            (None, {}, notes) when there is no checkpoint at all.

        Raises:
            CheckpointError: checkpoints exist but none of them is valid; names each problem.
        """
        steps, notes = self.candidates()
        problems: list[str] = []
        for step in steps:
            path = self.path_for(step)
            try:
                payload = self.load(path, map_location)
            except CheckpointError as error:
                problems.append(str(error))
                continue
            notes += [f"skipped a checkpoint: {problem}" for problem in problems]
            return path, payload, notes
        if problems:
            raise CheckpointError(
                f"no valid checkpoint in {self.directory}: " + "; ".join(problems) + ". Repair "
                f"or remove these files (and {POINTER}) to start from scratch, or use another "
                "directory."
            )
        return None, {}, notes

    def prune(self, current: int) -> None:
        """Keep the newest `keep` checkpoints up to `current`; drop older and uncommitted ones."""
        for path in self.to_prune(current, self.keep):
            path.unlink(missing_ok=True)


def make_directory(directory: Path, last_written: int | None) -> None:
    """Create the checkpoint directory; warn when this process had saved into it already.

    A directory that vanished during the run took its checkpoints with it: a restart
    could only resume from what is saved from now on, which nothing would say.
    """
    if last_written is not None and not directory.exists():
        warnings.warn(
            f"Checkpointer: the checkpoint directory {directory} was deleted during the run "
            f"(it held step {last_written} and the checkpoints before it); it is created again, "
            "and a restart can resume only from the checkpoints saved from now on",
            stacklevel=4,
        )
    directory.mkdir(parents=True, exist_ok=True)
