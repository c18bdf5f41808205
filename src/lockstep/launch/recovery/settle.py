"""Deaths that come together are one loss: a short settle before a generation is claimed.

Two workers SIGKILLed microseconds apart (a host's OOM killer, a scheduler's preemption,
`kill` of several pids) do not end at the same moment: a process takes milliseconds to
exit (its memory is unmapped first), so the launcher's look at its workers may find one
of them gone while the other is still dying. Claimed alone, the first loss's generation
can never form (the second rank does not join it), and the second death, seen one watch
interval later, falls back to the whole-group restart. So before claiming, `settle`
looks again for `SETTLE_S` and for as long as another worker is dying (a pending
SIGKILL, or the kernel's exiting flag, read in /proc), bounded by `DYING_WAIT_S`, and
the deaths it finds are claimed together: every survivor still holds the state.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SETTLE_S = 0.01  # kills this close to the first death seen are claimed with it
DYING_WAIT_S = 2.0  # the longest wait for a dying worker to be gone
POLL_S = 0.002
_PF_EXITING = 0x4  # the kernel's per-task flag, set as a process starts to exit
_SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in /proc's signal masks


def dying(pid: int) -> bool:
    """Whether `pid` is on its way out: a SIGKILL pending, or its exit under way (Linux).

    False where /proc cannot say (not Linux, the process already reaped).
    """
    try:
        with open(f"/proc/{pid}/stat") as fp:
            fields = fp.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as fp:
            status = dict(line.split(":", 1) for line in fp if ":" in line)
    except (OSError, IndexError, ValueError):
        return False
    if fields[0] in ("Z", "X") or int(fields[6]) & _PF_EXITING:
        return True
    pending = (int(status.get(key, "0").strip(), 16) for key in ("SigPnd", "ShdPnd"))
    return any(mask & _SIGKILL_BIT for mask in pending)


def settle(
    failed: Callable[[], dict[int, int]],
    running: Callable[[], dict[int, int]],
    is_dying: Callable[[int], bool] = dying,
) -> dict[int, int]:
    """The failed workers once the deaths that came with the first ones are in.

    Args:
        failed: local rank -> exit code of each worker that ended badly (polls again).
        running: local rank -> pid of each worker still running.
        is_dying: whether a running pid is on its way out.

    Returns:
        `failed()` after at least `SETTLE_S`, once no running worker is dying (or after
        `DYING_WAIT_S` more, when one takes that long to go).
    """
    start = time.monotonic()
    while True:
        found = failed()
        elapsed = time.monotonic() - start
        going = [pid for local_rank, pid in running().items() if local_rank not in found]
        if elapsed >= SETTLE_S + DYING_WAIT_S:
            return found
        if elapsed >= SETTLE_S and not any(is_dying(pid) for pid in going):
            return found
        time.sleep(POLL_S)
