"""Each worker's progress (step and phase), published where its launcher can read it for free.

The engine calls `note(phase, step, ...)` a few times per synchronised step: backward
began, a bucket is being waited on, the step is synchronised; `Checkpointer.save`
notes its own phase. A phase with an end (a wait, a save) is noted with `during`,
which notes the phase before it again when it ends, so no record outlives its phase.
Under `lockstep run` the record lives in a small memory-mapped file
(`$LOCKSTEP_PROGRESS_DIR/<local rank>.progress`), so a note is a struct write into
shared memory: no system call, no store round trip. The launcher's stall watch
(`lockstep.launch.watches.stall`) reads these files. Without the variable the record stays
in this process's memory (other launchers), where the stall inspector reads it.
"""

from __future__ import annotations

import enum
import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lockstep.env import read_variable

DIR_VARIABLE = "LOCKSTEP_PROGRESS_DIR"
_HEAD = struct.Struct("<qqqqd")  # seq, step, phase, index, since (wall clock)
LABEL_BYTES = 256
SIZE = _HEAD.size + LABEL_BYTES


class Phase(enum.IntEnum):
    """What a worker does now; every note bumps the sequence number (progress)."""

    STARTING = 0
    BACKWARD = 1  # step `step`: forward done, backward running (buckets launching)
    WAITING = 2  # step `step`: waiting on collective `index` (the label names it)
    SYNCHRONISED = 3  # step `step` is done; optimizer, data, next forward follow
    CHECKPOINT = 4  # inside Checkpointer.save(step)
    OPENING = 5  # waiting on a collective that opens step `step` (the label names it)
    BETWEEN = 6  # waiting on a collective after step `step` (the Monitor's; the label names it)

    @property
    def waits(self) -> bool:
        """Whether a worker in this phase waits on a collective (its peers may be stuck)."""
        return self in (Phase.WAITING, Phase.OPENING, Phase.BETWEEN)


@dataclass(frozen=True)
class Record:
    """One worker's last note, as its launcher reads it."""

    seq: int
    step: int
    phase: Phase
    index: int
    since: float
    label: str

    def describe(self) -> str:
        """'waiting on gradient bucket 0 of step 3 (all-reduce)' and the like."""
        if self.phase.waits:
            return f"waiting on {self.label}"
        if self.phase == Phase.BACKWARD:
            return f"in step {self.step}'s backward"
        if self.phase == Phase.SYNCHRONISED:
            return f"after step {self.step} (synchronised), before step {self.step + 1}'s backward"
        if self.phase == Phase.CHECKPOINT:
            return f"inside {self.label}"
        return "starting (no synchronised step yet)"


def path_for(directory: str | Path, local_rank: int) -> Path:
    return Path(directory) / f"{local_rank}.progress"


def read(path: Path) -> Record | None:
    """The record in `path`, or None while the worker has not written one."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    seq, step, phase, index, since = _HEAD.unpack_from(data)
    label = data[_HEAD.size : SIZE].split(b"\0", 1)[0].decode(errors="replace")
    return Record(seq, step, Phase(phase), index, since, label)


class Progress:
    """This process's progress record: in a shared file when a launcher watches, else in memory."""

    def __init__(self, path: Path | None) -> None:
        self._buf: mmap.mmap | bytearray
        if path is None:
            self._buf = bytearray(SIZE)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, SIZE)
                self._buf = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
        self.seq = 0
        self.step = 0
        self.phase = Phase.STARTING
        self.index = -1
        self.label = ""

    def note(self, phase: Phase, step: int, index: int = -1, label: str = "") -> None:
        """Record progress: `phase` of `step` begins now (bumps the sequence number)."""
        self.seq += 1
        self.step, self.phase, self.index = step, phase, index
        if label != self.label:
            self.set_label(label)
        _HEAD.pack_into(self._buf, 0, self.seq, step, int(phase), index, time.time())

    def set_label(self, label: str) -> None:
        """Change the label only (not progress): the stall inspector adds who is missing."""
        self.label = label
        raw = label.encode()[: LABEL_BYTES - 1]
        self._buf[_HEAD.size : SIZE] = raw + b"\0" * (LABEL_BYTES - len(raw))


_current: Progress | None = None


def current() -> Progress:
    """The process's one record (progress is a fact about the process, like its pid)."""
    global _current
    if _current is None:
        directory = read_variable(DIR_VARIABLE)
        local_rank = int(read_variable("LOCAL_RANK") or 0)
        path = path_for(directory, local_rank) if directory else None
        try:
            _current = Progress(path)
        except OSError:  # the directory went away: keep the record in memory
            _current = Progress(None)
    return _current


def note(phase: Phase, step: int, index: int = -1, label: str = "") -> None:
    """Record progress in this process's record (see `Progress.note`)."""
    current().note(phase, step, index, label)


@contextmanager
def during(phase: Phase, step: int, index: int = -1, label: str = "") -> Iterator[None]:
    """Note `phase` for the block; when it ends (or raises), note the phase before it again."""
    record = current()
    before = (record.phase, record.step, record.index, record.label)
    record.note(phase, step, index, label)
    try:
        yield
    finally:
        record.note(*before)
