"""A small training script for the live-recovery tests: DDP, Adam, dropout, a checkpoint.

    lockstep run --nproc-per-node 2 --live-recovery tests/launch/train_live.py --out /tmp/live

Every step's global batch depends only on the step number, each rank keeps its own
dropout stream (seeded by its rank), and tiny buckets make a step several
all-reduces. LOCKSTEP_TEST_KILL="RANK:STEP:WHERE[,...]" makes rank RANK SIGKILL
itself at step STEP (`planned_kill`): WHERE is "backward" (inside backward, after
the other buckets were launched), "forward", "fingerprint" (every bucket launched,
before the step fingerprint, its last collective), "end_step" (its buckets reduced, in
the engine's end-of-step actions), "wrapper" (as the wrapper's forward starts, before
its own collectives), "optimizer" (before its update), "stepped" (after its
update), "close" (after the last step STEP, before the Monitor's close) or "ended"
(after the last step STEP, once every peer's script ended). WHERE+PEER
("backward+2") SIGKILLs rank PEER's first process just before (two kills at once).
Each rank writes OUT/final_rank<R>.pt (parameters and optimizer state) and
OUT/pids/<rank>.<generation>.<restart> with its pid. `--engine sharded` wraps with
lockstep.ShardedDataParallel instead (live recovery refuses it). `--monitor` adds a
`lockstep.Monitor` (a log line and a straggler report every 2 steps: collectives
between steps; `--trace` a trace too, whose files a barrier in `close()` awaits);
`--own-collective` an all-reduce of the loss after each step; `--batchnorm` a
BatchNorm layer, whose buffers DDP broadcasts from rank 0 at every forward;
`--uneven` runs the first 3 steps in DDP's Join, rank 1 one step fewer (it shadows
rank 0's third), and the others after it. `--strand STEP:A,B` leaves, at STEP, one
broadcast on the default group that never completes in every first process (`strand`);
`--linger` waits after the last step until the launcher started a replacement.
Rank 0's first process writes OUT/worker_store ("ADDR PORT" of the launcher's worker
store, for a test that writes into it); `--hold PATH` makes a process that is to kill
itself wait (at most 60 s) for PATH before its kill step.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.live import group as live_group
from lockstep.live import keys, registry

FEATURES, BATCH = 6, 8
UNEVEN_STEPS = 3  # `--uneven`: steps 0-2 in DDP's Join, rank 1 running steps 0-1 only


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--engine", choices=["ddp", "sharded"], default="ddp")
    parser.add_argument("--monitor", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--own-collective", action="store_true")
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--strand", default="")
    parser.add_argument("--linger", action="store_true")
    parser.add_argument("--hold", default="")
    return parser.parse_args()


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH * world_size, FEATURES, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[rows], y[rows]


def planned_kill(rank: int, first_process: bool) -> tuple[int, str]:
    """(step, where) at which this process kills itself, or (-1, "").

    LOCKSTEP_TEST_KILL lists "RANK:STEP:WHERE" items, comma-separated; each is for the
    first process of that rank (never a replacement nor a restarted one).
    """
    for plan in filter(None, os.environ.get("LOCKSTEP_TEST_KILL", "").split(",")):
        kill_rank, step, where = plan.split(":")
        if first_process and int(kill_rank) == rank:
            return int(step), where
    return -1, ""


def arm_kill(
    model: nn.Sequential,
    optimizer: torch.optim.Optimizer,
    where: str,
    when: list[bool],
    ddp: nn.Module | None = None,
    peer: Path | None = None,
) -> None:
    def die(*_: object) -> None:
        if when[0]:
            kill_now(peer)

    if where == "backward":  # the first layer's gradient comes last: other buckets are out
        model[0].weight.register_hook(lambda grad: die())
    elif where == "forward":
        model[2].register_forward_pre_hook(lambda *_: die())
    elif where == "end_step" and ddp is not None:  # first of the engine's end-of-step actions
        ddp.reducer.driver.end_of_step.insert(0, die)
    elif where == "fingerprint" and ddp is not None:  # the step's buckets out, not its fingerprint
        driver, send = ddp.reducer.driver, ddp.reducer.driver.send_fingerprint
        driver.send_fingerprint = lambda step: (die(), send(step))
    elif where == "wrapper" and ddp is not None:  # before the wrapper's own collectives
        ddp.register_forward_pre_hook(lambda *_: die())
    elif where == "optimizer":  # after the step's collectives, before its update
        optimizer.register_step_pre_hook(lambda *_: die())
    elif where == "stepped":  # after its update, the step's last act
        optimizer.register_step_post_hook(lambda *_: die())


def kill_now(peer: Path | None = None) -> None:
    """SIGKILL the process whose pid `peer` holds, if any, then this one, microseconds
    apart; with a peer, this process first takes 512 MB more, so that its exit (which
    frees its memory) outlasts the peer's by some 0.3 s, as a bigger rank's would."""
    if peer is not None:
        ballast = torch.ones(2**27)  # noqa: F841 (held, and freed by the exit)
        os.kill(int(peer.read_text()), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def split_peer(out: Path, where: str) -> tuple[str, Path | None]:
    """("backward", rank 2's first process's pid file) for "backward+2"; (where, None)."""
    where, _, peer = where.partition("+")
    return where, (out / "pids" / f"{peer}.0.0") if peer else None


def await_launcher(what: str, rank: int, world_size: int) -> None:
    """Until the launcher's worker store shows `what` (at most 60 s): "ended", every other
    rank's script ended (their bootstrap's post); "announced", a generation (a replacement
    was started)."""
    store, deadline = registry.store(), time.monotonic() + 60
    while time.monotonic() < deadline:
        if what == "announced" and live_group.read_announcement(store)[0]:
            return
        if what == "ended" and all(
            store.check([keys.ENDED.format(rank=r)]) for r in range(world_size) if r != rank
        ):
            return
        time.sleep(0.05)


def after_last_step(linger: bool, where: str, armed: bool, rank: int, world_size: int) -> None:
    """The kill points after the last step: "close" dies at once, "ended" once every peer's
    script ended; `--linger` waits for a replacement to be started before going on."""
    if armed and where in ("close", "ended"):
        if where == "ended":
            await_launcher("ended", rank, world_size)
        kill_now()
    if linger:
        await_launcher("announced", rank, world_size)


def publish_store(out: Path, mine: bool) -> None:
    """OUT/worker_store: "ADDR PORT" of the launcher's worker store (written whole, by
    rank 0's first process: `mine`)."""
    if not mine:
        return
    where = f"{os.environ['MASTER_ADDR']} {os.environ['MASTER_PORT']}"
    (out / "worker_store.tmp").write_text(where)
    (out / "worker_store.tmp").rename(out / "worker_store")


