"""See inside a run: per-step metrics, rank-0 logging, Chrome traces, straggler reports.

`Monitor` is the one object a training loop needs; the rest are its parts, usable
alone: `measure`/`summarize` (metrics), `TraceRecorder`/`merge_traces` (trace),
`StragglerWatch`/`analyze` (straggler), `plot_timeline`/`plot_loss` (pictures) and
`check_replicas` (are all replicas still identical). `attach_trace_from_env` is
what every engine calls at the end of its constructor: LOCKSTEP_TRACE=DIR traces
any run with no code change (`EnvTracer`); `trace_stragglers` reads the straggler
report back from trace files.
"""

from lockstep.observe.envtrace import EnvTracer, attach_trace_from_env
from lockstep.observe.metrics import IntervalSummary, StepMetrics, measure, summarize
from lockstep.observe.monitor import Monitor
from lockstep.observe.plot import plot_loss, plot_timeline
from lockstep.observe.replicas import ReplicaCheck, check_replicas, parameter_checksum
from lockstep.observe.report import trace_stragglers
from lockstep.observe.straggler import StragglerReport, StragglerWatch, analyze
from lockstep.observe.trace import TraceRecorder, join_traces, load_events, merge_traces

__all__ = [
    "EnvTracer",
    "IntervalSummary",
    "Monitor",
    "ReplicaCheck",
    "StepMetrics",
    "StragglerReport",
    "StragglerWatch",
    "TraceRecorder",
    "analyze",
    "attach_trace_from_env",
    "check_replicas",
    "join_traces",
    "load_events",
    "measure",
    "merge_traces",
    "parameter_checksum",
    "plot_loss",
    "plot_timeline",
    "summarize",
    "trace_stragglers",
]
