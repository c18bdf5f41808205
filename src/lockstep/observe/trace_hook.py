"""LOCKSTEP_TRACE for every engine: the tracer attached when a model is wrapped.

The engines know nothing of tracing (`observe/` sits above them); this module,
imported by `lockstep/__init__.py`, registers `attach_env_tracer` with
`runtime/wrap_hooks.py`, so setting LOCKSTEP_TRACE traces a script with no code
change. The tracer (or None when the variable is unset) is the model's `env_tracer`.
"""

from __future__ import annotations

from typing import Any

from lockstep.observe.envtrace import attach_trace_from_env
from lockstep.runtime.wrap_hooks import on_wrap


def attach_env_tracer(model: Any) -> None:
    """Set `model.env_tracer`: a tracer when LOCKSTEP_TRACE names a directory, else None."""
    model.env_tracer = attach_trace_from_env(model)


on_wrap(attach_env_tracer)
