"""Per-rank memory under a mixed-precision policy and per-unit resharding, against the plan.

    PYTHONPATH=src python benchmarks/policy_memory.py            # 2 gloo ranks, CPU
    PYTHONPATH=src python benchmarks/policy_memory.py --world-size 4 --json out.json

The GPT of benchmarks/workloads.py (gpt-5m, 5.8M parameters, fp32) trains with
`mp_policy=MixedPrecisionPolicy(bf16, fp32)` and AdamW at N ranks. Rank 0's storages
(`plan/measured.py`: each storage once, a freed stage-3 buffer counts zero) are
compared with `lockstep plan --weights-dtype fp32 --param-dtype bf16`: the model
states after a step (before zero_grad) for stages 1 to 3, and for stage 3 the
weights between forward and backward, with every block resharded (only the root
kept) and with every block kept gathered (`reshard_after_forward={Block: False}`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.plan.measured import measured_bytes, planned_bytes, planned_gathered
from lockstep.testing import run_ranks

POLICY = lockstep.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MB = 1e6


def _block_class(model: torch.nn.Module) -> type:
    return type(model.blocks[0])


def _wrap(stage: int, reshard: object = True) -> lockstep.ShardedDataParallel:
    plain = build("gpt-5m")
    wrap = [_block_class(plain)] if stage == 3 else None
    return lockstep.ShardedDataParallel(
        plain, stage=stage, wrap=wrap, mp_policy=POLICY, reshard_after_forward=reshard
    )


def _loss(ctx, model, step: int) -> torch.Tensor:
    work = WORKLOADS["gpt-5m"]
    x, y = work.batch(torch.Generator().manual_seed(100 * ctx.rank + step))
    return work.loss(model(x), y)


def _after_step(ctx, stage: int) -> dict:
    model = _wrap(stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(2):
        opt.zero_grad()
        _loss(ctx, model, step).backward()
        opt.step()
    got = measured_bytes(model, opt)
    want = planned_bytes(build("gpt-5m"), ctx.world_size, stage, POLICY)
    return {
        part: (getattr(got, part), getattr(want, part))
        for part in ("weights", "grads", "optimizer", "total")
    }


def _between(ctx, keep_blocks: bool) -> tuple[float, float]:
    plain = build("gpt-5m")
    every = sum(p.numel() for p in plain.parameters())
    blocks = sum(p.numel() for b in plain.blocks for p in b.parameters())
    kept = every if keep_blocks else every - blocks
    model = _wrap(3, {_block_class(plain): False} if keep_blocks else True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _loss(ctx, model, 0).backward()
    opt.step()
    opt.zero_grad()
    loss = _loss(ctx, model, 1)
    got = measured_bytes(model, opt).weights
    loss.backward()
    want = planned_bytes(build("gpt-5m"), ctx.world_size, 3, POLICY).weights
    return got, want + planned_gathered(build("gpt-5m"), ctx.world_size, kept, POLICY)


def memory_rank(ctx) -> dict:
    return {
        "after": {stage: _after_step(ctx, stage) for stage in (1, 2, 3)},
        "between": {"resharded": _between(ctx, False), "kept": _between(ctx, True)},
    }


def _cell(pair: tuple[float, float]) -> str:
    return f"{pair[0] / MB:.2f} / {pair[1] / MB:.2f}"


def table(result: dict) -> str:
    lines = [
        f"after a step, measured / planned (MB = 1e6 bytes), rank 0, N = {result['world']}, "
        "bf16 compute, fp32 reduce",
        "",
        "| stage | weights | gradients | optimizer | total | measured / planned |",
        "|---|---|---|---|---|---|",
    ]
    for stage, row in result["after"].items():
        cells = " | ".join(_cell(row[p]) for p in ("weights", "grads", "optimizer", "total"))
        ratio = row["total"][0] / row["total"][1]
        lines.append(f"| {stage} | {cells} | {ratio:.3f} |")
    lines += [
        "",
        "| stage 3, between forward and backward | weights | measured / planned |",
        "|---|---|---|",
    ]
    for name, pair in result["between"].items():
        label = {"resharded": "blocks resharded (root kept)", "kept": "{Block: False}"}[name]
        lines.append(f"| {label} | {_cell(pair)} | {pair[0] / pair[1]:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    result = run_ranks(memory_rank, args.world_size, deadline_s=300, timeout_s=120)[0]
    result["world"] = args.world_size
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
