"""The live-recovery fault tests' script: `train_live.py` with a resumable loader and more faults.

    lockstep run --nproc-per-node 2 --live-recovery tests/launch/train_live_faults.py --out /tmp/f

The data comes from `lockstep.shard` over numbered samples (several epochs), and the
sampler is handed to `Checkpointer.restore`; after each backward a rank appends the
step and its sample ids to OUT/ids/<rank>.<generation>.<restart>. Faults
(LOCKSTEP_TEST_KILL="RANK:STEP:WHERE[,...]", each for the process of RANK that runs
STEP, replacements included): WHERE as in `train_live.py`, or "agreement" (before
the process's first batch: its peers wait in the sampler's agreement), or "save"
(rank 0 dies between the checkpoint's temporary file and its rename, another rank
before the save's barrier), or "save_message" (a rank other than 0, inside rank 0's
word on the write, its length received: peers that rank 0 reaches directly finish the
save, the others are still in it), or "hang" (stays in forward), or "stop_save" (as
"save", but the rank stops itself with SIGSTOP instead of dying), or "stop_wait" (the
rank stops itself with SIGSTOP while it waits on a gradient bucket of STEP; every other
rank sleeps 1 s before that step's forward, so the wait is open when it stops and they
then wait for it in the same all-reduce), or "behind" / "behind_bucket" (this rank's
wait on the step's fingerprint / last bucket ends with the loss once another rank is
dead and a third has finished the step: `arm_behind`);
LOCKSTEP_TEST_KILL_REPLACEMENT="RANK:GENERATION" makes that replacement die before it
joins. `--random-seed`: `shard(seed=None)`; `--batchnorm`: a BatchNorm layer;
`--monitor`: a `lockstep.Monitor` whose loss average runs every 2 steps.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from train_live import FEATURES, arm_kill

import lockstep
from lockstep.checkpoint import coordination
from lockstep.runtime import progress

SAMPLES, BATCH = 40, 4  # 5 steps per epoch at world size 2


class Numbered(Dataset):
    """Sample i: (i, x, y), drawn from i alone."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(5000 + index))
        return index, x, x.sum(dim=0, keepdim=True).sin()


PEER_DELAY_S = 1.0  # "stop_wait": the others' sleep before the step, longer than a step


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def stop() -> None:
    """Freeze this process, every thread of it (state T), as Ctrl-Z or a debugger would."""
    os.kill(os.getpid(), signal.SIGSTOP)


def stop_in_a_bucket_wait() -> None:
    """A thread that stops this process once it notes a wait on a gradient bucket (bounded)."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            record = progress.current()
            if record.phase == progress.Phase.WAITING and record.label.startswith("gradient"):
                stop()
                return
            time.sleep(0.001)

    threading.Thread(target=watch, name="test-stop-in-wait", daemon=True).start()


def arm_fault(model, optimizer, checkpoints, ddp, out: Path, where: str, when: list[bool]) -> None:
    rank = ddp.ctx.rank
    if where.startswith(("save", "stop_save")):
        act = stop if where == "stop_save" else die
        arm_save_fault(checkpoints, rank, where.removeprefix("stop_"), when, act)
    elif where == "stop_wait":
        started: list[bool] = []

        def arm_stop(*_: object) -> None:
            if when[0] and not started:
                started.append(True)
                stop_in_a_bucket_wait()

        model[2].register_forward_pre_hook(arm_stop)
    elif where.startswith("behind"):
        arm_behind(ddp, out, rank, where == "behind", when)
    elif where == "hang":

        def hang(*_: object) -> None:
            while when[0]:
                time.sleep(1)

        model[2].register_forward_pre_hook(hang)
    else:
        arm_kill(model, optimizer, where, when, ddp)


def arm_behind(ddp, out: Path, rank: int, fingerprint: bool, when: list[bool]) -> None:
    """This rank's wait on the step's fingerprint (or on its last bucket) ends with the
    loss, after a peer died and another finished the step. gloo fails a collective that
    way when the lost rank's connection closes before this rank's part of it is done,
    while a rank that received everything finishes it: a window inside gloo that no
    script can aim at, so the failure is raised here, as gloo raises it, once the lost
    rank is gone and a third rank has recorded the step (OUT/ids)."""
    driver, fired = ddp.reducer.driver, [False]

    def fail() -> None:
        fired[0] = True  # once: the step's collectives run again (if they do) end as usual
        deadline = time.monotonic() + 60
        while not (_anyone(out, rank, _recorded, driver.steps) and _anyone(out, rank, _gone)):
            if time.monotonic() > deadline:
                raise AssertionError("behind: no peer died and another finished the step")
            time.sleep(0.05)
        raise RuntimeError("Connection closed by peer (test: in the step's last collectives)")

    if fingerprint:
        check = driver.fingerprint.check
        driver.fingerprint.check = lambda: fail() if when[0] and not fired[0] else check()
        return
    launch = driver.collective.launch

    def launching(bucket, is_last: bool):
        handle = launch(bucket, is_last)
        if when[0] and is_last and not fired[0]:
            handle.wait = fail  # the driver's waits in `_finalize`: polls never wait
        return handle

    driver.collective.launch = launching


def _anyone(out: Path, me: int, seen, *args) -> bool:
    """Whether `seen(path, *args)` holds for another rank's first process (OUT/pids)."""
    others = [p for p in (out / "pids").glob("*.0.0") if not p.name.startswith(f"{me}.")]
    return any(seen(p, *args) for p in others)


