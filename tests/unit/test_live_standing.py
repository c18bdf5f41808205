"""Where the survivors stand at a recovery, and what every reader decides from it.

`live/standing.py` reads each survivor's post (`Stand`) and decides, the same on
every survivor and in the replacement: who hands over, whether a survivor is a
step's end behind and can take that step's outcome from those ahead, what it then
skips, and when the survivors stand too far apart (the fallback's reason). The
three-rank runs are `tests/launch/test_live_faults.py`.
"""

from __future__ import annotations

from lockstep.live.standing import Stand, ahead, donor, lagging, opened, taken_between
from lockstep.runtime.recovery import Point

BEHIND = Stand(0, 4, True, "", reduced=True)  # still in step 5's fingerprint, buckets reduced


def test_level_survivors_hand_over_from_the_lowest_rank():
    stands = [Stand(0, 4, False, "SAVE"), Stand(2, 4, True)]
    assert lagging(stands) is None
    assert donor(stands) == 0
    assert ahead(stands, stands[0]) == []
    assert opened(stands, 4, within=False)  # rank 2 is inside step 5: rank 0 skips its openings


def test_a_survivor_in_the_fingerprint_of_a_step_a_peer_finished_catches_up():
    stands = [BEHIND, Stand(2, 5, True)]
    assert lagging(stands) is None
    assert ahead(stands, BEHIND) == [2]
    assert donor(stands) == 2  # rank 0 has not applied step 5's update yet
    assert opened(stands, 5, within=False)
    # the one behind, inside step 5, opens nothing for a peer that finished step 5
    assert not opened([BEHIND, Stand(2, 5, False, "LOSS_MEAN")], 5, within=False)


def test_those_ahead_between_steps_are_skipped_by_the_one_behind_but_a_save_is_not():
    assert taken_between([BEHIND, Stand(2, 5, False, "LOSS_MEAN")]) == {Point.LOSS_MEAN}
    assert taken_between([BEHIND, Stand(2, 5, False, "SAVE")]) == set()
    assert taken_between([BEHIND, Stand(2, 5, True, "BUFFERS")]) == set()


def test_a_survivor_still_in_a_bucket_of_a_step_a_peer_finished_falls_back_naming_it():
    reason = lagging([Stand(0, 4, True, "", reduced=False), Stand(1, 5, True), Stand(3, 5, True)])
    assert reason == (
        "survivor rank 0 met the loss in a bucket of step 5 with 4 steps finished, while "
        "rank(s) [1, 3] had finished 5: rank 0 lacks that step's averaged gradients, and the "
        "ranks that had them applied them already, so no survivor can finish the step exactly"
    )
    apart = lagging([Stand(0, 3, True, "", reduced=True), Stand(2, 5, True)])
    assert apart is not None and "can take its outcome" in apart
