"""Where the metrics go: one log line per interval, a progress bar, JSONL, TensorBoard.

Only rank 0 builds these: with many ranks, one line per interval and one bar,
never one per rank. `ConsoleLog` prints the compact line (through the bar, so
the two do not garble each other) and draws a tqdm bar when tqdm is installed and
the output is a terminal. `JsonlSink` appends one JSON object per step (and per
straggler report) to a file; `TensorBoardSink` writes scalars when the optional
`tensorboard` package is installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from lockstep.observe.metrics import IntervalSummary, StepMetrics


def format_line(summary: IntervalSummary, total_steps: int | None = None) -> str:
    """The compact log line: step, loss, ms/step, samples/s, overlap %, bytes on the wire."""
    step = f"{summary.step}/{total_steps}" if total_steps else str(summary.step)
    loss = "-" if summary.loss is None else f"{summary.loss:.4f}"
    return (
        f"step {step:>9}  loss {loss}  {summary.ms_per_step:7.1f} ms/step  "
        f"{summary.samples_per_second:8.1f} samples/s  overlap {summary.overlap:4.0%}  "
        f"wire {_bytes(summary.wire_bytes_per_step)}/step"
    )


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class ConsoleLog:
    """Rank 0's log lines and progress bar.

    Args:
        total_steps: the bar's length (None: a bar that only counts).
        first_step: the step a resumed run starts after (the bar starts there).
        progress: draw a tqdm bar when tqdm is installed and `stream` is a terminal.
        stream: where lines and the bar go (default sys.stderr for the bar,
            sys.stdout for lines).
    """

    def __init__(
        self,
        total_steps: int | None,
        first_step: int = 0,
        progress: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.stream = stream
        self.bar = _make_bar(total_steps, first_step, stream) if progress else None

    def step(self) -> None:
        """Advance the bar by one step (cheap: tqdm redraws a few times a second)."""
        if self.bar is not None:
            self.bar.update(1)

    def line(self, text: str) -> None:
        """Print a line above the bar."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream or sys.stdout, flush=True)

    def interval(self, summary: IntervalSummary) -> None:
        if self.bar is not None and summary.loss is not None:
            self.bar.set_postfix(loss=f"{summary.loss:.4f}", refresh=False)
        self.line(format_line(summary, self.total_steps))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _make_bar(total: int | None, first_step: int, stream: TextIO | None) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    # disable=None: no bar when the output is not a terminal (a CI log, a file).
    return tqdm(
        total=total,
        initial=first_step,
        file=stream,
        disable=None,
        unit="step",
        dynamic_ncols=True,
        leave=True,
    )


class JsonlSink:
    """Appends one JSON object a line to `path` (a resumed run continues the file).

    Args:
        path: the file; its directory is created.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars for TensorBoard, one event file in `directory` (needs `tensorboard`).

    Raises:
        ImportError: tensorboard is not installed (`pip install lockstep[tensorboard]`).
    """

    def __init__(self, directory: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, metrics: StepMetrics) -> None:
        step, add = metrics.step, self.writer.add_scalar
        if metrics.loss is not None:
            add("train/loss", metrics.loss, step)
        add("time/step_ms", 1e3 * metrics.step_seconds, step)
        add("time/forward_ms", 1e3 * metrics.forward_seconds, step)
        add("time/backward_ms", 1e3 * metrics.backward_seconds, step)
        add("time/optimizer_ms", 1e3 * metrics.optimizer_seconds, step)
        add("comm/exposed_ms", 1e3 * metrics.exposed_seconds, step)
        add("comm/overlap", metrics.overlap, step)
        add("comm/wire_bytes", metrics.wire_bytes, step)
        add("throughput/samples_per_second", metrics.samples_per_second, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tensorboard_available() -> bool:
    """Whether the optional tensorboard package is importable."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
