"""The HSDP section of `lockstep plan`: memory and bytes per link beside DDP and ZeRO.

Printed for a multi-node layout, after the all-reduce table: per-GPU model states
of HSDP-2 and HSDP-3 (sharded over the G GPUs of a node), then, for DDP, ZeRO-2,
ZeRO-3 and HSDP, the bytes each GPU sends per step, the bytes each node sends
across nodes and what that takes on each inter-node link (`plan/hybrid.py`).
"""

from __future__ import annotations

from typing import Any

from lockstep.plan.hybrid import LinkBytes, hybrid_memory, link_bytes
from lockstep.plan.links import NAMED_LINKS, Link
from lockstep.plan.memory import StateBytes
from lockstep.plan.planner import Plan
from lockstep.plan.units import format_bytes, format_seconds


def _inter_links(plan: Plan) -> tuple[Link, ...]:
    return plan.config.inter_links or tuple(NAMED_LINKS[n] for n in ("infiniband", "ethernet"))


def plan_link_bytes(plan: Plan) -> list[LinkBytes]:
    """The per-link bytes of the plan's model and layout."""
    cfg, topo = plan.config, plan.config.topology
    weight = cfg.weights_dtype.nbytes
    trainable = cfg.trainable.count * weight
    every = (cfg.model.total_params + cfg.trainable.added_params) * weight
    return link_bytes(topo.gpus_per_node, topo.nodes, plan.payload_bytes, trainable, every)


def plan_hybrid_memory(plan: Plan) -> dict[int, StateBytes]:
    """HSDP-2 and HSDP-3 states per GPU (the DDP row, sharded over a node)."""
    full = plan.memory[0].bytes  # DDP: everything replicated
    return {
        stage: hybrid_memory(full, stage, plan.config.topology.gpus_per_node) for stage in (2, 3)
    }


def _across(nbytes: float, link: Link) -> str:
    fast, slow = nbytes / link.high_bps, nbytes / link.low_bps
    if fast == slow:
        return format_seconds(fast)
    return f"{format_seconds(fast)} - {format_seconds(slow)}"


def hybrid_section(plan: Plan) -> list[str]:
    """The HSDP lines of the table; none for one node."""
    cfg, topo = plan.config, plan.config.topology
    if topo.nodes < 2:
        return []
    limit = cfg.gpu_memory_bytes
    lines = [
        "",
        f"HSDP: shard within a node (G = {topo.gpus_per_node}), replicate across nodes "
        f"(M = {topo.nodes}): ShardedDataParallel(model, stage=2 or 3, hybrid=True)",
        f"  {'memory per GPU':<15}{'weights':>11}{'gradients':>11}{'optimizer':>11}{'total':>11}"
        f"   fits in {format_bytes(limit)}",
    ]
    for stage, b in plan_hybrid_memory(plan).items():
        cells = "".join(f"{format_bytes(x):>11}" for x in (b.weights, b.grads, b.optimizer))
        fits = "yes" if b.total <= limit else "no"
        lines.append(f"  {f'HSDP-{stage}':<15}{cells}{format_bytes(b.total):>11}   {fits}")
    links = _inter_links(plan)
    head = "".join(f"{'time across, ' + link.name:<26}" for link in links).rstrip()
    lines.append(f"  {'sent per step':<15}{'each GPU':>11}{'each node across':>18}   {head}")
    for row in plan_link_bytes(plan):
        times = "".join(f"{_across(row.across_per_node, link):<26}" for link in links)
        line = f"  {row.label:<15}{format_bytes(row.per_gpu):>11}"
        lines.append(f"{line}{format_bytes(row.across_per_node):>18}   {times}".rstrip())
    return lines


def hybrid_json(plan: Plan) -> dict[str, Any]:
    """The HSDP figures for `--json`: memory per GPU and bytes per link, in bytes."""
    if plan.config.topology.nodes < 2:
        return {}
    memory = {
        f"hsdp{stage}": {
            "weights_bytes": b.weights,
            "grads_bytes": b.grads,
            "optimizer_bytes": b.optimizer,
            "total_bytes": b.total,
            "fits": b.total <= plan.config.gpu_memory_bytes,
        }
        for stage, b in plan_hybrid_memory(plan).items()
    }
    links = [
        {
            "label": row.label,
            "per_gpu_bytes": row.per_gpu,
            "across_per_node_bytes": row.across_per_node,
        }
        for row in plan_link_bytes(plan)
    ]
    return {"memory": memory, "link_bytes": links}