def hold(path: Path) -> None:
    """`--hold PATH`: wait (at most 60 s) until PATH exists."""
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def strand(spec: str, step: int, rank: int) -> None:
    """`--strand STEP:A,B`: at STEP, rank A starts a broadcast from rank B and B one from
    A, each waiting for the other for ever; any other rank one from itself, which nobody
    receives (every rank spends one collective, so the next ones still match). Killed in
    that step, a rank leaves its survivors' group with work that waits on another
    survivor, as a loss in the middle of a collective can leave it."""
    at, _, ranks = spec.partition(":")
    if not spec or step != int(at):
        return
    pair = [int(r) for r in ranks.split(",")]
    source = pair[1 - pair.index(rank)] if rank in pair else rank
    dist.broadcast(torch.zeros(1), src=source, async_op=True)


def wrap(model: nn.Module, engine: str) -> nn.Module:
    if engine == "sharded":
        return lockstep.ShardedDataParallel(model, stage=2)
    return lockstep.DistributedDataParallel(model, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002)


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    ctx = lockstep.init()
    generation = int(os.environ.get("LOCKSTEP_LIVE_GENERATION", "0"))
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(32) if args.batchnorm else nn.Identity()
    model = nn.Sequential(
        nn.Linear(FEATURES, 32),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(32, 32),
        norm,
        nn.Tanh(),
        nn.Linear(32, 1),
    )
    torch.manual_seed(100 + ctx.rank)  # each rank its own dropout stream
    ddp = wrap(model, args.engine)
    # Join: a rank out of data skips the optimizer's step, so Adam's state would differ
    # between the ranks for good; plain SGD's replicas meet again at the post-hook's copy
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05) if args.uneven else None
    optimizer = sgd or torch.optim.Adam(ddp.parameters(), lr=0.01)
    checkpoints = lockstep.Checkpointer(out / "ckpt", keep=2)
    last = checkpoints.restore(model=ddp, optimizer=optimizer)
    start = 0 if last is None else last + 1
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"{ctx.rank}.{generation}.{ctx.restart_count}").write_text(str(os.getpid()))
    print(f"rank {ctx.rank} generation {generation} starts at step {start}", flush=True)
    first_process = generation == 0 and ctx.restart_count == 0
    publish_store(out, first_process and ctx.rank == 0)
    kill_step, where = planned_kill(ctx.rank, first_process)
    stranding = args.strand * first_process  # never in a replacement
    armed = [False]
    where, peer = split_peer(out, where)
    arm_kill(model, optimizer, where, armed, ddp, peer)
    monitor = None
    if args.monitor:
        every = {"log_every": 2, "straggler_every": 2}
        trace = out / "trace" if args.trace else False
        monitor = lockstep.Monitor(ddp, ctx, **every, start_step=start, progress=False, trace=trace)

    def run(steps: range) -> None:
        for step in steps:
            armed[0] = step == kill_step
            if armed[0] and args.hold:
                hold(Path(args.hold))
            strand(stranding, step, ctx.rank)
            x, y = batch(step, ctx.rank, ctx.world_size)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            if monitor is not None:
                monitor.step(loss, batch_size=BATCH)
            if args.own_collective:  # the script's own bookkeeping: not a recovery point
                dist.all_reduce(loss.detach())
            if (step + 1) % args.save_every == 0:
                checkpoints.save(step, model=ddp, optimizer=optimizer)
            print(f"rank {ctx.rank} finished step {step}", flush=True)
            time.sleep(args.step_sleep)

    if args.uneven and start < UNEVEN_STEPS:  # rank 1 a step fewer; it shadows rank 0's
        with ddp.join():  # type: ignore[operator]
            run(range(start, UNEVEN_STEPS - (ctx.rank == 1)))
    run(range(max(start, UNEVEN_STEPS if args.uneven else 0), args.steps))
    after_last_step(args.linger, where, armed[0], ctx.rank, ctx.world_size)  # before close()
    if monitor is not None:
        monitor.close()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, out / f"final_rank{ctx.rank}.pt")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
