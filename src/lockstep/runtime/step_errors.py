"""The errors a synchronised step can end in, worded once for every rank.

The DDP `Reducer` and the backward driver raise them from hooks and from the
next forward; each says what was expected, what was found, on which rank, and
what to do.
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep.errors import LockstepError


def ready_twice(name: str, rank: int) -> LockstepError:
    return LockstepError(
        f"parameter {name!r} became ready twice in one backward on rank {rank}; expected "
        "once. This happens with reentrant activation checkpointing, a layer run twice, "
        "or a second backward through the same graph: pass static_graph=True to "
        "DistributedDataParallel (the graph must then be the same every step), use "
        "checkpoint(use_reentrant=False), or wrap extra backwards in no_sync()."
    )


def second_backward(name: str, rank: int) -> LockstepError:
    return LockstepError(
        f"on rank {rank}: parameter {name!r} received a gradient from a second backward "
        "through a step that was already synchronised; its gradient would stay local to "
        "this rank and the replicas would drift apart. Expected one backward per "
        "synchronised forward. Sum the losses and call backward() once, or run the "
        "forward again for the second backward."
    )


def unfinished(missing: Sequence[str], rank: int) -> str:
    # The first words are torch's: frameworks match them (Lightning adds its own hint).
    return (
        "Expected to have finished reduction in the prior iteration before starting a new "
        f"one: on rank {rank}, {len(missing)} parameter(s) received no gradient in the previous "
        f"backward, so their buckets were never reduced: {list(missing[:10])}"
        f"{' ...' if len(missing) > 10 else ''}. With find_unused_parameters=False every "
        "trainable parameter must contribute to the loss. Fix: pass "
        "find_unused_parameters=True to DistributedDataParallel, or freeze these "
        "parameters (requires_grad=False), or make their outputs part of the loss."
    )
