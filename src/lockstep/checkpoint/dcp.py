"""Model and optimizer through torch's distributed checkpoint (DCP), readable by FSDP2.

`save(path, model=..., optimizer=...)` writes DCP's own layout: `.metadata` and
one `__<rank>_0.distcp` per rank, with FSDP2's keys (`model.<fqn>`,
`optimizer.state.<fqn>.<name>`, `optimizer.param_groups.<i>.<key>`). A sharded
model writes only what each rank owns (`sharded/dcp_state.py`); a replicated one
(DDP, a plain module) goes through torch's own `get_state_dict`, and DCP spreads
its copies over the ranks. `load` reads into each rank's part whatever layout
and world size wrote it (torch's `fully_shard`, lockstep at any stage, DDP).
Called on every rank. `Checkpointer(format="dcp")` adds atomic commits and checks.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lockstep.checkpoint.state import shape_differences, unwrap
from lockstep.errors import CheckpointError
from lockstep.sharded import dcp_state
from lockstep.sharded.dcp_pieces import FlatPiece, PieceLoadPlanner, PieceSavePlanner
from lockstep.sharded.engine import ShardedDataParallel

MODEL, OPTIMIZER = "model", dcp_state.OPTIMIZER


def state_to_save(model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """`{"model": ..., "optimizer": ...}` as FSDP2's `get_state_dict` shapes it."""
    if isinstance(model, ShardedDataParallel):
        state: dict[str, Any] = {MODEL: dcp_state.model_state(model)}
        if optimizer is not None:
            state[OPTIMIZER] = dcp_state.optimizer_state(model, optimizer)
        return state
    optimizers = () if optimizer is None else (optimizer,)
    model_sd, optim_sd = get_state_dict(unwrap(model), optimizers)
    return {MODEL: model_sd} if optimizer is None else {MODEL: model_sd, OPTIMIZER: optim_sd}


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Write the model (and optimizer) as a DCP checkpoint in `path`; call on every rank.

    Writes straight into `path` (DCP's `.metadata` goes last); for a checkpoint that is
    complete or absent, use `Checkpointer(directory, format="dcp")`.
    """
    write(path, state_to_save(model, optimizer), process_group)


def write(
    path: str | os.PathLike[str], state: dict[str, Any], process_group: dist.ProcessGroup | None
) -> None:
    """Write a state from `state_to_save` into `path` (one data file per rank)."""
    with _quiet():
        torch_dcp.save(
            state,
            storage_writer=FileSystemWriter(path, single_file_per_rank=True, thread_count=1),
            planner=PieceSavePlanner(),
            process_group=process_group,
        )


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP's failures as a `CheckpointError` naming each rank's cause (DCP raises a
    BaseException, the same on every rank); and no warning in one process without
    torch.distributed, where DCP works alone and says so each time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as error:
            causes = "; ".join(
                f"rank {rank}: {type(exc).__name__}: {exc}"
                for rank, (exc, _) in sorted(error.failures.items())
            )
            raise CheckpointError(f"torch.distributed.checkpoint failed on {causes}") from None


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """DCP's `.metadata` of the checkpoint in `path`.

    Raises:
        CheckpointError: it is missing or unreadable.
    """
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as error:
        raise CheckpointError(
            f"{path} is not a readable DCP checkpoint: its .metadata could not be read "
            f"({type(error).__name__}: {error}). Expected a directory written by "
            "torch.distributed.checkpoint.save (or lockstep with format='dcp'); an "
            "interrupted save leaves none. Use another checkpoint."
        ) from None


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Read a DCP checkpoint into the model (and optimizer), each rank its own part.

    Raises:
        CheckpointError: the checkpoint does not fit the model (keys or shapes), holds
            no optimizer state although an optimizer is given, or cannot be read.
    """
    metadata = read_metadata(path)
    expected = _model_shapes(model)
    _check_model(path, metadata, expected)
    if optimizer is not None and not any(k.startswith(f"{OPTIMIZER}.") for k in _keys(metadata)):
        raise CheckpointError(
            f"{path} holds no optimizer state (it was saved without optimizer=); restore "
            "without optimizer=, or save it next time"
        )
    try:
        if isinstance(model, ShardedDataParallel):
            _load_sharded(path, metadata, model, optimizer, process_group)
        else:
            _load_replicated(path, model, optimizer, process_group)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"loading the DCP checkpoint {path} failed: {type(error).__name__}: {error}"
        ) from None


def _keys(metadata: Metadata) -> list[str]:
    return list(metadata.state_dict_metadata)


def _model_shapes(model: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """The model's keys and shapes (None for non-tensors), as the plain module names them."""
    if isinstance(model, ShardedDataParallel):
        state = dcp_state.model_state(model)
    else:
        state = unwrap(model).state_dict()
    return {
        k: tuple(v.size()) if isinstance(v, FlatPiece) or hasattr(v, "shape") else None
        for k, v in state.items()
    }


def _check_model(path: Any, metadata: Metadata, expected: dict[str, Any]) -> None:
    saved = {
        k[len(MODEL) + 1 :]: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(f"{MODEL}.")
    }
    parts = shape_differences(expected, saved)
    if parts:
        raise CheckpointError(
            f"{path} does not fit this model: " + "; ".join(parts) + ". Expected a DCP "
            "checkpoint of the same architecture with keys model.<name> (FSDP2's "
            "get_state_dict names, no wrapper prefix)."
        )


def _load_sharded(
    path: Any,
    metadata: Metadata,
    model: ShardedDataParallel,
    optimizer: Any,
    process_group: dist.ProcessGroup | None,
) -> None:
    targets = {f"{MODEL}.{k}": v for k, v in dcp_state.model_state(model).items()}
    plan: list = []
    if optimizer is not None:
        optim_targets, plan = dcp_state.optimizer_targets(model, optimizer, metadata)
        targets.update(optim_targets)
    with _quiet():
        torch_dcp.load(
            targets,
            storage_reader=FileSystemReader(path),
            planner=PieceLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=process_group,
        )
    dcp_state.after_model_load(model)
    if optimizer is not None:
        dcp_state.apply_optimizer(model, optimizer, targets, plan)


def _load_replicated(
    path: Any, model: nn.Module, optimizer: Any, process_group: dist.ProcessGroup | None
) -> None:
    """DDP or a plain module: torch's own state-dict functions, every rank reads it all."""
    module = unwrap(model)
    state = state_to_save(module, optimizer)
    reader = FileSystemReader(path)
    with _quiet():
        torch_dcp.load(state, storage_reader=reader, process_group=process_group)
    optimizers = () if optimizer is None else (optimizer,)
    set_state_dict(
        module,
        optimizers,
        model_state_dict=state[MODEL],
        optim_state_dict=state.get(OPTIMIZER, {}),
    )
