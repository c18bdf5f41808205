"""The stall watch's rule (`judge`), without processes: a stopped worker is the stuck one
whatever it noted; without one, the workers not waiting in a collective, least advanced
first; a worker that merely waits is never blamed."""

from __future__ import annotations

from lockstep.launch.watches.stall import judge
from lockstep.runtime.progress import Phase, Record


def _note(phase: Phase, step: int, index: int = -1, label: str = "") -> Record:
    return Record(seq=1, step=step, phase=phase, index=index, since=0.0, label=label)


def _bucket(step: int, index: int = 0) -> Record:
    return _note(Phase.WAITING, step, index, f"gradient bucket {index} of step {step}")


SAVE = _note(Phase.CHECKPOINT, 3, label="Checkpointer.save(step=3)")


def test_a_stopped_worker_is_stuck_whatever_phase_it_noted() -> None:
    # stopped inside the all-reduce that its peers wait on: all three noted the same wait
    in_bucket = {0: _bucket(6), 1: _bucket(6), 2: _bucket(6)}
    assert judge(in_bucket, stopped={1}) == ([1], [0, 2])
    # stopped inside a save while its peer waits at the save's barrier (noted as a save)
    in_save = {0: SAVE, 1: SAVE}
    assert judge(in_save, stopped={0}) == ([0], [1])
    # stopped in backward: its peer computing too is not blamed with it
    assert judge({0: _note(Phase.BACKWARD, 4), 1: _note(Phase.BACKWARD, 4)}, {0}) == ([0], [1])
    # stopped before its first note
    assert judge({0: None, 1: _bucket(1)}, {0}) == ([0], [1])


def test_a_stopped_worker_is_blamed_before_one_that_is_not_waiting() -> None:
    records = {0: _note(Phase.SYNCHRONISED, 2), 1: _bucket(3), 2: _bucket(3)}
    assert judge(records, stopped={2}) == ([2], [0, 1])
    assert judge(records, stopped=set()) == ([0], [1, 2])


def test_without_a_stopped_worker_the_ones_not_waiting_are_stuck_least_advanced_first() -> None:
    records = {
        0: _bucket(5, 1),
        1: _note(Phase.BACKWARD, 5),
        2: _note(Phase.SYNCHRONISED, 3),
        3: _bucket(5, 0),
    }
    assert judge(records, stopped=()) == ([2, 1], [3, 0])
    # two stopped ones: the one behind is named first
    assert judge(records, stopped={0, 3}) == ([3, 0], [2, 1])


def test_no_stall_to_judge_without_a_wait_or_a_stopped_worker() -> None:
    computing = {0: _note(Phase.BACKWARD, 5), 1: _note(Phase.BACKWARD, 5)}
    assert judge(computing, stopped=()) is None
    assert judge({0: SAVE, 1: SAVE}, stopped=()) is None  # a long save is not a stall
    # stopped ranks of another node (not in the records) count for nothing here
    assert judge(computing, stopped={7}) is None


def test_every_local_worker_waiting_and_none_stopped_blames_none_of_them() -> None:
    assert judge({0: _bucket(6), 1: _bucket(6)}, stopped=()) == ([], [0, 1])
