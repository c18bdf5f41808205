"""Print a `StepPlan`: the predicted step, the critical bucket, the what-if tables; or JSON.

Times print with their unit (format_seconds); in the JSON they are seconds (`_s`),
sizes bytes, shares fractions in [0, 1]. The what-if tables quote each named
link at the low end of its range (the JSON carries the same cells).
"""

from __future__ import annotations

from typing import Any

from lockstep.plan.simulate import SimStep
from lockstep.plan.step_plan import Cell, StepPlan
from lockstep.plan.units import format_bytes, format_rate, format_seconds
from lockstep.plan.whatif import WORLD_SIZES


def _critical(sim: SimStep) -> str:
    k = sim.critical_bucket
    if k is None:
        return "backward: every all-reduce is done when backward ends (nothing exposed)"
    b = sim.buckets[k]
    later = len(sim.buckets) - 1 - k
    chain = (
        f"it and the {later} bucket(s) after it run back to back and end"
        if later
        else ("its all-reduce ends")
    )
    return (
        f"bucket {k} ({format_bytes(b.nbytes)}, ready at {format_seconds(b.ready)}): {chain} "
        f"{format_seconds(sim.exposed_s)} after backward"
    )


def _prediction(plan: StepPlan) -> list[str]:
    p, sim, route = plan.profile, plan.sim, plan.route
    links = " + ".join(
        f"{link.name} {format_rate(link.low_bps)}, {format_seconds(link.hop_latency_s)}/hop"
        for link in (route.intra, route.inter)
        if link is not None
    )
    sizes = ", ".join(format_bytes(b.nbytes) for b in sim.buckets[:6])
    more = f" (+{len(sim.buckets) - 6} more)" if len(sim.buckets) > 6 else ""
    eff = p.compute_s / sim.step_s
    return [
        "",
        f"step prediction (profile: {p.source})",
        f"  one process    forward {format_seconds(p.forward_s)} + backward "
        f"{format_seconds(p.backward_s)} + optimizer {format_seconds(p.optimizer_s)} = "
        f"{format_seconds(p.compute_s)}",
        f"  route          {route.method} over {plan.world_size} ranks: {links}",
        f"  slowdown       communication during backward x{plan.slowdown.factor:.2f} "
        f"({plan.slowdown.source})",
        f"  buckets        {len(sim.buckets)}, launch order: {sizes}{more}",
        f"  step           {format_seconds(sim.step_s)} at N = {plan.world_size} "
        f"(scaling efficiency {100 * eff:.0f}%)",
        f"  communication  {format_seconds(sim.comm_s)} on the link, "
        f"{format_seconds(sim.exposed_s)} exposed, overlap {100 * sim.overlap:.0f}%",
        f"  critical path  {_critical(sim)}",
    ]


def _cell(cell: Cell | None) -> str:
    if cell is None or cell.sim is None or cell.efficiency is None:
        return "-"
    return f"{format_seconds(cell.sim.step_s)} {100 * cell.efficiency:.0f}%"


def _scaling(plan: StepPlan) -> list[str]:
    lines = [
        "",
        "what-if: step time (scaling efficiency) at N ranks, DDP; two-phase: 8 GPUs per node; "
        "named links at the low end of their range",
        f"  {'link':<22}{'method':<11}" + "".join(f"{'N=' + str(n):>15}" for n in WORLD_SIZES),
    ]
    rows: dict[str, dict[str, Cell]] = {}
    for cell in plan.scaling:
        rows.setdefault(cell.row, {})[cell.column] = cell
    for row, cells in rows.items():
        label, method = row.split("|")
        values = "".join(f"{_cell(cells.get(f'N={n}')):>15}" for n in WORLD_SIZES)
        lines.append(f"  {label:<22}{method:<11}{values}")
    return lines


def _strategies(plan: StepPlan) -> list[str]:
    columns = list(dict.fromkeys(c.column for c in plan.strategies))
    lines = [
        "",
        f"what-if: full fine-tune against LoRA, DDP against ZeRO, at N = {plan.strategy_world} "
        "(step time, efficiency against one process's full step)",
        f"  {'':<30}" + "".join(f"{c:>22}" for c in columns),
    ]
    rows: dict[str, dict[str, Cell]] = {}
    for cell in plan.strategies:
        rows.setdefault(cell.row, {})[cell.column] = cell
    for row, cells in rows.items():
        lines.append(f"  {row:<30}" + "".join(f"{_cell(cells.get(c)):>22}" for c in columns))
    return [*lines, *(f"  note: {n}" for n in plan.notes)]


def format_step_plan(plan: StepPlan) -> str:
    """The prediction and the what-if tables, as `lockstep plan --profile` prints them."""
    return "\n".join([*_prediction(plan), *_scaling(plan), *_strategies(plan)])


def sim_json(sim: SimStep) -> dict[str, Any]:
    """One predicted step: phases, exposed and link time, overlap, and every bucket."""
    buckets = [
        {
            "index": b.index,
            "bytes": b.nbytes,
            "params": len(b.params),
            "ready_s": b.ready,
            "launched_s": b.launched,
            "started_s": b.started,
            "done_s": b.done,
        }
        for b in sim.buckets
    ]
    return {
        "step_s": sim.step_s,
        "forward_s": sim.forward_s,
        "backward_s": sim.backward_s,
        "optimizer_s": sim.optimizer_s,
        "exposed_s": sim.exposed_s,
        "after_optimizer_s": sim.tail_s,
        "comm_s": sim.comm_s,
        "overlap": sim.overlap,
        "critical_bucket": sim.critical_bucket,
        "slowdown": sim.slowdown,
        "buckets": buckets,
    }


def _cells_json(cells: list[Cell]) -> list[dict[str, Any]]:
    return [
        {
            "row": c.row,
            "column": c.column,
            "step_s": c.sim.step_s,
            "efficiency": c.efficiency,
            "exposed_s": c.sim.exposed_s,
            "overlap": c.sim.overlap,
        }
        for c in cells
        if c.sim is not None
    ]


def step_plan_json(plan: StepPlan) -> dict[str, Any]:
    """The step plan as a JSON-ready dict (seconds, bytes, fractions)."""
    p = plan.profile
    return {
        "profile": {
            "source": p.source,
            "forward_s": p.forward_s,
            "backward_s": p.backward_s,
            "optimizer_s": p.optimizer_s,
            "params": len(p.params),
            "payload_bytes": p.payload_bytes,
            "prebucketed": p.prebucketed,
        },
        "route": {"label": plan.route.label, "method": plan.route.method},
        "world_size": plan.world_size,
        "slowdown": {"factor": plan.slowdown.factor, "source": plan.slowdown.source},
        "prediction": sim_json(plan.sim),
        "efficiency": p.compute_s / plan.sim.step_s,
        "scaling": _cells_json(plan.scaling),
        "strategies": {"world_size": plan.strategy_world, "cells": _cells_json(plan.strategies)},
        "notes": plan.notes,
    }
