"""Where the survivors stand at a recovery, and the three decisions that follow.

Ranks finish a collective at different moments, so at a loss the survivors may stand
in different places. At each recovery every survivor posts, for the new generation,
where it met the loss (`Stand`: its finished steps, whether it recovers inside a
step, the recovery point, whether its step's gradients are reduced), and reads every
survivor's before the hand-over (`survey`; a replacement reads them too, `read`).
Every reader decides the same from the same posts:

- *opened*: a survivor with the same finished steps is inside the next step or at
  its start (in the BatchNorm soak one had rank 0's word on a save and waited in the
  next forward's buffer broadcast while the others were still in the save): the next
  step's opening broadcasts are run again by nobody (`Recovery.opened`);
- *lagging*: with three ranks or more, one survivor can still be in a step's last
  collective (the step fingerprint, which every rank issues after its last bucket)
  while another has finished that step and met the loss in its next collective: the
  first takes the step's outcome from the others (`ahead`; they passed the
  fingerprint, so it matched and carried no non-finite verdict) and is recovered as
  after that step. A survivor that is still in a bucket of that step lacks its
  averaged gradients, which those ahead have applied already: nobody can finish the
  step exactly, and every survivor falls back at once with that reason (`lagging`);
- *donor*: the lowest rank among those furthest ahead hands the state over (the
  lowest surviving rank when all stand level).

Cost: one store write and one read per survivor per recovery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from lockstep.live import keys, lines, sealed
from lockstep.runtime.recovery import Point, Where


@dataclass(frozen=True)
class Stand:
    """Where one survivor met a loss.

    Args:
        rank: the survivor.
        steps: the synchronised steps it had finished.
        within: it recovers inside the step after `steps` (or at that step's start).
        point: the recovery point it met the loss in ("" inside a step's backward).
        reduced: inside a step's backward, every bucket of the step is reduced here:
            only the step fingerprint, its last collective, was still out.
    """

    rank: int
    steps: int
    within: bool
    point: str = ""
    reduced: bool = False

    def describe(self) -> str:
        """Where it met the loss, in words: "the step fingerprint of step 5" and the like."""
        if self.point:
            return Point[self.point].describe(self.steps + self.within)
        step = self.steps + 1
        return f"the fingerprint of step {step}" if self.reduced else f"a bucket of step {step}"

    def catches_up(self, top: int) -> bool:
        """Whether it can take the outcome of the step that peers with `top` finished steps
        finished: it was still in that step's fingerprint, its buckets reduced."""
        return self.steps == top - 1 and self.within and not self.point and self.reduced


def _key(generation: int, rank: int) -> str:
    return keys.AT.format(generation=generation, rank=rank)


def survey(
    store: dist.Store, generation: int, mine: Stand, survivors: list[int], wait_s: float
) -> list[Stand]:
    """Post where this survivor stands in `generation`; read every survivor's (`read`)."""
    sealed.put(store, _key(generation, mine.rank), asdict(mine))
    return read(store, generation, survivors, wait_s)


def read(store: dist.Store, generation: int, survivors: list[int], wait_s: float) -> list[Stand]:
    """Every survivor's post for `generation`, each awaited up to `wait_s`.

    Raises:
        LockstepError: a survivor did not post where it stands within the bound.
    """
    posts = [_key(generation, r) for r in survivors]
    try:
        store.wait(posts, timedelta(seconds=wait_s))
    except RuntimeError as error:  # torch's store raises on its timeout
        missing = [r for r, key in zip(survivors, posts, strict=True) if not store.check([key])]
        raise lines.fallback(
            f"rank {dist.get_rank()} waited {wait_s:.0f} s for survivor(s) {missing} to say "
            f"where they recover in generation {generation}"
        ) from error
    stands = [_stand(store, key) for key in posts]
    unread = [r for r, stand in zip(survivors, stands, strict=True) if stand is None]
    if unread:
        raise lines.fallback(
            f"rank {dist.get_rank()} could not read where survivor(s) {unread} recover in "
            f"generation {generation}: their posts do not open (named above)"
        )
    return [stand for stand in stands if stand is not None]


def _stand(store: dist.Store, key: str) -> Stand | None:
    """The post under `key`, or None when it does not open or parse (named once)."""
    value = sealed.read(store, key)
    if value is None:
        return None
    try:
        return Stand(**value)
    except TypeError:
        sealed.wrong_shape(key, value, "where a survivor met the loss")
        return None


def furthest(stands: list[Stand]) -> int:
    """The most steps any survivor finished."""
    return max(s.steps for s in stands)


def ahead(stands: list[Stand], mine: Stand) -> list[int]:
    """The survivors that finished the step `mine` is still in ([] when none did)."""
    return [s.rank for s in stands if s.steps > mine.steps]


def donor(stands: list[Stand]) -> int:
    """The survivor that hands the state over: the lowest rank of those furthest ahead."""
    top = furthest(stands)
    return min(s.rank for s in stands if s.steps == top)


def opened(stands: list[Stand], steps: int, within: bool) -> bool:
    """Whether a survivor with `steps` finished steps recovers inside the next step (this
    one, `within`, or a peer inside it or at its start)."""
    return within or any(s.within and s.steps == steps for s in stands)


def taken_between(stands: list[Stand]) -> set[Point]:
    """The collectives between steps that those furthest ahead met the loss in: a survivor
    that catches up with them skips those too (they went on without the result)."""
    top = furthest(stands)
    points = {Point[s.point] for s in stands if s.steps == top and s.point}
    return {p for p in points if p.where is Where.BETWEEN}


def lagging(stands: list[Stand]) -> str | None:
    """Why the survivors cannot finish together, or None (each one is level with those
    furthest ahead, or can catch up with them)."""
    top = furthest(stands)
    ahead_ranks = [s.rank for s in stands if s.steps == top]
    for s in stands:
        if s.steps == top or s.catches_up(top):
            continue
        met = f"survivor rank {s.rank} met the loss in {s.describe()} with {s.steps} steps finished"
        if s.steps == top - 1 and s.within and not s.point:  # a bucket's collective failed
            why = (
                f"rank {s.rank} lacks that step's averaged gradients, and the ranks that had "
                "them applied them already, so no survivor can finish the step exactly"
            )
        else:
            why = "only a survivor still in that step's fingerprint can take its outcome"
        return f"{met}, while rank(s) {ahead_ranks} had finished {top}: {why}"
    return None
