"""The settle before a live claim: deaths that come together are claimed together.

`settle` is a pure loop over two calls (the failed workers, the running ones) and a
test of "dying": here with plain callables, and `dying` with real child processes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.launch.recovery import settle as settling
from lockstep.launch.recovery.settle import dying, settle


def test_a_lone_death_is_claimed_after_the_settle_only():
    start = time.monotonic()
    found = settle(lambda: {1: -9}, lambda: {0: 100}, lambda pid: False)
    took = time.monotonic() - start
    assert found == {1: -9}
    assert settling.SETTLE_S <= took < settling.SETTLE_S + 0.5


def test_a_worker_dying_meanwhile_is_claimed_with_the_first():
    polls = [0]

    def failed() -> dict[int, int]:
        polls[0] += 1
        return {1: -9, 2: -9} if polls[0] > 20 else {1: -9}

    def running() -> dict[int, int]:
        return {0: 100} if polls[0] > 20 else {0: 100, 2: 102}

    found = settle(failed, running, lambda pid: pid == 102)
    assert found == {1: -9, 2: -9}
    assert polls[0] > 20  # it waited past the settle for the dying worker


def test_a_worker_that_takes_too_long_to_die_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(settling, "DYING_WAIT_S", 0.05)
    start = time.monotonic()
    found = settle(lambda: {1: -9}, lambda: {0: 100, 2: 102}, lambda pid: pid == 102)
    assert found == {1: -9}
    assert time.monotonic() - start < 0.5


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_dying_tells_a_running_process_from_one_that_exited():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not dying(child.pid)
    finally:
        child.kill()
    deadline = time.monotonic() + 10  # killed, not yet reaped: a zombie
    while not dying(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dying(child.pid)
    child.wait()
    assert not dying(child.pid)  # reaped: /proc no longer has it
