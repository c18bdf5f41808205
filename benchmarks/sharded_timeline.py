"""Stage 3's collectives as lanes: all-gathers and reduce-scatters against forward and backward.

    python benchmarks/sharded_timeline.py                   # writes docs/img/sharded_timeline.png
    python benchmarks/sharded_timeline.py --stage 2 --out /tmp/stage2.png

Two gloo ranks train gpt-5m (workloads.py) under ShardedDataParallel (stage 3,
one unit per block) for a few steps; the last step is recorded with a
`lockstep.sharded.timeline.Timeline` and drawn per rank in three lanes:
compute (forward, backward), all-gather (one bar per unit, from launch to when
it was seen done: a prefetch starts before its unit runs) and reduce-scatter
(one bar per unit, launched as soon as the unit's gradient is complete).
A bar under the backward bar is communication hidden behind compute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, _Block, build

import lockstep
from lockstep.sharded.timeline import Timeline
from lockstep.testing import run_ranks

NAME = "gpt-5m"
LANES = ("compute", "all-gather", "reduce")
COLORS = {"forward": "#4c72b0", "backward": "#55a868", "all-gather": "#dd8452", "reduce": "#c44e52"}


def rank_main(ctx: lockstep.DistContext, stage: int, steps: int) -> list[tuple]:
    torch.set_num_threads(1)
    model = lockstep.ShardedDataParallel(
        build(NAME), stage=stage, wrap=[_Block] if stage == 3 else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(ctx.rank)
    timeline = Timeline()
    for step in range(steps):
        if step == steps - 1:
            torch.distributed.barrier()
            model.record_timeline(timeline)
        x, y = WORKLOADS[NAME].batch(gen)
        WORKLOADS[NAME].loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    t0 = timeline.spans[0].start
    return [(s.lane, s.label, s.start - t0, s.end - t0) for s in timeline.spans if s.end]


def draw(per_rank: list[list[tuple]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(per_rank), 1, figsize=(11, 1.6 * len(per_rank) + 0.6))
    for rank, (ax, spans) in enumerate(zip(axes, per_rank, strict=True)):
        for lane, label, start, end in spans:
            row = LANES.index(lane)
            color = COLORS[label] if lane == "compute" else COLORS[lane]
            ax.barh(
                row,
                1e3 * (end - start),
                left=1e3 * start,
                height=0.7,
                color=color,
                edgecolor="white",
                linewidth=0.5,
            )
        ax.set_yticks(range(len(LANES)), [f"rank {rank} {lane}" for lane in LANES])
        ax.invert_yaxis()
    axes[-1].set_xlabel("ms since the recorded step began")
    axes[0].set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/img/sharded_timeline.png"))
    args = parser.parse_args()
    per_rank = run_ranks(rank_main, 2, args.stage, args.steps, deadline_s=600, timeout_s=300)
    title = f"ShardedDataParallel stage {args.stage}, gpt-5m, 2 gloo ranks (one step)"
    draw(per_rank, args.out, title)
    for lane in LANES:
        print(lane, len([s for s in per_rank[0] if s[0] == lane]), "spans on rank 0")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
