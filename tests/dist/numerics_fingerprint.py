"""Print a SHA-256 of the engine's final parameters, gradients and buffers per parity scenario.

A refactor that must not change numerics is checked by running this before and
after it and comparing the lines (`diff`): every scenario of engine_models at
world sizes 2 and 4, with the engine's default bucketing and with each
all-reduce algorithm; then the sharded engine's stages 1, 2 and 3 (several
buckets or wrapped units, a no_sync() micro-batch, AdamW), at the same sizes.

    .venv/bin/python tests/dist/numerics_fingerprint.py > before.txt
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from engine_models import SCENARIOS, _step, batches, build
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lockstep
from lockstep.testing import run_ranks

VARIANTS = {
    "native": {},
    "ring": {"allreduce": "ring"},
    "fp16_hook": {"comm_hook": "fp16"},
}


def _digest(result: dict) -> str:
    h = hashlib.sha256()
    for part in ("params", "grads", "buffers"):
        for name in sorted(result[part]):
            tensor = result[part][name]
            h.update(name.encode())
            if tensor is not None:
                h.update(
                    tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                )
    return h.hexdigest()[:16]


def _train(s, rank: int, world: int, hook: str | None) -> dict:
    model = build(s.model)
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    ddp = lockstep.DistributedDataParallel(model, **s.ddp_kwargs)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for micro in batches(s):
        opt.zero_grad(set_to_none=s.set_to_none)
        _step("lockstep", ddp, s, micro, rank, world)
        grads = {n: p.grad for n, p in model.named_parameters()}
        grads = {n: None if g is None else g.detach().clone() for n, g in grads.items()}
        opt.step()
    return {
        "params": dict(model.named_parameters()),
        "buffers": dict(model.named_buffers()),
        "grads": grads,
    }


def _all(ctx) -> dict[str, str]:
    out = {}
    for variant, extra in VARIANTS.items():
        for s in SCENARIOS:
            if variant == "fp16_hook" and s.ddp_kwargs.get("find_unused_parameters"):
                continue
            kwargs = {**s.ddp_kwargs, **{k: v for k, v in extra.items() if k != "comm_hook"}}
            scenario = replace(s, name=f"{s.name}/{variant}", ddp_kwargs=kwargs)
            hook = extra.get("comm_hook")
            out[scenario.name] = _digest(_train(scenario, ctx.rank, ctx.world_size, hook))
    return out


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _sharded_train(stage: int, rank: int) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), _Block(), _Block(), torch.nn.Linear(16, 4))
    if rank == 1:  # the wrapper must start every rank from rank 0's weights
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.5)
    wrap = [_Block] if stage == 3 else None
    caps = {"bucket_cap_mb": 0.0005, "first_bucket_cap_mb": 0.0002}
    model = lockstep.ShardedDataParallel(net, stage=stage, wrap=wrap, **caps)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        opt.zero_grad()
        with model.no_sync():
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        grads = {f"shard{i}": p.grad.detach().clone() for i, p in enumerate(model.parameters())}
        opt.step()
    return {"params": model.state_dict(), "buffers": {}, "grads": grads}


def _sharded_all(ctx) -> dict[str, str]:
    return {f"sharded/stage{s}": _digest(_sharded_train(s, ctx.rank)) for s in (1, 2, 3)}


def main() -> None:
    for world in (2, 4):
        for run in (_all, _sharded_all):
            results = run_ranks(run, world, deadline_s=600, timeout_s=120)
            for name in results[0]:
                print(f"world{world} {name} " + " ".join(r[name] for r in results))


if __name__ == "__main__":
    main()
