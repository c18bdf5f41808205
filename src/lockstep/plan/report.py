"""Print a `Plan` as the table people read, or as JSON that scripts read.

Every figure carries its unit. In the table, GB and MB are decimal (1e9 and 1e6
bytes) like the memory and link figures they are compared with; in the JSON,
sizes are integer or float bytes, times seconds and bandwidths bytes per second,
and the key names say so (`_bytes`, `_s`, `_bps`).
"""

from __future__ import annotations

from typing import Any

from lockstep.plan.comm import ring_factor
from lockstep.plan.hybrid_report import hybrid_json, hybrid_section
from lockstep.plan.links import Link
from lockstep.plan.planner import CommRow, Plan
from lockstep.plan.units import format_bytes, format_count, format_rate, format_seconds

NOTE_MEMORY = "model states only: activations, temporary buffers and allocator slack come on top"


def _bandwidth(link: Link) -> str:
    text = format_rate(link.low_bps)
    if link.is_range:
        text = f"{text} - {format_rate(link.high_bps)}"
    if link.name == "measured":
        text += f", {format_seconds(link.hop_latency_s)}/hop"
    return text


def _time(row: CommRow) -> str:
    if row.seconds_fast == row.seconds_slow:
        return format_seconds(row.seconds_fast)
    return f"{format_seconds(row.seconds_fast)} - {format_seconds(row.seconds_slow)}"


def _header(plan: Plan) -> list[str]:
    cfg, model = plan.config, plan.config.model
    total = model.total_params + cfg.trainable.added_params
    share = 100 * cfg.trainable.count / total
    topo, w, g = cfg.topology, cfg.weights_dtype, cfg.grads_dtype
    return [
        "lockstep plan (GB = 1e9 bytes, MB = 1e6 bytes, MiB = 2**20 bytes)",
        f"model      {model.label} ({model.kind}): {format_count(total)} parameters; "
        f"{cfg.trainable.description}: {format_count(cfg.trainable.count)} trainable "
        f"({share:.3g}%)",
        f"layout     {cfg.gpus} GPUs = {topo.gpus_per_node} per node x {topo.nodes} node(s), "
        f"{format_bytes(cfg.gpu_memory_bytes)} each",
        f"bytes      per parameter: weights {w.nbytes} ({w.label}), "
        f"gradients {g.nbytes} ({g.label}), "
        f"optimizer {cfg.optimizer_bytes_per_param:g} ({_optimizer_label(plan)})",
        *_policy_line(cfg),
    ]


def _policy_line(cfg: Any) -> list[str]:
    if cfg.param_dtype is None:
        return []
    reduce = cfg.reduce_dtype or cfg.param_dtype
    return [
        f"policy     compute {cfg.param_dtype.label}, reduce {reduce.label} (FSDP2's "
        f"MixedPrecisionPolicy); the {cfg.weights_dtype.label} shards are the master weights"
    ]


def _optimizer_label(plan: Plan) -> str:
    cfg = plan.config
    if cfg.optimizer_bytes is not None:
        return "given"
    opt = cfg.optimizer
    master = " + fp32 master weights" if cfg.master_copy else ""
    return f"{opt.label}: {opt.states} {cfg.optimizer_dtype.label} state(s){master}"


def _memory_table(plan: Plan) -> list[str]:
    limit = format_bytes(plan.config.gpu_memory_bytes)
    lines = [
        "",
        f"memory per GPU ({NOTE_MEMORY})",
        f"  {'strategy':<15}{'weights':>11}{'gradients':>11}{'optimizer':>11}{'total':>11}"
        f"   fits in {limit}",
    ]
    for row in plan.memory:
        b = row.bytes
        cells = "".join(f"{format_bytes(x):>11}" for x in (b.weights, b.grads, b.optimizer))
        fits = "yes" if row.fits else "no"
        lines.append(f"  {row.strategy.label:<15}{cells}{format_bytes(b.total):>11}   {fits}")
    if plan.gathered_bytes:
        lines.append(
            f"  ZeRO-3 between forward and backward: + {format_bytes(plan.gathered_bytes)} of "
            "units kept gathered (root, reshard_after_forward=False)"
        )
    return [*lines, *_sharding_advice(plan)]


def _sharding_advice(plan: Plan) -> list[str]:
    """Where DDP does not fit: the first ShardedDataParallel stage that does."""
    rows = plan.memory
    if not rows or rows[0].fits:
        return []
    stage = next((i for i, row in enumerate(rows) if row.fits), None)
    if stage is None:
        return ["  advice: no strategy fits; add GPUs, or train fewer parameters (--lora-rank)"]
    return [
        f"  advice: DDP does not fit; lockstep.ShardedDataParallel(model, stage={stage}) "
        f"({rows[stage].strategy.label}) does; see docs/sharding.md"
    ]


