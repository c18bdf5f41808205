"""Runs shared by the DCP checkpoint tests: lockstep and torch FSDP2 save, load and go on.

The model is TinyGPT with width 10 (`sharded_cases.py`), so flat shards cut its
parameters inside rows: a lockstep checkpoint then holds rectangles that are not
row blocks. FSDP2 saves and loads the way torch documents it: `get_state_dict`,
`dcp.save({"model": ..., "optimizer": ...})`, `dcp.load`, `set_state_dict`.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as torch_dcp
from sharded_cases import TinyGPT, global_batches, loss_of, wrap
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import lockstep
from lockstep.checkpoint import dcp

STEP = 2  # steps before the save; as many again after it


def build(engine: str) -> nn.Module:
    torch.manual_seed(0)
    return wrap(engine, TinyGPT(width=10), "gpt")


def train(ctx, model: nn.Module, opt, batches) -> list[torch.Tensor]:
    losses = []
    for (idx,) in batches:
        loss = loss_of("gpt", model, (idx.chunk(ctx.world_size)[ctx.rank],))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def fsdp2_save(model: nn.Module, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    torch_dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def fsdp2_load(model: nn.Module, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    torch_dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _copied(value):
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def full_state(engine: str, model: nn.Module, opt) -> dict:
    """Model and optimizer state in full, keyed by parameter name (every rank calls it)."""
    return _copied(_full_state(engine, model, opt))


def _full_state(engine: str, model: nn.Module, opt) -> dict:
    if engine == "fsdp2":
        options = StateDictOptions(full_state_dict=True)
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        return {"model": model_sd, "optimizer": optim_sd["state"]}
    names = [n for n, _ in TinyGPT(width=10).named_parameters()]
    saved = opt.state_dict() if engine == "ddp" else model.optimizer_state_dict(opt)
    optimizer = {names[i]: entry for i, entry in saved["state"].items()}
    return {"model": model.state_dict(), "optimizer": optimizer}


def save(engine: str, model: nn.Module, opt, directory: str) -> str:
    """Save after STEP steps: FSDP2 by hand, DDP with `lockstep.checkpoint.dcp.save` (no
    commit, no manifest), the sharded engine with `Checkpointer(format="dcp")`."""
    path = f"{directory}/step_{STEP:08d}"
    if engine == "fsdp2":
        fsdp2_save(model, opt, path)
        return path
    if engine == "ddp":
        dcp.save(path, model=model, optimizer=opt)
        return path
    return str(
        lockstep.Checkpointer(directory, format="dcp").save(STEP, model=model, optimizer=opt)
    )


def load(engine: str, model: nn.Module, opt, directory: str) -> int | None:
    """Load the checkpoint of `directory`, each tool the way `save` wrote it."""
    if engine == "fsdp2":
        fsdp2_load(model, opt, f"{directory}/step_{STEP:08d}")
        return STEP
    if engine == "ddp":
        dcp.load(f"{directory}/step_{STEP:08d}", model=model, optimizer=opt)
        return STEP
    return lockstep.Checkpointer(directory, format="dcp").restore(model=model, optimizer=opt)


def write(ctx, engine: str, directory: str) -> dict:
    """Train STEP steps, save, train STEP more: the run a resumed one must repeat."""
    model = build(engine)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = global_batches("gpt", 2 * STEP)
    train(ctx, model, opt, batches[:STEP])
    saved = full_state(engine, model, opt)
    save(engine, model, opt, directory)
    losses = train(ctx, model, opt, batches[STEP:])
    return {"saved": saved, "losses": losses, "final": full_state(engine, model, opt)["model"]}


def read(ctx, engine: str, directory: str, go_on: bool) -> dict:
    """Build from another seed, load, and (go_on) train the STEP steps after the save."""
    model = build(engine)
    torch.manual_seed(123)
    with torch.no_grad():  # a different start: everything must come from the checkpoint
        for p in model.parameters():
            p.uniform_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = load(engine, model, opt, directory)
    out = {"step": step, "loaded": full_state(engine, model, opt)}
    if go_on:
        out["losses"] = train(ctx, model, opt, global_batches("gpt", 2 * STEP)[STEP:])
        out["final"] = full_state(engine, model, opt)["model"]
    return out
