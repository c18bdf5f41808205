"""`Checkpointer(directory, format="dcp")`: every rank writes its part through torch's DCP.

A save checks this rank's state for NaN/inf (all ranks agree before anything is
written), writes DCP's layout into a temporary folder (`checkpoint/dcp.py`: each
rank only what it owns), gathers every rank's random state and its file's CRC32
on rank 0, which commits (`dcp_files.py`). A restore tries the committed folder,
then older ones: every rank checks its share of the files, the ranks agree on
the first good folder, and each reads its own part, at any world size. A folder
that torch wrote (`fully_shard` + `dcp.save`) restores too, model and optimizer.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.checkpoint import dcp, rng
from lockstep.checkpoint.coordination import Coordination
from lockstep.checkpoint.dcp_files import DcpFiles, file_crc, problems, read_manifest
from lockstep.checkpoint.files import FORMAT_KEY, FORMAT_VERSION
from lockstep.checkpoint.finite import first_nonfinite
from lockstep.checkpoint.state import check_plain, load_component
from lockstep.checkpoint.write_error import os_cause
from lockstep.errors import CheckpointError
from lockstep.sharded.dcp_pieces import FlatPiece


def _checkable(value: Any) -> Any:
    """The state with each `FlatPiece` replaced by its tensors (for the non-finite check)."""
    if isinstance(value, FlatPiece):
        return value.views
    if isinstance(value, dict):
        return {k: _checkable(v) for k, v in value.items()}
    return value


def _sizes(path: Path) -> dict[str, int]:
    """Data file -> the bytes DCP's metadata places in it (a lower bound of its size)."""
    sizes: dict[str, int] = {}
    for info in dcp.read_metadata(path).storage_data.values():
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    return sizes


def _timed_group(ranks: Coordination) -> dist.ProcessGroup | None:
    """A gloo group whose collectives give up after the checkpointer's timeout.

    DCP's own gathers and broadcasts run on it, so a rank that is stuck (a slow or
    full disk) makes the others fail after timeout_s with DCP's error, not hang for
    the default group's timeout. Created on every rank, with the Checkpointer.
    """
    if ranks.world_size == 1:
        return ranks.group
    members = None if ranks.group is None else dist.get_process_group_ranks(ranks.group)
    return dist.new_group(ranks=members, backend="gloo", timeout=ranks.timeout)


