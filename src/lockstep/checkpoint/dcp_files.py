"""A directory of DCP checkpoints: one folder per step, committed by a rename, checked on load.

    step_00000100/        DCP's `.metadata` and `__<rank>_0.distcp`, and `lockstep.pt`
    .step_00000100.tmp/   a save in progress: every rank writes its file here
    latest                "step_00000100", one line

When every rank has written its data file (DCP's own gather), rank 0 writes the
manifest `lockstep.pt` (step, random states, sampler, ..., and each data file's
size and CRC32), fsyncs it, renames the folder into place, fsyncs the directory
and replaces `latest`. A checkpoint counts once `latest` names it, so a crash at
any point leaves the previous one in charge. `problems` finds a truncated or
corrupt file before DCP reads it; a folder without manifest (written by torch) is
checked against DCP's metadata (file sizes) only.
"""

from __future__ import annotations

import os
import re
import shutil
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import (
    FORMAT_KEY,
    FORMAT_VERSION,
    _fsync_directory,
    make_directory,
)
from lockstep.checkpoint.steps import POINTER, StepEntries

MANIFEST = "lockstep.pt"
# Where `on_point` is called during a commit; the crash tests stop rank 0 at each.
POINTS = ("data_written", "manifest_written", "renamed", "pointer_written", "pointer_updated")
_STEP_DIR = re.compile(r"^step_(\d+)$")
_BLOCK = 1 << 20


def file_crc(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC32) of a file, read in blocks."""
    crc, size = 0, 0
    with open(path, "rb") as fp:
        while block := fp.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


class DcpFiles(StepEntries):
    """One directory of DCP checkpoints; rank 0 commits, every rank writes and reads.

    Args:
        directory: where the checkpoints live; created on the first save.
        keep: how many committed checkpoints to keep (the newest ones).
        on_point: called with each name in POINTS as a save passes it (for tests).
    """

    pattern, folders, noun, suffix = _STEP_DIR, True, "folder", ""

    def __init__(
        self, directory: Path, keep: int, on_point: Callable[[str], None] | None = None
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1; found {keep}")
        self.directory, self.keep, self.on_point = directory, keep, on_point
        self.last_written: int | None = None  # in this process: a deleted folder is named

    def temp_for(self, step: int) -> Path:
        return self.directory / f".step_{step:08d}.tmp"

    def point(self, name: str) -> None:
        if self.on_point is not None:
            self.on_point(name)

    def prepare(self) -> None:
        """Rank 0, before a save: create the directory, remove what interrupted saves left."""
        make_directory(self.directory, self.last_written)
        for path in self.directory.glob(".step_*.tmp"):
            shutil.rmtree(path, ignore_errors=True)

    def commit(self, step: int, manifest: dict[str, Any]) -> Path:
        """Rank 0, after every rank wrote: the manifest, the rename, then `latest`."""
        temp, final = self.temp_for(step), self.path_for(step)
        with open(temp / MANIFEST, "wb") as fp:
            torch.save(manifest, fp)
            fp.flush()
            os.fsync(fp.fileno())
        _fsync_directory(temp)
        self.point("manifest_written")
        if final.exists():  # an uncommitted leftover, or this step saved again
            shutil.rmtree(final)
        os.replace(temp, final)
        _fsync_directory(self.directory)
        self.point("renamed")
        pointer = self.directory / f".{POINTER}.tmp"
        with open(pointer, "w") as fp:
            fp.write(final.name + "\n")
            fp.flush()
            os.fsync(fp.fileno())
        self.point("pointer_written")
        os.replace(pointer, self.directory / POINTER)
        _fsync_directory(self.directory)
        self.point("pointer_updated")
        self.prune(step)
        self.last_written = step
        return final

    def prune(self, current: int) -> None:
        """Keep the newest `keep` checkpoints up to `current`; drop older and uncommitted ones."""
        for path in self.to_prune(current, self.keep):
            shutil.rmtree(path, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint folder, or None when it has none (written by torch).

    Raises:
        ValueError: the manifest is truncated, corrupt or not lockstep's.
    """
    manifest = path / MANIFEST
    if not manifest.exists():
        return None
    try:
        with zipfile.ZipFile(manifest) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise ValueError(f"{manifest} is truncated or not a manifest ({error})") from None
    if bad is not None:
        raise ValueError(f"{manifest} is corrupt: the CRC32 of its record {bad} does not match")
    payload = torch.load(manifest, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get(FORMAT_KEY) != FORMAT_VERSION:
        raise ValueError(f"{manifest} is not a lockstep manifest")
    return payload


def problems(path: Path, metadata_sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """What is wrong with the data files of `path`; this rank checks its share of the CRCs.

    Args:
        path: the checkpoint folder.
        metadata_sizes: file name -> the bytes DCP's metadata says it holds at least.
        rank: this rank; it reads the files whose index is rank modulo world_size.
        world_size: the ranks sharing the check.
    """
    try:
        manifest = read_manifest(path)
    except ValueError as error:
        return [str(error)]
    found = []
    for name, least in sorted(metadata_sizes.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else -1
        if size < least:
            what = "missing" if size < 0 else f"truncated: {size:,} of at least {least:,} bytes"
            found.append(f"{path / name} is {what}")
    saved = {} if manifest is None else manifest.get("files", {})
    for i, (name, (size, crc)) in enumerate(sorted(saved.items())):
        if i % world_size != rank or any(str(path / name) in text for text in found):
            continue
        if file_crc(path / name) != (size, crc):
            found.append(f"{path / name} is corrupt: its size or CRC32 differs from the manifest's")
    return found
