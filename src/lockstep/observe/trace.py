"""Chrome trace files: each rank's timeline of the last steps, viewable in Perfetto.

After every step the monitor hands `TraceRecorder.record` the engine's stamps;
it turns them into trace events: a `step` slice holding `data`, `forward`,
`backward`, `wait for all-reduce` and `optimizer` on the compute track, and on
one track per bucket a `ready` instant and the `all-reduce` slice from launch to
done. Only the last `max_steps` steps are kept. Timestamps are wall-clock
microseconds, so the files of ranks on one machine line up exactly when
`merge_traces` puts them in one file (one process per rank). Recording and
writing may run on different threads (`observe/envtrace.py` writes from a
background thread): the kept steps sit behind a lock, the file behind another.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lockstep.observe.metrics import StepMetrics
from lockstep.runtime.step_stats import StepStats

MERGED_NAME = "trace.json"
COMPUTE_TID = 0


def rank_file(directory: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its trace inside `directory`."""
    return Path(directory) / f"trace_rank{rank}.json"


def bucket_tid(index: int) -> int:
    """The track (thread id) of bucket `index`: the compute track is 0."""
    return 1 + index


class TraceRecorder:
    """Collects one rank's trace events and writes them as Chrome trace JSON.

    Args:
        directory: where `trace_rank{rank}.json` goes (created if missing).
        rank: this process's rank (the trace's process id).
        world_size: ranks in the job (recorded in the file's metadata).
        max_steps: how many of the most recent steps to keep.

    Raises:
        ValueError: max_steps < 1.
    """

    def __init__(self, directory: str | Path, rank: int, world_size: int, max_steps: int = 100):
        if max_steps < 1:
            raise ValueError(f"trace max_steps must be at least 1; found {max_steps}")
        self.path = rank_file(directory, rank)
        self.rank, self.world_size = rank, world_size
        self._offset = time.time() - time.perf_counter()  # perf_counter() -> epoch seconds
        self._steps: deque[tuple[Any, ...]] = deque(maxlen=max_steps)
        self._lock = threading.Lock()  # guards _steps and recorded
        self._write_lock = threading.Lock()  # one writer of the file at a time
        self.recorded = 0  # steps recorded so far (a writer compares it with its last write)

    def _us(self, t: float) -> float:
        return round((t + self._offset) * 1e6, 3)

    def _slice(self, name: str, cat: str, t0: float, t1: float, tid: int, args: dict) -> dict:
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": self.rank,
            "tid": tid,
            "ts": self._us(t0),
            "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
            "args": args,
        }

    def record(
        self,
        metrics: StepMetrics,
        stats: StepStats | None,
        step_begin: float,
        step_end: float,
        optimizer: tuple[float, float] | None,
    ) -> None:
        """Add one step's events; times are perf_counter() readings.

        Args:
            metrics: the step's metrics (for its number).
            stats: the engine's figures of the step, or None without a synchronised backward.
            step_begin: the end of the previous step (or this step's forward, for the first).
            step_end: when the monitor was told the step ended.
            optimizer: (start, end) of `optimizer.step()`, or None when not timed.
        """
        self.record_step(metrics.step, stats, step_begin, step_end, optimizer)

    def record_step(
        self,
        step: int,
        stats: StepStats | None,
        step_begin: float,
        step_end: float,
        optimizer: tuple[float, float] | None = None,
    ) -> None:
        """`record` with the step's number alone (what the env tracer knows); thread-safe."""
        # Keep the raw stamps (StepStats is frozen); events are built only when written.
        with self._lock:
            self._steps.append((step, stats, step_begin, step_end, optimizer))
            self.recorded += 1

    def _step_events(
        self,
        step: int,
        stats: StepStats | None,
        step_begin: float,
        step_end: float,
        optimizer: tuple[float, float] | None,
    ) -> list[dict[str, Any]]:
        args = {"step": step}
        add = self._slice
        events = [add(f"step {step}", "step", step_begin, step_end, COMPUTE_TID, args)]
        if stats is not None:
            events += self._engine_events(stats, step_begin, args)
        if optimizer is not None:
            events.append(add("optimizer", "optimizer", *optimizer, COMPUTE_TID, args))
        return events

    def _engine_events(self, stats: StepStats, step_begin: float, args: dict) -> list[dict]:
        start = stats.start
        forward_end = start + stats.forward_seconds
        backward_end = forward_end + stats.backward_seconds
        add, tid = self._slice, COMPUTE_TID
        events = []
        if start > step_begin:
            events.append(add("data", "data", step_begin, start, tid, args))
        events.append(add("forward", "forward", start, forward_end, tid, args))
        events.append(add("backward", "backward", forward_end, backward_end, tid, args))
        if stats.exposed_seconds > 0:
            end = backward_end + stats.exposed_seconds
            events.append(add("wait for all-reduce", "exposed", backward_end, end, tid, args))
        for b in stats.buckets:
            info = {**args, "bucket": b.index, "bytes": b.nbytes, "params": b.num_params}
            info["ready_ms"] = round(b.ready * 1e3, 3)
            events.append(
                {
                    "name": f"bucket {b.index} ready",
                    "cat": "ready",
                    "ph": "i",
                    "s": "t",
                    "pid": self.rank,
                    "tid": bucket_tid(b.index),
                    "ts": self._us(start + b.ready),
                    "args": info,
                }
            )
            events.append(
                add(
                    f"all-reduce bucket {b.index}",
                    "allreduce",
                    start + b.launched,
                    start + b.done,
                    bucket_tid(b.index),
                    info,
                )
            )
        return events

    def events(self) -> list[dict[str, Any]]:
        """Track names and the kept steps' events, oldest first."""
        with self._lock:
            kept = list(self._steps)
        steps = [self._step_events(*recorded) for recorded in kept]
        num_buckets = max((len(r[1].buckets) for r in kept if r[1] is not None), default=0)
        meta = [
            _meta("process_name", self.rank, COMPUTE_TID, {"name": f"rank {self.rank}"}),
            _meta("process_sort_index", self.rank, COMPUTE_TID, {"sort_index": self.rank}),
            _meta("thread_name", self.rank, COMPUTE_TID, {"name": "compute"}),
        ]
        for index in range(num_buckets):
            tid = bucket_tid(index)
            meta.append(_meta("thread_name", self.rank, tid, {"name": f"bucket {index}"}))
            meta.append(_meta("thread_sort_index", self.rank, tid, {"sort_index": tid}))
        return meta + [event for step in steps for event in step]

    def write(self) -> Path:
        """Write `trace_rank{rank}.json` (a complete JSON object) and return its path.

        The file is written aside and renamed over the old one, so a reader (or a
        process killed mid-write) only ever sees a whole trace.
        """
        with self._write_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            document = {
                "traceEvents": self.events(),
                "displayTimeUnit": "ms",
                "otherData": {"rank": self.rank, "world_size": self.world_size},
            }
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(document, separators=(",", ":")))
            tmp.replace(self.path)
        return self.path


