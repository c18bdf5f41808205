"""Every key live recovery writes in the launcher's worker store, in one table.

The launcher and the workers talk through the worker store (the TCPStore every worker
already dials): the launcher announces generations and reads who declared itself
recoverable and who joined; the workers post what a peer may need after a loss. A
key that belongs to a rendezvous round names the round (the store outlives a
whole-group restart); one per generation names the generation.

- `GENERATION` (a launcher, by compare-and-set; read by workers and launchers):
  `{"generation": g, "replaced": [ranks]}`;
- `READY` (each worker, for its launcher): "" (recoverable) or the reason it is not;
- `HANDOVER` (each worker, for a replacement): the hand-over it would serve,
  "plain" or "checkpointer";
- `JOINED` (each rank of a generation, for the launcher): "1" once it is in the new
  group with its state; `GROUP`: the store prefix of the generation's default group;
- `AT` (each survivor, for the others and the replacement): where it met the loss,
  `{"rank", "steps", "within", "point", "reduced"}` (`live/standing.py`);
- `RNG` (each worker, every synchronised step, before the step's last collective;
  read by the donor): `{"step": finished steps it is as of, "state": its random
  generators}`, in two slots (the parity of that count), so a post for the step under
  way never overwrites the one a recovery inside that step needs;
- `BUFFERS` (rank 0, every synchronised forward): (step, buffers), what the next
  buffer broadcast carries;
- `REBUILD` (rank 0, or the donor): rank 0's ready order, for the rebuild's broadcast;
- `STATEMENT` (each rank, once): its statement about the data, for the agreement;
- `ENDED` (each worker's bootstrap, once its script ended well; read by the launchers):
  "1", so a rank lost after it is not replaced (`launch/recovery/finished.py`); and
  `ENDED_COUNT`, how many did, which a launcher reads first (one call, not one a rank).

Every value above is sealed with the job's secret for this launch and round
(`live/sealed.py`; `ENDED_COUNT`, a counter, is only a hint read before the sealed
`ENDED` posts), and a value that does not open is ignored with a line naming its key.
`GROUP` holds torch's own keys of a generation's group, which torch reads unsealed.

A lost node's place (`launch/recovery/nodes.py`, `rejoin.py`) is negotiated in the
rendezvous store instead, sealed, in the round (names relative to the round):

- `REJOIN_INVITE` (node 0): `{"serial": n, "ranks": [...]}`, the lost node's place;
- `REJOIN_REQUEST` (a launcher started again as node K): its nonce, "let me in";
- `REJOIN_TAKEN` (compare-and-set, by the joiner or at the deadline): `{"nonce": the
  joiner's}` or "expired".
"""

from __future__ import annotations

from lockstep.env import read_variable

PREFIX = "lockstep/live/"
GENERATION = PREFIX + "generation"
READY = PREFIX + "ready/{rank}"
HANDOVER = PREFIX + "handover/{rank}"
JOINED = PREFIX + "joined/{generation}/{rank}"
GROUP = PREFIX + "gen{generation}/"
AT = PREFIX + "at/gen{generation}/{rank}"
RNG = PREFIX + "rng/{rank}/{parity}"  # parity of the finished steps it is as of
BUFFERS = PREFIX + "buffers0/{parity}"  # two steps kept: the parity of the step
REBUILD = "rebuild_order"  # per round (`in_round`): one rebuild per process lifetime
STATEMENT = "data_statement/{rank}"  # per round
ENDED = PREFIX + "ended/{rank}"
ENDED_COUNT = PREFIX + "ended/count"
REJOIN_INVITE = "rejoin/{node}"
REJOIN_REQUEST = "rejoin/{node}/request"
REJOIN_TAKEN = "rejoin/{node}/{serial}/taken"


def in_round(name: str) -> str:
    """`name` in this rendezvous round (the launcher's store outlives a restart)."""
    return f"{PREFIX}round{read_variable('TORCHELASTIC_RESTART_COUNT') or '0'}/{name}"
