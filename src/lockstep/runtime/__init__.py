"""The runtime both engines stand on: buckets, their collectives, waits, and the step's facts.

| module | holds |
|---|---|
| `handles.py` | `CollectiveHandle`: one protocol for a collective in flight |
| `transport.py` | native all-reduce, or lockstep's own algorithms on a comm thread |
| `averaging.py` | `Averaging`: the 1/N rule |
| `bucket.py` | `Bucket`: a flat buffer, its slots, its per-step counters; `GradBucket` for hooks |
| `bucketing.py` | which gradients travel together: a pure function |
| `bucket_collective.py` | what a complete bucket runs (all-reduce, comm hook, skip) |
| `step.py` | `StepState`: everything one synchronised backward changes |
| `fingerprint.py`, `data_passes.py` | the step fingerprint: ranks that pair different steps |
| `waits.py` | waits that report stalls: who has not launched the collective |
| `progress.py` | each worker's step and phase, where its launcher reads it |
| `step_stats.py` | `StepStats`: times, overlap and bytes of the last step |
| `step_errors.py` | the errors a step ends in, worded once |
| `replicate.py` | broadcast parameters and buffers from rank 0 |
| `same_parameters.py` | every rank holds the same parameters |
| `wrap_hooks.py` | callbacks run when an engine has wrapped a model (tracing) |
"""
