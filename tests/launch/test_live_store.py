"""Live recovery's keys in the worker store are sealed, and every read of them is defensive.

Whoever reaches the worker store's port (node 0's launcher hosts it) can write any
key. A forged generation used to make the next real loss fall back, and garbage there
crashed the launcher and rank 0 with a JSONDecodeError; garbage in a rank's random
state crashed the donor in torch.load. Here a client that is not the job writes into
the worker store of a real `lockstep run --live-recovery` (one node, two workers,
`train_live.py`), just before rank 1 kills itself: the value is ignored with one line
naming the key, and nothing crashes. The first test does the same to the launcher's
functions against a real store, in a second.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from launchkit import Launcher, wait_for
from torch.distributed import TCPStore

from lockstep.launch.rendezvous.store import host
from lockstep.live import keys

SCRIPT = str(Path(__file__).with_name("train_live.py"))
WAIT_S = 200
GARBAGE = b'{garbage: "not JSON"'
FORGED = b'{"generation": 7, "replaced": [1]}'
IGNORED = "live recovery: ignored what the worker store holds under "


def _bind(monkeypatch, nonce: str, round_: int) -> None:
    """What `lockstep run` gives its workers: the secret, the launch's nonce, the round."""
    monkeypatch.setenv("LOCKSTEP_JOB_SECRET", "a-secret-of-this-test-only")
    monkeypatch.setenv("LOCKSTEP_JOB_NONCE", nonce)
    monkeypatch.setenv("LOCKSTEP_JOB_ROUND", str(round_))


def test_a_forged_garbage_or_replayed_value_is_ignored_by_the_launcher(monkeypatch, caplog):
    """Against a real store: garbage (even bytes that are not UTF-8) and a forged
    generation are ignored and swapped for the claimed one, with a line naming the key;
    a value sealed in another launch or round does not open; a forged `JOINED` does not
    count as joined; a launcher never goes below the generation it announced."""
    # imported here, so that this file also runs on the code before the seal (and fails)
    from lockstep.launch.recovery import finished, generations
    from lockstep.live import group as live_group

    _bind(monkeypatch, "nonce-a", 0)
    server, port = host("127.0.0.1", 0, 10)
    store = generations.client("127.0.0.1", port, 10)
    caplog.set_level(logging.WARNING, logger="lockstep.run")
    for stored in (GARBAGE, b"\xde\xad" + GARBAGE, FORGED):
        store.set(keys.GENERATION, stored)
        assert generations.claim(store, [1], 2) == 1, stored
        assert live_group.read_announcement(store) == (1, [1])
        store.delete_key(keys.GENERATION)
    assert f"{IGNORED}{keys.GENERATION}" in caplog.text
    from lockstep.live import sealed

    sealed_here = live_group.announcement(3, [0])
    _bind(monkeypatch, "nonce-a", 1)  # the next round: the value of round 0 does not open
    store.set(keys.GENERATION, sealed_here)
    assert live_group.read_announcement(store) == (0, [])
    _bind(monkeypatch, "nonce-b", 0)  # another launch (job) with the same secret
    assert live_group.read_announcement(store) == (0, [])
    for rank in range(2):
        store.set(keys.JOINED.format(generation=1, rank=rank), "1")
    assert not generations.joined(store, 1, 2)
    store.set(keys.ENDED.format(rank=0), "1")
    store.add(keys.ENDED_COUNT, 1)
    assert finished.ended(store, 2, set()) == set()
    store.set(keys.GENERATION, live_group.announcement(1, [1]))  # replayed over generation 2
    for rank in range(2):
        sealed.put(store, keys.JOINED.format(generation=1, rank=rank), 1)
    assert "generation 2" in str(generations.claim(store, [0], 2, known=2))
    del server


def _start(out: Path, flags: list[str], kill: str, steps: int = 6) -> Launcher:
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", "2", "--live-recovery", *flags, SCRIPT, "--out", str(out)]
    argv += ["--steps", str(steps), "--hold", str(out / "go")]
    env = {"LOCKSTEP_TEST_KILL": kill, "LOCKSTEP_STALL_WARN_S": "60"}
    return Launcher(argv, out / "launcher.log", env=env)


def _stranger(out: Path, launcher: Launcher) -> TCPStore:
    """A client of the job's worker store that is not the job."""
    wait_for(out / "worker_store", 120, [launcher])
    addr, port = (out / "worker_store").read_text().split()
    timeout = timedelta(seconds=10)
    return TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def _processes(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "pids").iterdir())


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stored", [GARBAGE, FORGED], ids=["garbage", "forged"])
def test_a_stranger_s_generation_neither_crashes_nor_stops_live_recovery(tmp_path, stored):
    """Garbage used to crash the launcher (exit 2) and rank 0; a forged generation 7
    made the real loss fall back ("still forming"). Both are ignored and named now,
    and the loss of rank 1 is recovered live."""
    out = tmp_path / "out"
    launcher = _start(out, [], "1:2:optimizer")
    stranger = _stranger(out, launcher)
    stranger.set(keys.GENERATION, stored)
    (out / "go").touch()
    code = launcher.wait(WAIT_S)
    log = launcher.log()
    assert code == 0, log
    assert f"{IGNORED}{keys.GENERATION}" in log, log
    assert "generation 1, rank(s) [1] replaced" in log, log
    assert "restart 1" not in log and "not possible" not in log, log
    assert "JSONDecodeError" not in log and "Traceback" not in log, log
    assert _processes(out) == ["0.0.0", "1.0.0", "1.1.0"], log


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_garbage_in_a_rank_s_random_state_is_named_not_unpickled(tmp_path):
    """The donor reads the lost rank's random state (`keys.RNG`) at a recovery. Garbage
    written there in a loop used to crash the donor in torch.load; now it is ignored,
    named, and the recovery falls back naming the missing random state; the
    whole-group restart then ends the job."""
    out = tmp_path / "out"
    launcher = _start(out, ["--max-restarts", "1"], "1:2:optimizer")
    stranger = _stranger(out, launcher)
    stop = threading.Event()

    def overwrite() -> None:
        slots = [keys.RNG.format(rank=1, parity=p) for p in (0, 1)]
        deadline = time.monotonic() + 120
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                for slot in slots:
                    stranger.set(slot, GARBAGE)
                time.sleep(0.01)
        except RuntimeError:  # the round's store is gone
            return

    writer = threading.Thread(target=overwrite, daemon=True)
    writer.start()
    time.sleep(0.5)
    (out / "go").touch()
    try:
        code = launcher.wait(WAIT_S)
    finally:
        stop.set()
        writer.join(timeout=15)
    log = launcher.log()
    assert code == 0, log
    assert f"{IGNORED}lockstep/live/rng/1/" in log, log
    assert "the random state of rank 1 (no post)" in log, log
    assert "UnpicklingError" not in log and "invalid load key" not in log, log
