"""lockstep against torch on a GPU: DDP step time at world size 1 (NCCL), the engine's CPU
cost, and the sharded engine against FSDP2 at world size 2 (gloo, CUDA tensors, one GPU).

    PYTHONPATH=src python benchmarks/gpu_vs_torch.py             # on a GPU machine
    PYTHONPATH=src python benchmarks/gpu_vs_torch.py --smoke     # tiny sizes; runs on CPU too

Part 1: a GPT of 124M parameters (12 blocks of width 768, vocabulary 50304,
context 1024, tied head) trained under bf16 autocast with AdamW, batch 8 x 1024,
wrapped by lockstep's DDP and by torch's (same bucket arguments, gradients as
bucket views), in alternating phases (A/B then B/A); every step ends with a
device synchronise; the median step of each engine over all phases. The engine's
CPU time: host time inside lockstep's gradient hooks and its end-of-backward
finalize, per step and per gradient tensor (the aim: within 2% of torch's step).
Part 2: two gloo ranks on the one GPU train a smaller GPT (8 x 512, vocabulary
8192, context 256) with lockstep DDP, stages 1-3 and torch FSDP2 (per block and
root), each engine in its own block, in two rounds (forward order, then reversed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from workloads import SmallGPT, _Block, _next_token_loss

import lockstep
from lockstep.testing import run_ranks
from lockstep.testing.mesh import device_mesh

BIG = {"vocab": 50304, "width": 768, "layers": 12, "context": 1024, "batch": 8}
MID = {"vocab": 8192, "width": 512, "layers": 8, "context": 256, "batch": 4}
TINY = {"vocab": 256, "width": 64, "layers": 2, "context": 32, "batch": 2}
SHARDED_ENGINES = ("ddp", "stage1", "stage2", "stage3", "fsdp2")


def gpt(size: dict, device: str) -> nn.Module:
    torch.manual_seed(0)
    model = SmallGPT(size["vocab"], size["width"], size["layers"], size["context"])
    model.head.weight = model.tok.weight  # tied, as GPT-2: 124M parameters at BIG
    return model.to(device)


def tokens(size: dict, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, size["vocab"], (size["batch"], size["context"] + 1), generator=gen)
    t = t.to(device)
    return t[:, :-1], t[:, 1:]


def synchronise(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class EngineClock:
    """Host seconds in lockstep's gradient hooks and the driver's finalize (instance patches)."""

    def __init__(self, reducer) -> None:
        self.seconds, self.steps = 0.0, 0
        self.tensors = len(reducer.params)
        reducer._mark_ready = self._timed(reducer._mark_ready)
        driver = reducer.driver  # runtime/driver.py: queues its `_finalize` every step
        finalize = self._timed(driver._finalize)
        driver._finalize = lambda: (finalize(), self._count())

    def _count(self) -> None:
        self.steps += 1

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def _ddp_step(model, opt, batch, device: str) -> float:
    start = time.perf_counter()
    amp = torch.autocast(device, dtype=torch.bfloat16)
    with amp:
        loss = _next_token_loss(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    synchronise(device)
    return time.perf_counter() - start


def part1(size: dict, device: str, phases: int, steps: int) -> dict:
    """World size 1 in this process: lockstep DDP / torch DDP step time, engine CPU time."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        kwargs = {"gradient_as_bucket_view": True, "bucket_cap_mb": 25}
        if device == "cuda":
            kwargs["device_ids"] = [0]
        models = {
            "lockstep": lockstep.DistributedDataParallel(gpt(size, device), **kwargs),
            "torch": nn.parallel.DistributedDataParallel(gpt(size, device), **kwargs),
        }
        opts = {
            k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device == "cuda")
            for k, m in models.items()
        }
        clock = EngineClock(models["lockstep"].reducer)
        gen = torch.Generator().manual_seed(0)
        times: dict[str, list[float]] = {"lockstep": [], "torch": []}
        for phase in range(phases):
            order = ("lockstep", "torch") if phase % 2 == 0 else ("torch", "lockstep")
            for name in order:
                _ddp_step(models[name], opts[name], tokens(size, device, gen), device)  # warm
                times[name] += [
                    _ddp_step(models[name], opts[name], tokens(size, device, gen), device)
                    for _ in range(steps)
                ]
        ours, theirs = statistics.median(times["lockstep"]), statistics.median(times["torch"])
        engine_s = clock.seconds / max(clock.steps, 1)
        params = sum(p.numel() for p in models["torch"].parameters())
        return {
            "params_m": params / 1e6,
            "lockstep_ms": ours * 1e3,
            "torch_ms": theirs * 1e3,
            "ratio": ours / theirs,
            "engine_cpu_ms_per_step": engine_s * 1e3,
            "engine_cpu_us_per_tensor": engine_s * 1e6 / clock.tensors,
            "engine_cpu_share_of_torch_step": engine_s / theirs,
            "grad_tensors": clock.tensors,
            "steps_per_engine": len(times["torch"]),
        }
    finally:
        dist.destroy_process_group()


