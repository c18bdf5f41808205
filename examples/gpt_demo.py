"""Train a character-level GPT on the Python standard library with 2 processes, and look inside.

    lockstep run --nproc-per-node 2 examples/gpt_demo.py          # or: make demo
    python examples/gpt_demo.py --steps 20                         # one process, same code
    LOCKSTEP_TIMEOUT_S=60 lockstep run --nproc-per-node 2 examples/gpt_demo.py --steps 100

Every rank builds the same model; `lockstep.DistributedDataParallel` averages the
gradients, `lockstep.shard` gives each rank its share of the text windows,
`lockstep.Checkpointer` saves every `--checkpoint-every` steps and at the end, and a
re-run resumes from the last checkpoint and trains `--steps` more. `lockstep.Monitor`
prints (rank 0 only) a progress bar and a line per interval with loss, samples/s and
overlap %, a straggler check every 100 steps, and writes under `--out`:
metrics.jsonl, trace/ (Chrome trace per rank and merged: open trace/trace.json in
Perfetto), timeline.png (the last steps, one lane per rank) and loss.png. At the end
every rank checksums its parameters and the checksums are compared across ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from char_gpt import CharGPT, CharWindows, encode, stdlib_text
from torch.nn import functional as F

import lockstep
from lockstep.observe import ReplicaCheck, check_replicas, plot_loss, plot_timeline


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--steps", type=int, default=500, help="steps to train in this run (default 500)")
    add("--batch-size", type=int, default=16, help="windows per rank per step (default 16)")
    add("--context", type=int, default=64, help="characters per window (default 64)")
    add("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default 3e-3)")
    add("--log-every", type=int, default=50, help="steps per log line (default 50)")
    add("--checkpoint-every", type=int, default=250, help="steps per checkpoint (default 250)")
    add("--max-bytes", type=int, default=2_000_000, help="characters of stdlib text to read")
    add("--out", default="runs/gpt_demo", help="output directory (default runs/gpt_demo)")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


def batches(loader: lockstep.data.ShardedLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches forever: each pass over the loader is the next epoch (or the rest of one)."""
    while True:
        yield from loader


def warmup(step: int) -> float:
    """Learning-rate factor: linear warm-up over the first 20 steps, then constant."""
    return min(1.0, (step + 1) / 20)


@dataclass
class Training:
    """Everything a step touches, built the same way on every rank."""

    model: CharGPT
    ddp: lockstep.DistributedDataParallel
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    loader: lockstep.data.ShardedLoader
    checkpointer: lockstep.Checkpointer


def build(args: argparse.Namespace, data: CharWindows) -> Training:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = CharGPT(args.context)
    # Small buckets for a small model (1.3 MB of gradients): several all-reduces per step,
    # launched while backward goes on, so the overlap shows in the timeline.
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.25, first_bucket_cap_mb=0.25)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    loader = lockstep.shard(data, batch_size=args.batch_size, seed=args.seed, drop_last=True)
    checkpointer = lockstep.Checkpointer(Path(args.out) / "checkpoints", keep=2)
    return Training(model, ddp, opt, sched, loader, checkpointer)


def main(argv: list[str] | None = None) -> int:
    """Train, report on rank 0, and return 0 when every replica ends identical (else 1)."""
    args = parse_args(argv)
    ctx = lockstep.init()
    text, files = stdlib_text(args.max_bytes)
    data = CharWindows(encode(text), args.context)
    t = build(args, data)
    start = (
        t.checkpointer.restore(model=t.ddp, optimizer=t.opt, sampler=t.loader, scheduler=t.sched)
        or 0
    )
    end = start + args.steps
    if ctx.is_main:
        params = sum(p.numel() for p in t.model.parameters())
        print(
            f"data: {len(text):,} characters of the standard library ({files} files), "
            f"{len(data):,} windows of {args.context}"
        )
        print(
            f"model: {params / 1e6:.2f}M parameters; {ctx.world_size} rank(s) x "
            f"{args.batch_size} windows per step"
        )
        print(f"resumed from step {start} ({t.checkpointer.directory})" if start else "fresh start")
    monitor = lockstep.Monitor(
        t.ddp,
        ctx,
        optimizer=t.opt,
        log_every=args.log_every,
        total_steps=end,
        start_step=start,
        log_dir=args.out,
        trace=Path(args.out) / "trace",
        trace_steps=20,
        straggler_every=100,
    )
    began = time.perf_counter()
    train(args, t, monitor, start, end)
    merged = monitor.close()
    check = check_replicas(t.ddp)  # every rank's checksum, all-gathered
    if ctx.is_main:
        report(args, t.model, monitor, merged, check, end - start, time.perf_counter() - began)
    return 0 if check.identical else 1


def train(
    args: argparse.Namespace, t: Training, monitor: lockstep.Monitor, start: int, end: int
) -> None:
    """The loop: forward, backward (gradients averaged inside), step, record, save."""
    stream = batches(t.loader)
    for step in range(start + 1, end + 1):
        x, y = next(stream)
        loss = F.cross_entropy(t.ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        t.opt.step()
        t.opt.zero_grad(set_to_none=True)
        t.sched.step()
        monitor.step(loss, batch_size=len(x))
        if step % args.checkpoint_every == 0 or step == end:
            t.checkpointer.save(
                step, model=t.ddp, optimizer=t.opt, sampler=t.loader, scheduler=t.sched
            )


def report(
    args: argparse.Namespace,
    model: CharGPT,
    monitor: lockstep.Monitor,
    merged: Path | None,
    check: ReplicaCheck,
    steps: int,
    seconds: float,
) -> None:
    """Rank 0's closing words: figures, pictures, the replica check and a sample."""
    out = Path(args.out)
    summary = monitor.last_summary
    if summary is not None:
        print(
            f"trained {steps} steps in {seconds:.1f} s; last interval: "
            f"{summary.samples_per_second:.0f} samples/s, overlap {summary.overlap:.0%}"
        )
    if merged is not None:
        print(f"trace: {merged} (open it in https://ui.perfetto.dev)")
        print(f"timeline: {plot_timeline(merged, out / 'timeline.png', steps=3)}")
    print(f"loss curve: {plot_loss(out / 'metrics.jsonl', out / 'loss.png')}")
    print(check.describe())
    model.eval()
    sample = model.generate("def ", 160, seed=args.seed)
    print("sample:\n" + "\n".join("    " + line for line in sample.splitlines()))


if __name__ == "__main__":
    code = main()
    lockstep.shutdown()
    sys.exit(code)
