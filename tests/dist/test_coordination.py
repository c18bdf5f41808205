"""A checkpoint's messages between ranks: the native collectives' results, and interruptible.

`checkpoint/coordination.py` sends its small messages (errors, paths, random states)
as pickled bytes over the backend's asynchronous collectives. Oracle: torch's own
object collectives give the same values on the same ranks. Under live recovery a
rank lost in the middle of a save must not leave its peers waiting for the group's
timeout: with three ranks, a peer whose neighbours in the ring are alive gets no
error from gloo at all. Here rank 2 never sends (as a lost rank whose peers see
nothing), then "announces" its loss; ranks 0 and 1, blocked in each of the four
messages, must end with `waits.Interrupted` within a few polls, not at the timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lockstep.checkpoint.coordination import Coordination
from lockstep.runtime import waits
from lockstep.testing import run_ranks

GROUP_TIMEOUT_S = 15.0
METHODS = ("wait_for_rank0", "from_rank0", "to_rank0", "everyone")


def _call(coordination: Coordination, method: str, value: object) -> object:
    if method == "wait_for_rank0":
        return coordination.wait_for_rank0("a test's barrier")
    return getattr(coordination, method)(value)


def _same_as_torch(ctx) -> dict[str, object]:
    value = {"rank": ctx.rank, "blob": "x" * (1000 * ctx.rank)}  # lengths differ by rank
    ours = Coordination(ctx.rank, ctx.world_size, None, timedelta(seconds=GROUP_TIMEOUT_S))
    every: list[object] = [None] * ctx.world_size
    dist.all_gather_object(every, value)
    box = [value]
    dist.broadcast_object_list(box, src=0)
    gathered: list[object] | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return {
        "everyone": (ours.everyone(value), every),
        "from_rank0": (ours.from_rank0(value), box[0]),
        "to_rank0": (ours.to_rank0(value), gathered or []),
    }


def _blocked_then_announced(ctx, flag: str) -> dict[str, tuple[str, float]]:
    groups = {method: dist.new_group() for method in METHODS}  # one broken group each

    def lost() -> None:
        if Path(flag).exists():
            raise waits.Interrupted("generation 1 was announced (rank(s) [2] replaced)")

    waits.interrupt_with(lost)
    if ctx.rank == 2:  # sends nothing, then its loss is announced; alive until the end
        time.sleep(1.0)
        Path(flag).write_text("1")
        _until_both_finished(flag)
        return {}
    seen = {}
    for method, group in groups.items():
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        coordination = Coordination(ctx.rank, ctx.world_size, group, timeout)
        start = time.monotonic()
        try:
            _call(coordination, method, {"rank": ctx.rank})
            outcome = "returned"
        except waits.Interrupted:
            outcome = "interrupted"
        except RuntimeError as error:
            outcome = f"{type(error).__name__}: {error}"
        seen[method] = (outcome, time.monotonic() - start)
    Path(f"{flag}.{ctx.rank}").write_text("done")
    _until_both_finished(flag)  # a rank that exits early resets its peer's connections
    return seen


def _until_both_finished(flag: str) -> None:
    """Ranks 0 and 1 are through the four messages: an exit now breaks no wait."""
    deadline = time.monotonic() + 2 * GROUP_TIMEOUT_S
    while not all(Path(f"{flag}.{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "ranks 0 and 1 did not finish"
        time.sleep(0.05)


def test_messages_equal_torchs_object_collectives():
    for rank, result in enumerate(run_ranks(_same_as_torch, 3, timeout_s=GROUP_TIMEOUT_S)):
        for method, (ours, native) in result.items():
            assert ours == native, (rank, method, ours, native)


def test_a_rank_lost_inside_a_message_interrupts_every_wait(tmp_path):
    flag = str(tmp_path / "announced")
    results = run_ranks(_blocked_then_announced, 3, flag, timeout_s=GROUP_TIMEOUT_S)
    for rank in (0, 1):
        for method in METHODS:
            outcome, seconds = results[rank][method]
            assert outcome == "interrupted", (rank, method, outcome)
            assert seconds < GROUP_TIMEOUT_S / 3, (rank, method, seconds)