def wrap_sharded(engine: str, model: nn.Module) -> nn.Module:
    if engine == "ddp":
        return lockstep.DistributedDataParallel(model)
    if engine == "fsdp2":  # an explicit mesh: the accelerator's would not fit a CPU model
        from torch.distributed.fsdp import fully_shard

        mesh = device_mesh(next(model.parameters()).device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    stage = int(engine.removeprefix("stage"))
    return lockstep.ShardedDataParallel(model, stage=stage, wrap=[_Block] if stage == 3 else None)


def sharded_rank(ctx, size: dict, device: str, steps: int) -> dict:
    """On each of two gloo ranks: median step time per engine, two rounds."""
    if device == "cuda":
        torch.cuda.set_device(0)
    times: dict[str, list[float]] = {e: [] for e in SHARDED_ENGINES}
    gen = torch.Generator().manual_seed(1 + ctx.rank)
    for round_ in range(2):
        for engine in SHARDED_ENGINES if round_ == 0 else reversed(SHARDED_ENGINES):
            model = wrap_sharded(engine, gpt(size, device))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            _sharded_step(model, opt, tokens(size, device, gen), device)  # warm
            times[engine] += [
                _sharded_step(model, opt, tokens(size, device, gen), device) for _ in range(steps)
            ]
            del model, opt
            if device == "cuda":
                torch.cuda.empty_cache()
    return {e: statistics.median(t) * 1e3 for e, t in times.items()}


def _sharded_step(model, opt, batch, device: str) -> float:
    dist.barrier()
    start = time.perf_counter()
    amp = (
        torch.autocast(device, dtype=torch.bfloat16)
        if device == "cuda"
        else contextlib.nullcontext()
    )
    with amp:
        loss = _next_token_loss(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    synchronise(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few steps (any device)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--phases", type=int, default=6, help="world 1: alternating phases")
    parser.add_argument("--steps", type=int, default=20, help="world 1: timed steps per phase")
    parser.add_argument("--sharded-steps", type=int, default=6, help="world 2: per engine, round")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    big, mid = (TINY, TINY) if args.smoke else (BIG, MID)
    steps = 2 if args.smoke else args.steps
    sharded_steps = 2 if args.smoke else args.sharded_steps
    phases = 2 if args.smoke else args.phases
    out = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "smoke": args.smoke,
    }
    out["ddp_world1"] = part1(big, args.device, phases, steps)
    ranks = run_ranks(
        sharded_rank, 2, mid, args.device, sharded_steps, deadline_s=400, timeout_s=120
    )
    out["sharded_world2_ms"] = {e: max(r[e] for r in ranks) for e in SHARDED_ENGINES}
    print(render(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


def render(out: dict) -> str:
    one = out["ddp_world1"]
    lines = [
        f"device: {out['device']}, torch {out['torch']}{' (smoke sizes)' if out['smoke'] else ''}",
        f"world 1: GPT {one['params_m']:.1f}M bf16: lockstep {one['lockstep_ms']:.2f} ms, "
        f"torch {one['torch_ms']:.2f} ms, ratio {one['ratio']:.3f}",
        f"engine CPU: {one['engine_cpu_ms_per_step']:.3f} ms/step "
        f"({one['engine_cpu_share_of_torch_step']:.1%} of torch's step), "
        f"{one['engine_cpu_us_per_tensor']:.2f} us per gradient tensor ({one['grad_tensors']})",
        "world 2 gloo: "
        + ", ".join(f"{e} {ms:.1f} ms" for e, ms in out["sharded_world2_ms"].items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