class DcpFormat:
    """`Checkpointer(directory, format="dcp")`'s save and restore.

    Args:
        directory: the checkpoint directory (shared by every rank).
        keep: how many committed checkpoints to keep.
        ranks: the checkpointer's messages between ranks.
    """

    def __init__(self, directory: Path, keep: int, ranks: Coordination) -> None:
        self.directory, self.ranks = directory, ranks
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.files = DcpFiles(directory, keep)
        self.group = _timed_group(ranks)
        self.extra: Any = None

    def save(self, step: int, components: dict[str, Any], extra: Any) -> Path:
        """Every rank writes its part, rank 0 commits; raises on every rank on failure."""
        state = dcp.state_to_save(components["model"], components["optimizer"])
        self._refuse_nonfinite(step, state)
        error = self._on_rank0(self.files.prepare, f"prepare {self.directory}")
        self.ranks.wait_for_rank0(f"preparation of checkpoint step {step} in {self.directory}")
        self._raise(self.ranks.from_rank0(error))
        temp = self.files.temp_for(step)
        try:
            dcp.write(temp, state, self.group)
        except Exception as failure:  # DCP raises a failed write on every rank
            error = (
                f"writing checkpoint step {step} into {temp} failed: {failure}. The last "
                "committed checkpoint stays the restore point; free space there, keep fewer "
                "checkpoints (keep=), or choose another directory."
            )
        self.files.point("data_written")
        mine = {"rng": rng.capture(), "files": self._my_files(temp), "error": error}
        gathered = self.ranks.to_rank0(mine)
        if self.rank == 0:
            what = f"commit checkpoint step {step} in {self.directory}"
            error = self._on_rank0(lambda: self._commit(step, components, extra, gathered), what)
        self.ranks.wait_for_rank0(f"checkpoint save of step {step} to {self.directory}")
        self._raise(self.ranks.from_rank0(error))
        return self.files.path_for(step)

    def _refuse_nonfinite(self, step: int, state: dict[str, Any]) -> None:
        every = self.ranks.everyone(first_nonfinite(_checkable(state)))
        bad = [(rank, text) for rank, text in enumerate(every) if text is not None]
        if bad:
            rank, text = bad[0]
            raise CheckpointError(
                f"checkpoint step {step} was not written: {text} on rank {rank}; expected "
                "finite values. The last committed checkpoint stays the restore point. The "
                f"run diverged: restore from it (raised on rank {self.rank})"
            )

    def _my_files(self, temp: Path) -> dict[str, tuple[int, int]]:
        if not temp.is_dir():
            return {}
        return {p.name: file_crc(p) for p in temp.glob(f"__{self.rank}_*.distcp")}

    def _commit(
        self, step: int, components: dict[str, Any], extra: Any, gathered: list[dict[str, Any]]
    ) -> str | None:
        errors = [g["error"] for g in gathered if g["error"]]
        if errors:  # every rank is past its write: the partial folder goes at once
            shutil.rmtree(self.files.temp_for(step), ignore_errors=True)
            return errors[0]
        files: dict[str, Any] = {}
        for each in gathered:
            files.update(each["files"])
        manifest: dict[str, Any] = {FORMAT_KEY: FORMAT_VERSION, "format": "dcp", "step": step}
        manifest.update(world_size=self.world_size, files=files, extra=extra)
        manifest["rng"] = [g["rng"] for g in gathered]
        for name in ("sampler", "scheduler"):
            component = components.get(name)
            manifest[name] = None if component is None else component.state_dict()
        check_plain(manifest, "checkpoint")  # loads with weights_only=True
        self.files.commit(step, manifest)
        return None

    def _on_rank0(self, action: Any, what: str) -> str | None:
        """Rank 0 runs `action` (which may return an error); its error as text, or None."""
        if self.rank != 0:
            return None
        try:
            found = action()
        except CheckpointError as error:
            return f"rank 0 could not {what}: {error}"
        except Exception as error:  # reported on every rank rather than hanging the others
            cause = os_cause(error) or error  # torch's zip writer hides ENOSPC in the context
            return (
                f"rank 0 could not {what}: {type(cause).__name__}: {cause}. Earlier "
                "checkpoints are untouched; check the directory's permissions and free space."
            )
        return found if isinstance(found, str) else None

    def _raise(self, error: str | None) -> None:
        if error is not None:
            raise CheckpointError(f"{error} (raised on rank {self.rank})")

    def restore(self, model: Any, components: dict[str, Any]) -> int | None:
        """As `Checkpointer.restore`, from DCP folders (lockstep's or torch's).

        Args:
            model: the model to load into.
            components: "optimizer", "sampler", "scheduler": each None or the object.
        """
        steps: list[int] = []
        if self.rank == 0:
            steps, notes = self.files.candidates()
            for note in notes:
                warnings.warn(f"Checkpointer.restore: {note}", stacklevel=2)
        self.ranks.wait_for_rank0(f"search for the latest checkpoint in {self.directory}")
        steps = self.ranks.from_rank0(steps)
        found: list[str] = []
        for step in steps:
            path = self.files.path_for(step)
            bad = self._agreed_problems(path)
            if bad:
                found += bad
                continue
            if found and self.rank == 0:
                warnings.warn(f"Checkpointer.restore: skipped {'; '.join(found)}", stacklevel=2)
            return self._load(path, step, model, dict(components))
        if found:
            raise CheckpointError(
                f"no valid checkpoint in {self.directory}: " + "; ".join(found) + ". Repair or "
                "remove these folders (and latest) to start from scratch, or use another "
                f"directory. (raised on rank {self.rank})"
            )
        return None

    def _agreed_problems(self, path: Path) -> list[str]:
        try:
            mine = problems(path, _sizes(path), self.rank, self.world_size)
        except CheckpointError as error:
            mine = [str(error)]
        except Exception as error:  # agreed on by every rank rather than hanging the others
            mine = [f"{path} cannot be checked on rank {self.rank}: {error}"]
        every = self.ranks.everyone(mine)
        return list(dict.fromkeys(text for each in every for text in each))

    def _load(self, path: Path, step: int, model: Any, components: dict[str, Any]) -> int:
        manifest: dict[str, Any] = {}
        error = None
        try:
            manifest = read_manifest(path) or {"step": step}
            optimizer = components.pop("optimizer")
            dcp.load(path, model=model, optimizer=optimizer, process_group=self.group)
            for name, component in components.items():
                if component is not None:
                    load_component(component, manifest.get(name), name, str(path))
        except CheckpointError as failure:
            error = str(failure)
        except Exception as failure:  # reported on every rank rather than hanging the others
            error = f"loading {path} failed: {type(failure).__name__}: {failure}"
        self.ranks.raise_if_any(error)
        self.extra = manifest.get("extra")
        if "rng" in manifest:
            saved = int(manifest["world_size"])
            rng.restore_rank(manifest["rng"], saved, self.rank, self.world_size, str(path))
        return int(manifest["step"])
