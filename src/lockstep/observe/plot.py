"""Pictures of a run: the timeline of a few steps across ranks, and the loss curve.

`plot_timeline` reads Chrome trace events (a merged file, or the per-rank files
of a trace directory) and draws one lane per rank: above, compute (data,
forward, backward, the wait for all-reduce, optimizer); below, communication,
one bar per bucket from launch to done, with a tick where the bucket became
ready. Overlap is what is visible at a glance: bars below that sit under the
backward bar above. `plot_loss` draws the loss of a `metrics.jsonl` file.
Needs matplotlib (drawn off-screen, the Agg backend).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from lockstep.observe.trace import load_events

COLORS = {
    "data": "#b0b0b0",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "exposed": "#c44e52",
    "optimizer": "#8172b2",
}
COMM_COLORS = ("#dd8452", "#f2b880")
COMPUTE_CATS = tuple(COLORS)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "drawing needs matplotlib, which is not installed; pip install matplotlib"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def select_steps(events: list[dict[str, Any]], steps: int) -> dict[int, list[dict[str, Any]]]:
    """The events of the last `steps` steps that every rank recorded, by rank.

    Raises:
        ValueError: steps < 1, or no step is present on every rank.
    """
    if steps < 1:
        raise ValueError(f"expected at least 1 step to draw; found {steps}")
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") in ("X", "i") and "step" in event.get("args", {}):
            by_rank[int(event["pid"])].append(event)
    sets = [{e["args"]["step"] for e in es} for es in by_rank.values()]
    common = set.intersection(*sets) if sets else set()
    if not common:
        raise ValueError("the trace holds no step that every rank recorded; nothing to draw")
    chosen = set(sorted(common)[-steps:])
    return {
        rank: [e for e in es if e["args"]["step"] in chosen] for rank, es in sorted(by_rank.items())
    }


def plot_timeline(source: str | Path, out: str | Path, steps: int = 3) -> Path:
    """Draw the last `steps` steps of a trace as a PNG, one lane per rank.

    Args:
        source: a merged trace file, one rank's file, or a directory of rank files.
        out: the PNG to write.
        steps: how many of the last steps (present on every rank) to draw.

    Returns:
        The path of the PNG.

    Raises:
        ValueError: the trace cannot be read, holds no common step, or matplotlib is missing.
    """
    chosen = select_steps(load_events(source), steps)
    plt = _pyplot()
    origin = min(e["ts"] for es in chosen.values() for e in es)
    span = max(e["ts"] + e.get("dur", 0) for es in chosen.values() for e in es) - origin
    fig, ax = plt.subplots(figsize=(12, 0.9 + 1.25 * len(chosen)), dpi=100)
    for lane, events in enumerate(chosen.values()):
        _draw_lane(ax, -2.0 * lane, events, origin, span / 1e3)
    ticks = [y for lane in range(len(chosen)) for y in (-2.0 * lane + 0.45, -2.0 * lane - 0.45)]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"rank {r} {row}" for r in chosen for row in ("compute", "comm")])
    step_ids = sorted({e["args"]["step"] for es in chosen.values() for e in es})
    ax.set_xlabel("milliseconds")
    ax.set_title(
        f"{len(chosen)} rank(s), steps {step_ids[0]}-{step_ids[-1]}: compute above, "
        "all-reduce of bucket b<i> below (launch to done; ▼ = bucket ready)",
        fontsize=10,
    )
    _legend(ax, plt)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def _draw_lane(
    ax: Any, base: float, events: list[dict[str, Any]], origin: float, span_ms: float
) -> None:
    """Compute row centred at base + 0.45, comm rows (two, by bucket parity) below it."""
    for e in events:
        x0 = (e["ts"] - origin) / 1e3
        cat = e.get("cat")
        if e["ph"] == "X" and cat in COLORS:
            ax.broken_barh([(x0, e["dur"] / 1e3)], (base + 0.05, 0.8), color=COLORS[cat])
        elif cat in ("allreduce", "ready"):
            bucket = e["args"]["bucket"]
            y = base - 0.9 + 0.42 * (bucket % 2)
            if cat == "ready":
                ax.plot([x0], [y + 0.4], marker="v", color="black", markersize=4)
                continue
            width = e["dur"] / 1e3
            ax.broken_barh(
                [(x0, width)], (y, 0.4), color=COMM_COLORS[bucket % 2], edgecolor="#7a3c10"
            )
            if width > 0.025 * span_ms:
                ax.text(x0 + width / 2, y + 0.2, f"b{bucket}", ha="center", va="center", fontsize=7)


def _legend(ax: Any, plt: Any) -> None:
    names = {
        "data": "data / other",
        "forward": "forward",
        "backward": "backward",
        "exposed": "wait for all-reduce",
        "optimizer": "optimizer",
    }
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in names]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=COMM_COLORS[0]))
    labels = [*names.values(), "all-reduce (bucket)"]
    ax.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=6,
        fontsize=8,
        frameon=False,
    )


def read_losses(path: str | Path) -> dict[int, float]:
    """Step -> loss from a metrics.jsonl (the last record of a step wins, as after a resume).

    Raises:
        ValueError: the file does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"expected a metrics file; {path} does not exist")
    losses: dict[int, float] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("loss") is not None and "event" not in record:
            losses[int(record["step"])] = float(record["loss"])
    return dict(sorted(losses.items()))


def plot_loss(metrics: str | Path, out: str | Path, smooth: int = 10) -> Path:
    """Draw the training loss of a `metrics.jsonl` (raw, and a moving average) as a PNG.

    Raises:
        ValueError: the file holds no loss, or matplotlib is missing.
    """
    losses = read_losses(metrics)
    if not losses:
        raise ValueError(f"{metrics} holds no loss values; pass the loss to Monitor.step()")
    plt = _pyplot()
    steps, values = list(losses), list(losses.values())
    window = max(1, min(smooth, len(values)))
    averaged = [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, values, color="#4c72b0", alpha=0.3, linewidth=1, label="loss")
    ax.plot(steps, averaged, color="#4c72b0", linewidth=2, label=f"mean of {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(f"training loss: {values[0]:.3f} at step {steps[0]} -> {values[-1]:.3f}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
