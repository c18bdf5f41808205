"""`run_ranks`: spawn real gloo ranks on CPU for a test, and never hang.

Each rank is a real process joined by a real gloo process group over loopback
(a FileStore in a temporary directory: no port to collide on). Every collective
gets a short timeout; a rank's exception is re-raised in the parent with its rank
number and traceback; a rank killed by a signal (a native crash: SIGSEGV, SIGABRT)
is reported with the signal and the Python stacks `faulthandler` wrote as it died;
a rank that hangs fails the call within `deadline` seconds; every child is reaped
before the call returns. Ranks start from a forkserver that
has torch already imported, so a spawn costs a fork, not a fresh interpreter.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import LockstepError

_PR_SET_PDEATHSIG = 1


class RankFailure(LockstepError):
    """One or more ranks raised, crashed or hung; the message holds their tracebacks."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the parent's finally-block still reaps us
        pass


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    timeout_s: float,
    env: dict[str, str],
    args: tuple[Any, ...],
) -> None:
    _die_with_parent()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
        }
    )
    torch.set_num_threads(1)
    out = Path(workdir)
    crash_log = open(out / f"fault_{rank}.txt", "w")  # noqa: SIM115 (open until os._exit)
    faulthandler.enable(file=crash_log, all_threads=True)
    try:
        from lockstep.context import init, shutdown

        store = dist.FileStore(str(out / "store"), world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(init(), *args)
        tmp = out / f"result_{rank}.tmp"
        torch.save(result, tmp)
        tmp.rename(out / f"result_{rank}.pt")
        shutdown()
    except BaseException:
        (out / f"error_{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    # torch._dynamo is imported lazily by optimizers and torch DDP: preload it once, here.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "lockstep"])
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 20.0,
    deadline_s: float = 90.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` gloo ranks and return each rank's result.

    Args:
        fn: a module-level function (it is pickled by reference); its first argument
            is the rank's `DistContext`; its return value must be torch.save-able.
        world_size: number of ranks to spawn.
        *args: further arguments, pickled to every rank.
        timeout_s: timeout of every collective in the ranks' process group.
        deadline_s: the whole call fails after this many seconds.
        env: extra environment variables for the ranks.

    Returns:
        The results, indexed by rank.

    Raises:
        RankFailure: a rank raised (its traceback is in the message), died, or the
            deadline passed; all ranks are killed and reaped before it is raised.
    """
    with tempfile.TemporaryDirectory(prefix="lockstep-ranks-") as workdir:
        ctx = _context()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, workdir, timeout_s, env or {}, args),
                name=f"rank{rank}",
            )
            for rank in range(world_size)
        ]
        try:
            for proc in procs:
                proc.start()
            _wait(procs, workdir, deadline_s)
            return _results(workdir, world_size)
        finally:
            _reap(procs)


def _wait(procs: list[mp.Process], workdir: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        codes = [p.exitcode for p in procs]
        if all(code == 0 for code in codes):
            return
        if any(code not in (None, 0) for code in codes):
            # Give the other ranks a moment to report their own errors, then stop them.
            grace = time.monotonic() + 2.0
            while time.monotonic() < grace and any(p.exitcode is None for p in procs):
                time.sleep(0.05)
            _raise_failure(procs, workdir, reason="failed")
        time.sleep(0.02)
    _raise_failure(procs, workdir, reason=f"did not finish within {deadline_s:.0f} s")


def _results(workdir: str, world_size: int) -> list[Any]:
    """Each rank's result; a rank that exited 0 without writing one is a failure too."""
    paths = [Path(workdir) / f"result_{rank}.pt" for rank in range(world_size)]
    missing = [rank for rank, path in enumerate(paths) if not path.exists()]
    if missing:
        raise RankFailure(
            f"ranks {missing} exited with code 0 but returned no result (os._exit inside "
            "the rank's function?); expected every rank to return from it",
            missing,
        )
    return [torch.load(path, weights_only=False) for path in paths]


def _raise_failure(procs: list[mp.Process], workdir: str, reason: str) -> None:
    lines, failed = [], []
    for rank, proc in enumerate(procs):
        err = Path(workdir) / f"error_{rank}.txt"
        if err.exists():
            failed.append(rank)
            lines.append(f"--- rank {rank} raised:\n{err.read_text()}")
        elif proc.exitcode not in (0, None):
            failed.append(rank)
            lines.append(f"--- rank {rank} died {_death(proc.exitcode, workdir, rank)}")
        elif proc.exitcode is None:
            lines.append(f"--- rank {rank} was still running (killed)")
    ranks = ", ".join(map(str, failed)) or "none (hung)"
    raise RankFailure(f"ranks {reason}; failed: {ranks}\n" + "\n".join(lines), failed)


def _death(exitcode: int, workdir: str, rank: int) -> str:
    """'with exit code 3', or 'by signal SIGSEGV' and the stacks faulthandler wrote."""
    if exitcode >= 0:
        return f"with exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    fault = Path(workdir) / f"fault_{rank}.txt"
    stacks = fault.read_text().strip() if fault.exists() else ""
    if not stacks:
        return f"by signal {name} (exit code {exitcode}); faulthandler wrote nothing"
    return f"by signal {name} (exit code {exitcode}); faulthandler's stacks:\n{stacks}"


def _reap(procs: list[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)
