"""`Monitor`: one call after `optimizer.step()` to see inside a data-parallel run.

    monitor = lockstep.Monitor(ddp, ctx, optimizer=opt, total_steps=1000, log_dir="runs/x")
    for x, y in loader:
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(loss, batch_size=len(x))
    monitor.close()

Each `step()` reads the engine's `ddp.stats` (stamped during backward anyway),
adds the iteration time and the optimizer time (taken by the optimizer's own step
hooks), and hands the result to the sinks: the trace every step; the log line,
JSONL and TensorBoard every `log_every` steps (the losses of the interval are
averaged over ranks in one small all-reduce); the straggler report every
`straggler_every` steps (one small all-gather). Every rank must call `step()`.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lockstep.context import DistContext
from lockstep.env import read_trace_dir
from lockstep.observe.logger import ConsoleLog, JsonlSink, TensorBoardSink, tensorboard_available
from lockstep.observe.loss_mean import mean_over_ranks
from lockstep.observe.metrics import IntervalSummary, StepMetrics, measure, summarize
from lockstep.observe.straggler import StragglerReport, StragglerWatch
from lockstep.observe.trace import TraceRecorder, merge_traces
from lockstep.runtime import recovery
from lockstep.runtime.recovery import Point

METRICS_FILE = "metrics.jsonl"
PathLike = str | os.PathLike[str]


class Monitor:
    """Per-step metrics, rank-0 logging, Chrome traces and straggler reports for a DDP run.

    Args:
        ddp: the model, wrapped by `lockstep.DistributedDataParallel` or `ShardedDataParallel`.
        ctx: this process's `DistContext` (from `lockstep.init()`); rank facts are taken
            from `ddp.ctx`, the model's own group, so the two always agree.
        optimizer: a torch optimizer; its `step()` is timed through its step hooks.
        log_every: steps per log line and per JSONL/TensorBoard write.
        total_steps: the step the run ends at (the progress bar's length).
        start_step: the step a resumed run continues after (steps are numbered from it).
        log_dir: where rank 0 writes `metrics.jsonl` (and TensorBoard files); None: no files.
        progress: rank 0 draws a tqdm bar when stdout is a terminal.
        trace: directory for `trace_rank{rank}.json`; None reads LOCKSTEP_TRACE; False: off.
        trace_steps: how many of the last steps the trace keeps.
        straggler_every: steps per straggler report; 0 or None: no reports.
        tensorboard: write TensorBoard scalars in `log_dir`; None: when it is installed.
        stream: where rank 0 prints (default: sys.stdout for lines, the bar on stderr).

    Raises:
        ValueError: log_every < 1, straggler_every < 0, `ddp` is not lockstep's, or
            tensorboard=True without log_dir or the package.
    """

    def __init__(
        self,
        ddp: torch.nn.Module,
        ctx: DistContext,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        log_every: int = 10,
        total_steps: int | None = None,
        start_step: int = 0,
        log_dir: PathLike | None = None,
        progress: bool = True,
        trace: PathLike | bool | None = None,
        trace_steps: int = 100,
        straggler_every: int | None = 50,
        tensorboard: bool | None = None,
        stream: Any = None,
    ) -> None:
        if log_every < 1 or (straggler_every or 0) < 0:
            raise ValueError(
                "Monitor expected log_every >= 1 and straggler_every >= 0 (or None); found "
                f"log_every={log_every}, straggler_every={straggler_every}"
            )
        if not hasattr(ddp, "stats"):
            raise ValueError(
                "Monitor expected a lockstep.DistributedDataParallel or ShardedDataParallel "
                f"(it reads model.stats); found {type(ddp).__name__}. Wrap the model with one."
            )
        # The ranks described are those of the model's group: its context, not the
        # job's, so a model on a subgroup is averaged over that subgroup.
        self.ddp, self.ctx = ddp, ddp.ctx
        self.log_every, self.straggler_every = log_every, straggler_every or 0
        self.step_count = start_step
        self.reports: list[StragglerReport] = []
        self.last: StepMetrics | None = None
        self.last_summary: IntervalSummary | None = None
        self._pending: list[tuple[StepMetrics, Any]] = []
        self._engine_step = ddp.stats.step if ddp.stats is not None else 0
        self._last_end: float | None = None
        self._optimizer: list[float] = []
        self._hooks = self._build_optimizer_hooks(optimizer)
        self._build_sinks(log_dir, tensorboard, total_steps, start_step, progress, stream)
        self._env_tracer: Any = None
        self.trace = self._build_trace(trace, trace_steps)
        every = self.straggler_every
        self.watch = StragglerWatch(self.group, self.ctx.device, self.ctx.world_size, every)

    # ---------------------------------------------------------------- build
    def _build_optimizer_hooks(self, optimizer: torch.optim.Optimizer | None) -> list[Any]:
        if optimizer is None:
            return []
        stamp = self._optimizer
        return [
            optimizer.register_step_pre_hook(lambda *_: stamp.append(time.perf_counter())),
            optimizer.register_step_post_hook(lambda *_: stamp.append(time.perf_counter())),
        ]

    def _build_sinks(
        self,
        log_dir: PathLike | None,
        tensorboard: bool | None,
        total_steps: int | None,
        start_step: int,
        progress: bool,
        stream: Any,
    ) -> None:
        main = self.ctx.is_main
        if tensorboard and (log_dir is None or not tensorboard_available()):
            raise ValueError(
                "Monitor(tensorboard=True) needs log_dir= and the tensorboard package; found "
                f"log_dir={log_dir}, tensorboard installed: {tensorboard_available()}. "
                "Install it with `pip install lockstep[tensorboard]`."
            )
        use_tb = tensorboard if tensorboard is not None else tensorboard_available()
        self.console = ConsoleLog(total_steps, start_step, progress, stream) if main else None
        self.jsonl = JsonlSink(Path(log_dir) / METRICS_FILE) if main and log_dir else None
        self.tensorboard = TensorBoardSink(log_dir) if main and log_dir and use_tb else None

    def _build_trace(self, trace: PathLike | bool | None, steps: int) -> TraceRecorder | None:
        """The recorder; the engine's LOCKSTEP_TRACE tracer hands over its file when it has one."""
        tracer = getattr(self.ddp, "env_tracer", None)
        if trace is False and tracer is not None:
            tracer.close(write=False)  # trace=False: off, even with LOCKSTEP_TRACE set
        directory = read_trace_dir() if trace is None or trace is True else trace
        if not directory:
            return None
        if tracer is not None and tracer.directory == Path(directory).resolve():
            self._env_tracer = tracer
            return tracer.hand_over(self.ctx.rank, steps)
        return TraceRecorder(directory, self.ctx.rank, self.ctx.world_size, steps)

    # ----------------------------------------------------------------- step
    def step(self, loss: torch.Tensor | float | None = None, batch_size: int = 0) -> StepMetrics:
        """Record the step that just ended; call on every rank after `optimizer.step()`.

        Args:
            loss: the step's loss on this rank, a scalar (a tensor is read once per interval).
            batch_size: samples this rank processed in the step; samples/s counts all ranks.

        Returns:
            This rank's metrics of the step (the loss is filled in at the interval's end).
        """
        now = time.perf_counter()
        stats = self.ddp.stats
        fresh = stats is not None and stats.step != self._engine_step
        if fresh:
            self._engine_step = stats.step
        else:
            stats = None
        begin = self._last_end if self._last_end is not None else (stats.start if stats else now)
        data = max(0.0, stats.start - self._last_end) if stats and self._last_end else 0.0
        optimizer = (self._optimizer[0], self._optimizer[-1]) if self._optimizer else None
        self._optimizer.clear()
        self.step_count += 1
        metrics = measure(
            stats,
            step=self.step_count,
            samples=batch_size * self.ctx.world_size,
            step_seconds=now - begin,
            data_seconds=data,
            optimizer_seconds=optimizer[1] - optimizer[0] if optimizer else 0.0,
        )
        self._after_step(metrics, stats, begin, now, optimizer, loss)
        self._last_end = now
        self.last = metrics
        return metrics

    def _after_step(
        self,
        metrics: StepMetrics,
        stats: Any,
        begin: float,
        now: float,
        optimizer: tuple[float, float] | None,
        loss: Any,
    ) -> None:
        if self.trace is not None:
            self.trace.record(metrics, stats, begin, now, optimizer)
        if stats is not None and self.straggler_every:
            self.watch.record(metrics.step, stats)
        self._pending.append((metrics, loss.detach() if torch.is_tensor(loss) else loss))
        if self.console is not None:
            self.console.step()
        recoveries = recovery.recoveries()
        if metrics.step % self.log_every == 0:
            self.flush()
        if self.straggler_every and metrics.step % self.straggler_every == 0:
            if recovery.recoveries() == recoveries:
                self._report_stragglers()
            else:  # recovered in the flush: the replacement starts at the next step
                self.watch.exchange_skipped()

    # -------------------------------------------------------------- interval
    def flush(self) -> IntervalSummary | None:
        """Average the pending losses over ranks and write the pending steps; collective."""
        if not self._pending:
            return None
        numbers = [metrics.step for metrics, _ in self._pending]
        losses = [loss for _, loss in self._pending]
        if any(loss is not None for loss in losses):
            size, device = self.ctx.world_size, self.ctx.device
            losses = mean_over_ranks(numbers, losses, self.log_every, self.group, size, device)
        steps = [replace(m, loss=v) for (m, _), v in zip(self._pending, losses, strict=True)]
        self._pending = []
        summary = summarize(steps)
        self.last_summary = summary
        if self.console is not None:
            self.console.interval(summary)
        for sink in (self.jsonl, self.tensorboard):
            if sink is not None:
                for metrics in steps:
                    sink.write(metrics.to_dict() if sink is self.jsonl else metrics)
                sink.flush()
        return summary

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The model's group now (a live recovery replaces it: docs/multinode.md)."""
        return self.ddp.process_group

    def _report_stragglers(self) -> None:
        self.watch.group = self.group
        report = self.watch.exchange()
        if report is None:
            return
        self.reports.append(report)
        if self.console is not None:
            self.console.line(report.describe())
        if self.jsonl is not None:
            self.jsonl.write(report.to_dict())

    # ----------------------------------------------------------------- close
    def close(self) -> Path | None:
        """Flush, close the files and write the trace; call on every rank.

        Returns:
            With tracing on, on rank 0, the merged trace of all ranks (None elsewhere, or
            when the other ranks' files are not visible from rank 0).
        """
        self.flush()
        self._close_local()
        if self.trace is None:
            return None
        trace, self.trace = self.trace, None
        if self._env_tracer is not None:  # stops its background writes after the last one
            self._env_tracer.close()
        else:
            trace.write()
        if self.ctx.world_size > 1:  # every rank's file is written; a loss: again, with its
            while not recovery.run(
                Point.CLOSING, self.step_count, self._barrier, group=self.group
            ).ran:
                pass  # replacement, which runs no step and closes its Monitor too
        if not self.ctx.is_main:
            return None
        try:
            return merge_traces(trace.path.parent, world_size=self.ctx.world_size)
        except ValueError as error:  # other nodes' files are not here (no shared file system)
            print(
                f"lockstep trace: not merged: {error}. Copy every rank's file into one "
                "directory and run `lockstep trace merge DIR`."
            )
            return None

    def _barrier(self) -> dist.Work | None:
        return dist.barrier(group=self.group, async_op=True)

    def _close_local(self) -> None:
        """Remove the optimizer hooks and close this rank's files; no communication."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for sink in (self.console, self.jsonl, self.tensorboard):
            if sink is not None:
                sink.close()
        self.console = self.jsonl = self.tensorboard = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:  # another rank may be gone: no collective, just close the files
            self._close_local()