def _comm_table(plan: Plan) -> list[str]:
    cfg, topo = plan.config, plan.config.topology
    bucket_cap = cfg.bucket_cap_bytes / 2**20
    lines = [
        "",
        "gradient all-reduce per step",
        f"  payload  {format_bytes(plan.payload_bytes)} = "
        f"{format_count(cfg.trainable.count)} trainable x {cfg.grads_dtype.nbytes} B "
        f"({cfg.grads_dtype.label}), in {len(plan.buckets)} bucket(s) of up to "
        f"{bucket_cap:g} MiB",
    ]
    if cfg.gpus == 1:
        return [*lines, "  one GPU: nothing to all-reduce"]
    lines.append(
        f"  ring     each GPU sends 2(N-1)/N x payload = "
        f"{format_bytes(plan.sent_per_gpu_bytes)} per step (N = {cfg.gpus})"
    )
    if topo.nodes > 1:
        across = ring_factor(topo.nodes) * plan.payload_bytes
        lines.append(
            f"  2-phase  each node sends 2(M-1)/M x payload = {format_bytes(across)} "
            f"across nodes (M = {topo.nodes}), after a ring inside the node "
            f"(G = {topo.gpus_per_node})"
        )
    lines.append(f"  {'link':<22}{'method':<11}{'time per step':<23}bandwidth")
    for row in plan.comm:
        bw = " + ".join(_bandwidth(link) for link in row.links)
        lines.append(f"  {row.label:<22}{row.method:<11}{_time(row):<23}{bw}")
    return lines


def format_table(plan: Plan) -> str:
    """The plan as the text table `lockstep plan` prints."""
    cfg = plan.config
    batch = (
        f"effective batch  {cfg.batch_size} per GPU x {cfg.gpus} GPUs x {cfg.grad_accum} "
        f"accumulation step(s) = {plan.effective_batch}"
    )
    lines = [*_header(plan), *_memory_table(plan), *_comm_table(plan), *hybrid_section(plan)]
    lines += ["", batch]
    return "\n".join(lines)


def _link_json(link: Link) -> dict[str, Any]:
    return {
        "name": link.name,
        "low_bps": link.low_bps,
        "high_bps": link.high_bps,
        "hop_latency_s": link.hop_latency_s,
        "note": link.note,
    }


def _memory_json(plan: Plan) -> dict[str, Any]:
    return {
        row.strategy.value: {
            "weights_bytes": row.bytes.weights,
            "grads_bytes": row.bytes.grads,
            "optimizer_bytes": row.bytes.optimizer,
            "total_bytes": row.bytes.total,
            "fits": row.fits,
        }
        for row in plan.memory
    }


def _allreduce_json(plan: Plan) -> list[dict[str, Any]]:
    return [
        {
            "label": row.label,
            "method": row.method,
            "seconds_fast": row.seconds_fast,
            "seconds_slow": row.seconds_slow,
            "links": [_link_json(link) for link in row.links],
        }
        for row in plan.comm
    ]


def _policy_json(cfg: Any) -> dict[str, Any] | None:
    if cfg.param_dtype is None and cfg.reduce_dtype is None:
        return None
    label = lambda d: d.label if d is not None else None  # noqa: E731
    return {"param": label(cfg.param_dtype), "reduce": label(cfg.reduce_dtype)}


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-ready dict; sizes in bytes, times in seconds, rates in bytes/s."""
    cfg, topo = plan.config, plan.config.topology
    return {
        "model": {
            "label": cfg.model.label,
            "kind": cfg.model.kind,
            "total_params": cfg.model.total_params + cfg.trainable.added_params,
            "trainable_params": cfg.trainable.count,
            "added_params": cfg.trainable.added_params,
            "trainable": cfg.trainable.description,
        },
        "gpus": cfg.gpus,
        "nodes": topo.nodes,
        "gpus_per_node": topo.gpus_per_node,
        "gpu_memory_bytes": cfg.gpu_memory_bytes,
        "bytes_per_param": {
            "weights": cfg.weights_dtype.nbytes,
            "grads": cfg.grads_dtype.nbytes,
            "optimizer": cfg.optimizer_bytes_per_param,
        },
        "dtypes": {"weights": cfg.weights_dtype.label, "grads": cfg.grads_dtype.label},
        "policy": _policy_json(cfg),
        "gathered_bytes": plan.gathered_bytes,
        "optimizer": _optimizer_label(plan),
        "memory": _memory_json(plan),
        "payload_bytes": plan.payload_bytes,
        "bucket_count": len(plan.buckets),
        "bucket_cap_bytes": cfg.bucket_cap_bytes,
        "sent_per_gpu_bytes": plan.sent_per_gpu_bytes,
        "allreduce": _allreduce_json(plan),
        **({"hsdp": hybrid_json(plan)} if cfg.nodes > 1 else {}),
        "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "effective_batch_size": plan.effective_batch,
    }
