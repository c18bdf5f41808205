"""The bookkeeping of benchmarks/recovery.py and the soak, on made-up events (no processes).

Samples lost or repeated, the refusal line of a mode the launcher does not offer yet,
and the soak's kill plan: the parts of those benchmarks whose mistakes would not show
in their own output.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "soak")]

from recovery_jobs import _refusal  # noqa: E402
from recovery_measure import samples  # noqa: E402
from soak_kills import kill_plan  # noqa: E402


def events(pairs, participating=True):
    return [
        {"rank": r, "step": s, "samples": [0, 64], "participating": participating} for r, s in pairs
    ]


def test_every_share_once_loses_and_repeats_nothing():
    assert samples(events([(r, s) for s in range(4) for r in (0, 1)]), 4, 2) == (0, 0)


def test_a_share_never_taken_is_lost():
    done = events([(r, s) for s in range(4) for r in (0, 1) if (r, s) != (1, 2)])
    done += events([(1, 3)], participating=False)  # computed, not taken into the step
    assert samples(done, 4, 2) == (64, 0)  # (1, 2) missing; (1, 3) counted once only


def test_a_rollback_of_the_whole_group_repeats_nothing_but_a_one_sided_redo_does():
    whole = [(r, s) for s in range(4) for r in (0, 1)] + [(0, 2), (1, 2), (0, 3), (1, 3)]
    assert samples(events(whole), 4, 2) == (0, 0)
    one_sided = [(r, s) for s in range(4) for r in (0, 1)] + [(1, 2)]
    assert samples(events(one_sided), 4, 2) == (0, 64)


def test_a_launcher_error_before_any_step_is_a_refusal(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text("usage: lockstep ...\nlockstep: error: unrecognized arguments: --spares\n")
    assert _refusal(2, tmp_path, log) == "unrecognized arguments: --spares"
    assert _refusal(1, tmp_path, log) is None  # a failure, not a refusal
    (tmp_path / "events.jsonl").write_text("{}\n")
    assert _refusal(2, tmp_path, log) is None  # it ran steps: a failure


@pytest.mark.parametrize("kills", [3, 20])
def test_the_soak_plan_has_every_kind_and_one_lost_node(kills):
    plan = kill_plan(kills, random.Random(0))
    assert plan.count("lost node") == 1 and len(plan) == kills + 1
    assert {"save", "allreduce", "rank 0"} <= set(plan)
    if kills == 20:
        assert (plan.count("save"), plan.count("allreduce"), plan.count("worker")) == (5, 5, 9)
