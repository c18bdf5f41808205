"""recovery_train.py's job written for torchft 0.2.0: one replica group of one process.

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 &
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --nnodes 1 --nproc-per-node 1 --master-port 29600 --max-restarts 1 \\
        benchmarks/recovery_torchft.py --out DIR --steps 30 [--wrapper manual]  # and group 1

`benchmarks/recovery.py` starts all three (its mode "torchft"). The pattern is
torchft's DDP example: a Manager with state-dict callbacks, its gloo process group,
its DDP wrapper and optimizer wrapper; the same model, Adam, dropout and per-step
batch as recovery_train.py (the batch is drawn from the manager's step after the
quorum, each replica group taking its half). Events, RECOVERY_KILL and the final
files are those of recovery_train.py; an event is logged for committed steps only and
adds whether this replica's gradients took part and how many replicas did.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from recovery_train import arm_kill, batch, build_model, sample_ids
from torch import nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.ddp import PureDistributedDataParallel

REPLICAS = 2
# How gradients are averaged: "ddp", torch's DDP with torchft's comm hook (its example's);
# "pure", torchft's one all-reduce per gradient from a post-accumulate hook (on CPU
# nothing waits for those before the optimizer step); "manual", Manager.allreduce on
# every gradient after backward, each waited (errors are recorded, not raised).
WRAPPERS = {"ddp": DistributedDataParallel, "pure": PureDistributedDataParallel, "manual": None}


def average(manager: Manager, model: nn.Module) -> None:
    """The "manual" wrapper's step: every gradient all-reduced (mean over participants)."""
    works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
    for work in works:
        work.wait()


def make_manager(model: nn.Module, holder: dict, replica: int) -> Manager:
    """A Manager that hands the model and optimizer state to a healing replica."""

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        holder["optimizer"].load_state_dict(state["optimizer"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optimizer": holder["optimizer"].state_dict()}

    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"recovery_{replica}",
        timeout=timedelta(seconds=30),
        init_sync=False,  # every replica seeds the same weights (its documented case)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--wrapper", choices=WRAPPERS, default="ddp")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds after each step")
    args = parser.parse_args()
    out = Path(args.out)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    model = build_model()
    torch.manual_seed(100 + replica)
    holder: dict = {}
    manager = make_manager(model, holder, replica)
    wrap = WRAPPERS[args.wrapper]
    ddp = model if wrap is None else wrap(manager, model)
    optimizer = Optimizer(manager, torch.optim.Adam(model.parameters(), lr=1e-3))
    holder["optimizer"] = optimizer.optim
    armed = arm_kill(model, out, replica, first)
    kill_step = int((os.environ.get("RECOVERY_KILL") or "0:-1").split(":")[1])
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the quorum
        manager.wait_quorum()  # the step number (a healing replica's too) is settled here
        step = manager.current_step()
        armed[0] = len(armed) > 1 and step == kill_step
        x, y = batch(step, replica, REPLICAS)
        nn.functional.mse_loss(ddp(x), y).backward()
        if wrap is None:
            average(manager, model)
        took_part, participants = manager.is_participating(), manager.num_participants()
        optimizer.step()
        if manager.current_step() == step:
            continue  # not committed: the step is tried again
        event = {"rank": replica, "step": step, "t": time.time(), "pid": os.getpid()}
        event |= {"participating": took_part, "participants": participants}
        event["samples"] = sample_ids(step, replica, REPLICAS) if took_part else []
        with open(out / "events.jsonl", "a") as sink:
            sink.write(json.dumps(event) + "\n")
        time.sleep(args.step_sleep)
    state = {"model": model.state_dict(), "optimizer": optimizer.optim.state_dict()}
    torch.save(state, out / f"final_rank{replica}.pt")
    manager.shutdown()


if __name__ == "__main__":
    main()