def _recorded(pid_file: Path, step: int) -> bool:
    ids = pid_file.parent.parent / "ids" / pid_file.name
    return ids.exists() and any(line.split()[0] == str(step) for line in ids.open())


def _gone(pid_file: Path) -> bool:
    try:
        state = Path(f"/proc/{int(pid_file.read_text())}/stat").read_text().rsplit(")", 1)[1]
    except OSError:
        return True
    return state.split()[0] in ("Z", "X")


def arm_save_fault(checkpoints, rank: int, where: str, when: list[bool], act=die) -> None:
    if where == "save" and rank == 0:  # the writer: temporary file written, not renamed
        checkpoints.files.on_point = lambda point: point == "temp_synced" and when[0] and act()
    elif where == "save":  # a rank that does not write: before the barrier after the write
        barrier = checkpoints._ranks.wait_for_rank0

        def dying_barrier(what: str) -> None:
            if when[0]:
                act()
            barrier(what)

        checkpoints._ranks.wait_for_rank0 = dying_barrier
    elif where == "save_message":  # a rank that does not write, inside rank 0's word on
        finish = coordination._finish  # the write: its length received, not its bytes

        def dying_finish(*args: object) -> None:
            finish(*args)
            if when[0] and message[0]:
                die()

        message, word = [False], checkpoints._ranks.from_rank0

        def in_message(value: object) -> object:
            message[0] = True
            return word(value)

        coordination._finish, checkpoints._ranks.from_rank0 = dying_finish, in_message


def planned_fault(rank: int, start: int, generation: int, restart: int) -> tuple[int, str]:
    """(step, where) of this process's fault, or (-1, ""): the first item of its rank in
    LOCKSTEP_TEST_KILL at or after its start step, after it for a replacement (which never
    repeats the fault that made it); none after a whole-group restart."""
    plans = filter(None, os.environ.get("LOCKSTEP_TEST_KILL", "").split(","))
    for kill_rank, step, where in sorted((p.split(":") for p in plans), key=lambda p: int(p[1])):
        if restart == 0 and int(kill_rank) == rank and int(step) >= start + (generation > 0):
            return int(step), where
    return -1, ""


def peer_stop_steps(rank: int) -> set[int]:
    """The steps at which another rank plans "stop_wait" (this rank sleeps before them)."""
    plans = filter(None, os.environ.get("LOCKSTEP_TEST_KILL", "").split(","))
    return {
        int(s)
        for r, s, where in (p.split(":") for p in plans)
        if where == "stop_wait" and int(r) != rank
    }


def replacement_dies(rank: int, generation: int) -> bool:
    plan = os.environ.get("LOCKSTEP_TEST_KILL_REPLACEMENT", "")
    return bool(plan) and plan == f"{rank}:{generation}"


def endless(loader):
    while True:
        yield from loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--random-seed", action="store_true", help="shard(seed=None)")
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--monitor", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    generation = int(os.environ.get("LOCKSTEP_LIVE_GENERATION", "0"))
    if replacement_dies(int(os.environ["RANK"]), generation):
        die()  # before init(): it never joins its generation
    ctx = lockstep.init()
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
    torch.manual_seed(100 + ctx.rank)
    random.seed(ctx.rank)  # the checkpoint holds every generator: make them all the oracle's
    np.random.seed(ctx.rank)
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    loader = lockstep.shard(Numbered(), batch_size=BATCH, seed=None if args.random_seed else 0)
    checkpoints = lockstep.Checkpointer(out / "ckpt", keep=2)
    last = checkpoints.restore(model=ddp, optimizer=optimizer, sampler=loader)
    name = f"{ctx.rank}.{generation}.{ctx.restart_count}"
    for folder in ("pids", "ids"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    (out / "pids" / name).write_text(str(os.getpid()))
    start = 0 if last is None else last + 1
    kill_step, where = planned_fault(ctx.rank, start, generation, ctx.restart_count)
    armed = [False]
    arm_fault(model, optimizer, checkpoints, ddp, out, where, armed)
    batches = endless(loader)
    delays = peer_stop_steps(ctx.rank)
    every = {"log_every": 2, "start_step": start, "progress": False}
    monitor = lockstep.Monitor(ddp, ctx, **every) if args.monitor else None
    for step in range(start, args.steps):
        armed[0] = step == kill_step
        if step in delays:  # a peer stops in this step's bucket wait: let it wait first
            time.sleep(PEER_DELAY_S)
        if where == "agreement" and armed[0]:  # before its first batch: peers in the agreement
            die()
        ids, x, y = next(batches)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        with open(out / "ids" / name, "a") as record:
            record.write(f"{step} {' '.join(str(i) for i in ids.tolist())}\n")
        optimizer.step()
        if monitor is not None:
            monitor.step(loss, batch_size=BATCH)
        if (step + 1) % 4 == 0:
            checkpoints.save(step, model=ddp, optimizer=optimizer, sampler=loader)
        print(f"rank {ctx.rank} finished step {step}", flush=True)
    if monitor is not None:
        monitor.close()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, out / f"final_rank{ctx.rank}.pt")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
