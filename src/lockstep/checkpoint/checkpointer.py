"""`Checkpointer`: rank 0 saves, every rank restores, and a resumed run continues exactly.

`save()` is called on every rank after a step: the ranks send their random
generator states to rank 0, rank 0 writes one file atomically (see
`lockstep.checkpoint.files`), and the other ranks wait at a barrier until it is
done. `restore()` is called on every rank before training: rank 0 finds the
newest valid checkpoint, each rank loads it onto its own device and takes back
its own generator state. A problem found on one rank is raised on every rank.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from lockstep.checkpoint import rng
from lockstep.checkpoint.coordination import Coordination, coordination_group
from lockstep.checkpoint.files import CheckpointFiles
from lockstep.checkpoint.finite import first_nonfinite, refusal, write_aside
from lockstep.checkpoint.replicas import differing, restore_refusal, save_refusal, state_digests
from lockstep.checkpoint.sharded import gather_for_save, load_sharded
from lockstep.checkpoint.state import build_payload, device_of, load_component, load_model
from lockstep.context import group_context
from lockstep.env import read_timeout
from lockstep.errors import CheckpointError
from lockstep.runtime import progress, recovery
from lockstep.runtime.replica_check import wanted
from lockstep.sharded.engine import ShardedDataParallel

DCP_REFUSAL = 'Checkpointer(format="dcp") is not handed over live; use the default format'


@dataclass(frozen=True)
class SaveInProgress:
    """One call of `Checkpointer.save`, as live recovery runs it again after a loss."""

    checkpointer: Checkpointer
    step: int
    components: dict[str, Any]
    extra: Any

    def run(self) -> Path:
        return self.checkpointer.write_checkpoint(self.step, self.components, self.extra)


class Checkpointer:
    """Save and restore training state in `directory`; construct it on every rank.

    Args:
        directory: where checkpoints are written (by rank 0) and read (by every rank);
            all ranks must see the same directory (a shared file system across nodes).
        keep: how many checkpoints to keep; older ones are deleted after a save.
        timeout_s: how long the other ranks wait for rank 0 to write or find a
            checkpoint; LOCKSTEP_TIMEOUT_S (default 5 minutes) when None.
        process_group: the data-parallel group; the default group when None.
        format: "lockstep" (one file, written by rank 0) or "dcp" (torch's distributed
            checkpoint: every rank writes its own part, torch's FSDP2 reads it;
            `dcp_checkpointer.py`, docs/checkpoints.md).
        check_replicas: commit a save, and accept a restore, only when every rank holds
            the same parameters and optimizer state (`checkpoint/replicas.py`; the
            "lockstep" format with a replicated model; LOCKSTEP_CHECK_REPLICAS=0 too).

    Attributes:
        extra: after `restore()`, the `extra` that was saved with the checkpoint.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 3,
        timeout_s: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        format: str = "lockstep",
        check_replicas: bool = True,
    ) -> None:
        if format not in ("lockstep", "dcp"):
            raise ValueError(f'format must be "lockstep" or "dcp"; found {format!r}')
        self.directory = Path(directory)
        self.files: Any = CheckpointFiles(self.directory, keep)
        self.timeout = read_timeout() if timeout_s is None else timedelta(seconds=timeout_s)
        place = group_context(process_group, "Checkpointer")
        self.rank, self.world_size = place.rank, place.world_size
        self._group = coordination_group(process_group, self.world_size)
        self._ranks = Coordination(self.rank, self.world_size, self._group, self.timeout)
        self._dcp = None
        if format == "dcp":  # imported here: torch.distributed.checkpoint takes a second
            from lockstep.checkpoint.dcp_checkpointer import DcpFormat

            self._dcp = DcpFormat(self.directory, keep, self._ranks)
            self.files = self._dcp.files
        self.extra: Any = None
        self.check_replicas = wanted(check_replicas) and self.world_size > 1

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: Any = None,
        sampler: Any = None,
        scheduler: Any = None,
        extra: Any = None,
    ) -> Path:
        """Save the training state after `step`; call on every rank, only rank 0 writes.

        Args:
            step: the number of the step just finished (an int >= 0); `restore` returns it.
            model: the model, wrapped or not; saved without any wrapper's prefix.
            optimizer: its state_dict() is saved.
            sampler: a `ShardedSampler`, the loader from `shard()`, or anything with
                state_dict(); saves the place inside the epoch.
            scheduler: a learning-rate scheduler.
            extra: anything else made of tensors, numbers, strings and plain containers.

        Returns:
            The path of the checkpoint file.

        Raises:
            CheckpointError: on every rank, when rank 0 could not write (the message
                names the directory and the reason), the state holds NaN or inf (it is
                written aside, never committed: `checkpoint/finite.py`) or the ranks timed
                out waiting for rank 0.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"save() expected a step that is an int >= 0; found {step!r}")
        label = f"Checkpointer.save(step={step})"
        with progress.during(progress.Phase.CHECKPOINT, step, label=label):  # ends with the save
            components = {"model": model, "optimizer": optimizer}
            components.update(sampler=sampler, scheduler=scheduler)
            recovery.saving(step)
            if self._dcp is not None:
                return self._dcp.save(step, components, extra)
            # A rank lost inside the save: the save runs again with its replacement, or not
            # if it was committed (`runtime/recovery.py`, "inside a save").
            save = SaveInProgress(self, step, components, extra)
            return recovery.run_again(recovery.Point.SAVE, step, save.run, value=save)

    def write_checkpoint(self, step: int, components: dict[str, Any], extra: Any) -> Path:
        """The save itself, on every rank (`save` checks its arguments and notes it)."""
        # Every rank gathers (sharded models); rank 0 writes.
        model, optimizer = gather_for_save(components["model"], components["optimizer"])
        states = self._gather_rng()
        digests = self._gather_digests(components["model"], components["optimizer"])
        error = None
        if self.rank == 0:
            found = differing(digests) if digests else None
            if found is not None:  # never commit replicas that differ (`replicas.py`)
                error = save_refusal(step, found, self.files.committed_step()[0])
            else:
                components = {**components, "model": model, "optimizer": optimizer}
                error = self._write(step, components, states, extra)
        self._ranks.wait_for_rank0(f"checkpoint save of step {step} to {self.directory}")
        error = self._ranks.from_rank0(error)
        if error is not None:
            raise CheckpointError(f"{error} (raised on rank {self.rank})")
        return self.files.path_for(step)

    def _write(
        self, step: int, components: dict[str, Any], states: list[Any], extra: Any
    ) -> str | None:
        """Rank 0's part of a save; returns an error message instead of raising."""
        try:
            payload = build_payload(step, self.world_size, components, states, extra)
            found = first_nonfinite(payload)  # never commit NaN/inf (checkpoint/finite.py)
            if found is not None:
                aside = write_aside(self.directory, step, payload)
                return refusal(step, found, aside, self.files.committed_step()[0])
            self.files.write(step, payload)
        except CheckpointError as error:
            return f"rank 0 could not save step {step}: {error}"
        except OSError as error:
            return (
                f"rank 0 could not write checkpoint step {step} in {self.directory}: {error}. "
                "Expected a writable directory with free space; earlier checkpoints are "
                "untouched. Fix the permissions or choose another directory."
            )
        except Exception as error:  # reported on every rank rather than hanging the others
            return f"rank 0 could not save step {step}: {type(error).__name__}: {error}"
        return None

    def restore(
        self,
        *,
        model: nn.Module,
        optimizer: Any = None,
        sampler: Any = None,
        scheduler: Any = None,
    ) -> int | None:
        """Load the newest valid checkpoint into what is given; call on every rank.

        Tensors are loaded onto the device of `model` on each rank. A corrupt or
        truncated newest checkpoint is skipped with a warning and the one before is
        used. When the checkpoint was saved at another world size, the model,
        optimizer and data position are restored (the rest of the epoch is re-dealt
        over the new ranks), but the random generators keep the seeds this run set.

        Returns:
            The step the checkpoint was saved at, or None when there is none.

        Raises:
            CheckpointError: on every rank, naming the file and the problem (no valid
                checkpoint although files exist, a checkpoint of another model, ...).
        """
        components = {"optimizer": optimizer, "sampler": sampler, "scheduler": scheduler}
        if recovery.replacing():  # a live replacement: the state comes from a survivor
            return recovery.restore_from_peer(self, model, components)
        if self._dcp is not None:  # live recovery serves the single-file format only
            recovery.refuse(DCP_REFUSAL)
            step = self._dcp.restore(model, components)
            self.extra = self._dcp.extra
            return step
        step = self._restore_from_disk(model, components)
        recovery.restored(self, model, components, step)
        return step

    def _restore_from_disk(self, model: nn.Module, components: dict[str, Any]) -> int | None:
        device = device_of(model)
        path, payload, error = None, {}, None
        if self.rank == 0:
            path, payload, error = self._find(device)
        self._ranks.wait_for_rank0(f"search for the latest checkpoint in {self.directory}")
        path, error = self._ranks.from_rank0((path, error))
        if error is not None:
            raise CheckpointError(f"{error} (raised on rank {self.rank})")
        if path is None:
            return None
        components = dict(components)  # _apply takes the optimizer out for sharded models
        optimizer = components["optimizer"]
        self._ranks.raise_if_any(self._apply(path, payload, device, model, components))
        self._check_loaded(path, model, optimizer)
        self._restore_rng(path, payload)
        return int(payload["step"])

    def _find(self, device: Any) -> tuple[Path | None, dict[str, Any], str | None]:
        try:
            path, payload, notes = self.files.find_latest(device)
        except CheckpointError as error:
            return None, {}, str(error)
        for note in notes:
            warnings.warn(f"Checkpointer.restore: {note}", stacklevel=3)
        return path, payload, None

    def _apply(
        self,
        path: Path,
        payload: dict[str, Any],
        device: Any,
        model: nn.Module,
        components: dict[str, Any],
    ) -> str | None:
        """Load the checkpoint into this rank's objects; returns an error message or None."""
        try:
            if not payload:
                payload.update(self.files.load(path, device, verify=False))
            if isinstance(model, ShardedDataParallel):
                load_sharded(model, components.pop("optimizer"), payload, str(path))
            else:
                load_model(model, payload["model"], str(path))
            for name, component in components.items():
                if component is not None:
                    load_component(component, payload.get(name), name, str(path))
        except CheckpointError as error:
            return str(error)
        except Exception as error:  # reported on every rank rather than hanging the others
            return f"loading {path} failed: {type(error).__name__}: {error}"
        self.extra = payload.get("extra")
        return None

    def _restore_rng(self, path: Path, payload: dict[str, Any]) -> None:
        saved = int(payload.get("world_size", 0))
        rng.restore_rank(payload["rng"], saved, self.rank, self.world_size, str(path))

    def _gather_rng(self) -> list[Any]:
        return self._ranks.to_rank0(rng.capture())

    def _compares(self, model: nn.Module) -> bool:
        return self.check_replicas and not isinstance(model, ShardedDataParallel)

    def _gather_digests(self, model: nn.Module, optimizer: Any) -> list[Any]:
        """Every rank's state digests on rank 0 (nothing when the check is off)."""
        if not self._compares(model):
            return []
        return self._ranks.to_rank0(state_digests(model, optimizer))

    def _check_loaded(self, path: Path, model: nn.Module, optimizer: Any) -> None:
        """After a restore: every rank holds the same state, or raise naming who does not."""
        if not self._compares(model):
            return
        found = differing(self._ranks.everyone(state_digests(model, optimizer)))
        if found is not None:
            raise CheckpointError(
                f"{restore_refusal(str(path), found)} (raised on rank {self.rank})"
            )
