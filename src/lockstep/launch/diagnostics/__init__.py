"""Diagnostics: checks before the launch, failure reports after it, traces at its end.

`preflight.py` checks the route to the master; `report.py` writes who failed where and
how; `tracing.py` merges the workers' traces (`lockstep run --trace`).
"""
