"""Checkpointer with a sharded model: exact resume at the same world size, resharded at another.

A stage-3 GPT trains 2 steps, is saved (every rank gathers, rank 0 writes, as
atomically as any checkpoint), and trains 2 more. A fresh run restoring the
checkpoint at world size 2 must repeat those 2 steps bitwise. Restored at
world size 4 (stage 3), at world size 2 with stage 1 (other units) and into
lockstep's DDP, the model and the per-parameter optimizer state must be
exactly the saved ones, each rank holding its new slice.
"""

from __future__ import annotations

import torch
from sharded_cases import Block, build, global_batches, loss_of

import lockstep
from lockstep.testing import run_ranks


def _model(stage: int) -> lockstep.ShardedDataParallel:
    return lockstep.ShardedDataParallel(
        build("gpt"), stage=stage, wrap=[Block] if stage == 3 else None
    )


def _steps(ctx, model, opt, batches) -> list[torch.Tensor]:
    losses = []
    for (idx,) in batches:
        loss = loss_of("gpt", model, (idx.chunk(ctx.world_size)[ctx.rank],))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _save_then_train(ctx, directory: str) -> dict:
    model = _model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = global_batches("gpt", 4)
    _steps(ctx, model, opt, batches[:2])
    lockstep.Checkpointer(directory).save(2, model=model, optimizer=opt)
    saved = {"model": model.state_dict(), "optimizer": model.optimizer_state_dict(opt)}
    losses = _steps(ctx, model, opt, batches[2:])
    return {"saved": saved, "losses": losses, "final": model.state_dict()}


def _restore(ctx, directory: str, stage: int, train: bool) -> dict:
    if stage == 0:
        return _restore_ddp(ctx, directory)
    model = _model(stage)
    torch.manual_seed(123)  # a different start: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = lockstep.Checkpointer(directory).restore(model=model, optimizer=opt)
    out = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": model.optimizer_state_dict(opt),
    }
    if train:
        out["losses"] = _steps(ctx, model, opt, global_batches("gpt", 4)[2:])
        out["final"] = model.state_dict()
    return out


def _restore_ddp(ctx, directory: str) -> dict:
    """lockstep DDP from the sharded checkpoint: plain keys, per-parameter optimizer state."""
    model = lockstep.DDP(build("gpt"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = lockstep.Checkpointer(directory).restore(model=model, optimizer=opt)
    saved = opt.state_dict()
    saved["sharded"] = True
    return {"step": step, "model": model.state_dict(), "optimizer": saved}


def _same(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key}"


def _same_optimizer(a: dict, b: dict, what: str) -> None:
    assert a["param_groups"] == b["param_groups"], what
    assert a["state"].keys() == b["state"].keys(), what
    for index, entry in a["state"].items():
        _same(entry, b["state"][index], f"{what}: optimizer state of parameter {index}")


def test_resume_exact_at_same_world_size_and_resharded_at_another(tmp_path):
    directory = str(tmp_path / "ckpt")
    first = run_ranks(_save_then_train, 2, directory, deadline_s=120, timeout_s=30)
    again = run_ranks(_restore, 2, directory, 3, True, deadline_s=120, timeout_s=30)
    for rank in range(2):
        assert again[rank]["step"] == 2
        for x, y in zip(first[rank]["losses"], again[rank]["losses"], strict=True):
            assert torch.equal(x, y), f"rank {rank}: resumed loss differs"
        _same(first[rank]["final"], again[rank]["final"], "final parameters after resume")
    saved = first[0]["saved"]
    for world, stage in ((4, 3), (2, 1), (2, 0)):
        for out in run_ranks(_restore, world, directory, stage, False, deadline_s=120):
            what = f"world size {world}, stage {stage}"
            _same(saved["model"], out["model"], f"model restored at {what}")
            _same_optimizer(saved["optimizer"], out["optimizer"], what)
