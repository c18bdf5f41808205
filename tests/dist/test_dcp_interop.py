"""DCP checkpoints move between lockstep and torch FSDP2 both ways, and across world sizes.

Oracle: torch's own `fully_shard` + `torch.distributed.checkpoint`, on gloo. At
world size 2 a run that resumes from the other tool's checkpoint must repeat the
writer's next steps bitwise (losses and final parameters): lockstep stage 3 and
stage 2 from FSDP2's checkpoint, FSDP2 from lockstep stage 3's and stage 2's,
and lockstep DDP and stage 3 from each other's. At world sizes 1 and 3 (another
layout) the loaded model and optimizer state must be exactly what was saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dcp_cases import read, write
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # four runs written and six resumed: 10-30 s on a busy machine

WRITERS = ("fsdp2", "stage3", "stage2", "ddp")
RESUMES = [("fsdp2", "stage3"), ("fsdp2", "stage2"), ("stage3", "fsdp2"), ("stage2", "fsdp2")]
RESUMES += [("ddp", "stage3"), ("stage3", "ddp")]


def _world2(ctx, root: str) -> dict:
    out = {w: write(ctx, w, f"{root}/{w}") for w in WRITERS}
    for writer, reader in RESUMES:
        out[(writer, reader)] = read(ctx, reader, f"{root}/{writer}", True)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    return root, run_ranks(_world2, 2, root, deadline_s=240, timeout_s=60)


def _same(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: keys differ"
    for key, x in a.items():
        if isinstance(x, dict):
            _same(x, b[key], f"{what} {key}")
        else:
            assert torch.equal(x, b[key]), f"{what}: {key} differs"


@pytest.mark.parametrize(("writer", "reader"), RESUMES)
def test_a_run_resumed_from_the_other_tool_repeats_it_bitwise(world2, writer, reader):
    for rank, results in enumerate(world2[1]):
        first, again = results[writer], results[(writer, reader)]
        assert again["step"] == 2
        what = f"{reader} resumed from {writer}'s checkpoint, rank {rank}"
        _same(first["saved"], again["loaded"], f"{what}: loaded state")
        for x, y in zip(first["losses"], again["losses"], strict=True):
            assert torch.equal(x, y), f"{what}: loss {y.item()} instead of {x.item()}"
        _same(first["final"], again["final"], f"{what}: final parameters")


def test_lockstep_writes_only_its_own_pieces_in_rectangles(world2):
    """A flat shard's piece that is not a block of rows is saved as several rectangles."""
    root, _ = world2
    metadata = FileSystemReader(f"{root}/stage3/step_00000002").read_metadata()
    chunks = metadata.state_dict_metadata["model.blocks.0.fc.weight"].chunks
    assert any(c.offsets[1] != 0 for c in chunks), chunks  # a partial row
    assert sum(c.sizes[0] * c.sizes[1] for c in chunks) == 40 * 10
    files = {info.relative_path for info in metadata.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}
    sizes = [(Path(root) / "stage3/step_00000002" / name).stat().st_size for name in sorted(files)]
    assert max(sizes) < 0.6 * sum(sizes), sizes  # each rank wrote its half, nobody the whole


def _reshard(ctx, root: str) -> dict:
    pairs = [("fsdp2", "stage3"), ("stage3", "fsdp2"), ("stage2", "stage3"), ("stage3", "stage2")]
    pairs.append(("fsdp2", "stage1"))
    return {(w, r): read(ctx, r, f"{root}/{w}", False) for w, r in pairs}


@pytest.mark.parametrize("world", [1, 3])
def test_another_world_size_loads_exactly_the_saved_state(world2, world):
    root, first = world2
    for rank, results in enumerate(run_ranks(_reshard, world, root, deadline_s=120)):
        for (writer, reader), out in results.items():
            what = f"{reader} at world size {world} from {writer} at 2, rank {rank}"
            _same(first[0][writer]["saved"], out["loaded"], what)


def test_torchs_offline_converter_reads_a_lockstep_checkpoint(world2, tmp_path):
    """torch's `dcp_to_torch_save` (one process, no model) rebuilds the saved state exactly."""
    root, first = world2
    for writer in ("stage3", "stage2"):
        out = tmp_path / f"{writer}.pt"
        dcp_to_torch_save(f"{root}/{writer}/step_00000002", out)
        state = torch.load(out, weights_only=False)  # our own file, just written
        saved = first[0][writer]["saved"]
        _same(saved["model"], state["model"], f"{writer}: model")
        _same(saved["optimizer"], state["optimizer"]["state"], f"{writer}: optimizer")


def _hsdp_write(ctx, root: str) -> dict:
    return write(ctx, "hsdp3", f"{root}/hsdp3")


def _stage3_read(ctx, root: str) -> dict:
    return read(ctx, "stage3", f"{root}/hsdp3", False)


def test_an_hsdp_checkpoint_at_2x2_loads_exactly_into_stage_3_at_world_size_2(tmp_path):
    """Replicas hold the same rectangles: DCP keeps one copy, any layout reads it back."""
    root = str(tmp_path)
    written = run_ranks(_hsdp_write, 4, root, deadline_s=120, timeout_s=60)
    for rank, out in enumerate(run_ranks(_stage3_read, 2, root, deadline_s=120, timeout_s=60)):
        _same(written[0]["saved"], out["loaded"], f"stage 3 from HSDP, rank {rank}")
    metadata = FileSystemReader(f"{root}/hsdp3/step_00000002").read_metadata()
    chunks = metadata.state_dict_metadata["model.blocks.0.fc.weight"].chunks
    assert sum(c.sizes[0] * c.sizes[1] for c in chunks) == 40 * 10  # each element once
