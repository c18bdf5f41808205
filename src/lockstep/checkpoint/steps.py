"""Which checkpoints a directory holds, and which one `latest` commits: shared by both formats.

A checkpoint directory holds one entry per step (`step_00000100.pt`, a file, or
`step_00000100/`, a DCP folder), temporary entries of interrupted saves
(`.step_*.tmp`) and `latest`, which names the committed entry. `candidates` says
which steps to try, best first, and what was passed over.
"""

from __future__ import annotations

import re
from pathlib import Path

POINTER = "latest"


class StepEntries:
    """The steps of one checkpoint directory, for a format that names its entries so.

    A format sets `pattern` (an entry's name; group 1 is the step), `folders`
    (entries are folders, as DCP's, or files), `noun` ("file" or "folder", for the
    notes) and `suffix` (what follows `step_NNNNNNNN`); its `directory` is set per
    instance.
    """

    directory: Path
    pattern: re.Pattern[str]
    folders: bool
    noun: str
    suffix: str

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}{self.suffix}"

    def steps_on_disk(self) -> list[int]:
        """Steps with an entry, newest first (committed or not, valid or not)."""
        if not self.directory.is_dir():
            return []
        found = (
            self.pattern.match(path.name)
            for path in self.directory.iterdir()
            if path.is_dir() == self.folders
        )
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def committed_step(self) -> tuple[int | None, str | None]:
        """The step `latest` names, or None; and a note when `latest` is unreadable."""
        pointer = self.directory / POINTER
        if not pointer.is_file():
            return None, None
        text = pointer.read_text(errors="replace").strip()
        match = self.pattern.match(text)
        if match is None:
            note = f"{pointer} is unreadable (found {text[:40]!r}); using the newest {self.noun}"
            return None, note
        return int(match.group(1)), None

    def candidates(self) -> tuple[list[int], list[str]]:
        """Steps to try, best first, and notes on the entries that were passed over."""
        steps = self.steps_on_disk()
        committed, note = self.committed_step()
        notes = [note] if note else []
        notes += [
            f"ignoring partial {self.noun} {path} left by an interrupted save"
            for path in sorted(self.directory.glob(".step_*.tmp"))
        ]
        if committed is None:
            return steps, notes
        notes += [
            f"ignoring {self.path_for(s)}: the save was interrupted before {POINTER} named it"
            for s in steps
            if s > committed
        ]
        return [committed] + [s for s in steps if s < committed], notes

    def to_prune(self, current: int, keep: int) -> list[Path]:
        """Entries to remove after committing `current`: older than the newest `keep` up
        to it, and any newer one (a save that was never committed)."""
        steps = self.steps_on_disk()
        older = [s for s in steps if s <= current]
        return [self.path_for(s) for s in older[keep:] + [s for s in steps if s > current]]