def _meta(name: str, pid: int, tid: int, args: dict) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def rank_files(directory: str | Path) -> list[Path]:
    """The per-rank trace files in `directory`, in rank order.

    Raises:
        ValueError: the directory holds no `trace_rank*.json`.
    """
    found = sorted(
        Path(directory).glob("trace_rank*.json"),
        key=lambda p: int(p.stem.removeprefix("trace_rank") or -1),
    )
    if not found:
        raise ValueError(
            f"expected trace_rank<N>.json files in {directory}; found none. Write them with "
            "LOCKSTEP_TRACE=<dir> or lockstep.Monitor(..., trace=<dir>)."
        )
    return found


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file, or of every rank's file when `path` is a directory.

    Raises:
        ValueError: the path does not exist, or a file is not Chrome trace JSON.
    """
    path = Path(path)
    if path.is_dir():
        return [event for file in rank_files(path) for event in load_events(file)]
    if not path.exists():
        raise ValueError(f"expected a trace file or directory; {path} does not exist")
    try:
        document = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not Chrome trace JSON: {error}") from None
    events = document.get("traceEvents") if isinstance(document, dict) else document
    if not isinstance(events, list):
        raise ValueError(f"{path} has no traceEvents list; expected Chrome trace JSON")
    return events


def merge_traces(
    directory: str | Path,
    out: str | Path | None = None,
    world_size: int | None = None,
    ranks: Sequence[int] | None = None,
) -> Path:
    """Merge the ranks' traces in `directory` into one file (default `directory/trace.json`).

    Args:
        directory: where the `trace_rank<N>.json` files are.
        out: the merged file.
        world_size: merge exactly ranks 0..world_size-1 (files left by an earlier run
            with more ranks are ignored); None: every rank file found.
        ranks: merge exactly these ranks (one node's, say); overrides world_size.

    Returns:
        The path of the merged file.

    Raises:
        ValueError: no rank files (or a missing one), or one that cannot be read.
    """
    files = rank_files(directory)
    if world_size is not None or ranks is not None:
        wanted = list(ranks) if ranks is not None else list(range(world_size or 0))
        files = [rank_file(directory, rank) for rank in wanted]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ValueError(f"expected a trace file for every rank; missing {missing}")
    return _write_merged(files, out if out is not None else Path(directory) / MERGED_NAME)


def join_traces(directories: Sequence[str | Path], out: str | Path) -> Path:
    """Merge the rank files of several directories (one per node) into one file.

    Raises:
        ValueError: a directory holds no rank file, or one rank is in two different files.
    """
    by_rank: dict[int, Path] = {}
    for directory in directories:
        for file in rank_files(directory):
            rank = int(file.stem.removeprefix("trace_rank"))
            seen = by_rank.setdefault(rank, file)
            if seen.resolve() != file.resolve():
                raise ValueError(
                    f"expected each rank's trace once; rank {rank} is in both {seen} and "
                    f"{file}. Pass each node's directory once (they come from one run)."
                )
    return _write_merged([by_rank[rank] for rank in sorted(by_rank)], out)


def _write_merged(files: list[Path], out: str | Path) -> Path:
    events = [event for file in files for event in load_events(file)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": len(files)}}
    out.write_text(json.dumps(document, separators=(",", ":")))
    return out
