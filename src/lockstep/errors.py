"""Error types that lockstep raises to its users.

Every message says what was expected, what was found, on which rank, and what
to do. Distributed checks raise on every rank at once (after exchanging what
each rank holds), so no rank is left hanging in a collective.
"""

from __future__ import annotations


class LockstepError(RuntimeError):
    """Base class of the errors lockstep raises on purpose."""


class EnvironmentConfigError(LockstepError, ValueError):
    """A launcher variable (RANK, WORLD_SIZE, SLURM_*, ...) is missing or inconsistent."""


class RankMismatchError(LockstepError):
    """Ranks disagree about something they must agree on (parameters, data, config)."""


class ReplicaMismatchError(RankMismatchError):
    """Replicas (parameters, buffers, optimizer state) differ; `runtime/replica_check.py`."""


class UnusedParametersError(LockstepError):
    """Some parameters received no gradient although find_unused_parameters=False."""


class CheckpointError(LockstepError):
    """A checkpoint cannot be written or read."""


class NonFiniteGradientError(LockstepError):
    """A rank's gradients held NaN or inf at a synchronised step (`runtime/finite.py`)."""


class NonFiniteSkipWarning(UserWarning):
    """nonfinite="skip" skipped a step whose gradients held NaN or inf (`runtime/finite.py`)."""
