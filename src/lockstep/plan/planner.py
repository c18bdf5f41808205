"""The plan: from one validated `PlanConfig` to memory per GPU, payload, all-reduce time, batch.

This is the pure core of `lockstep plan`: no argument parsing, no printing. It
combines the memory accounting (memory.py), the all-reduce cost model (comm.py)
and the links (links.py) into a `Plan` that report.py prints as a table or JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep.plan.comm import (
    BUCKET_BYTES,
    Topology,
    bucket_sizes,
    ring_factor,
    step_seconds,
    two_phase_seconds,
)
from lockstep.plan.links import NAMED_LINKS, Link
from lockstep.plan.memory import (
    Optimizer,
    StateBytes,
    Strategy,
    per_gpu_bytes,
    replicated_bytes,
)
from lockstep.plan.policy_memory import gathered_bytes, with_policy
from lockstep.plan.shape import ModelShape, Trainable
from lockstep.plan.units import DType


@dataclass(frozen=True)
class PlanConfig:
    """Everything the planner is asked about. Validated on construction.

    Attributes:
        model: the counted model.
        trainable: which parameters train (full, LoRA, or a count).
        gpus: data-parallel GPUs in total.
        nodes: nodes they sit on (gpus must divide evenly).
        gpu_memory_bytes: memory of one GPU.
        weights_dtype: storage type of the weights.
        grads_dtype: type of the gradients, hence of the all-reduce payload; None: the
            weights' type.
        optimizer: optimizer, by the state it keeps (plus an fp32 master copy of the
            weights when they are fp16 or bf16).
        optimizer_dtype: type of its state tensors.
        optimizer_bytes: override of the optimizer bytes per trainable parameter.
        batch_size: samples per GPU per micro-step.
        grad_accum: micro-steps per optimizer step.
        links: links inside a node (or of the single node's ring).
        inter_links: links between nodes (multi-node only).
        measured: a measured all-reduce, from `lockstep bench allreduce --json`.
        bucket_cap_bytes: the DDP bucket cap.
        param_dtype: FSDP2's mixed-precision policy: the compute dtype of the sharded
            engine, whose shards keep `weights_dtype` (`policy_memory.py`); None: none.
        reduce_dtype: the policy's gradient reduce dtype (the payload); None: param_dtype.
        kept_params: ZeRO-3: parameters gathered from forward to backward (the root unit
            and the units with reshard_after_forward=False).
    """

    model: ModelShape
    trainable: Trainable
    gpus: int
    nodes: int = 1
    gpu_memory_bytes: int = 80 * 10**9
    weights_dtype: DType = DType.BF16
    grads_dtype: DType | None = None
    optimizer: Optimizer = Optimizer.ADAM
    optimizer_dtype: DType = DType.FP32
    optimizer_bytes: float | None = None
    batch_size: int = 1
    grad_accum: int = 1
    links: tuple[Link, ...] = ()
    inter_links: tuple[Link, ...] = ()
    measured: Link | None = None
    bucket_cap_bytes: int = BUCKET_BYTES
    param_dtype: DType | None = None
    reduce_dtype: DType | None = None
    kept_params: int = 0

    def __post_init__(self) -> None:
        if self.grads_dtype is None:  # under a policy the payload is the reduce dtype
            payload = self.reduce_dtype or self.param_dtype or self.weights_dtype
            object.__setattr__(self, "grads_dtype", payload)
        for name in ("gpus", "nodes", "batch_size", "grad_accum", "gpu_memory_bytes"):
            value = getattr(self, name)
            if value < 1:
                flag = "--" + name.replace("_", "-").replace("-bytes", "")
                raise ValueError(f"{flag} must be positive; found {value}")
        if self.gpus % self.nodes:
            raise ValueError(
                f"--gpus must be a multiple of --nodes (the same GPUs on every node); "
                f"found --gpus {self.gpus} --nodes {self.nodes}"
            )
        if self.inter_links and self.nodes == 1:
            raise ValueError("--inter-link applies between nodes; give --nodes 2 or more")
        if self.optimizer_bytes is not None and self.optimizer_bytes < 0:
            raise ValueError(f"--optimizer-bytes must be >= 0; found {self.optimizer_bytes}")

    @property
    def topology(self) -> Topology:
        return Topology(self.gpus // self.nodes, self.nodes)

    @property
    def optimizer_bytes_per_param(self) -> float:
        if self.optimizer_bytes is not None:
            return self.optimizer_bytes
        return self.optimizer.bytes_per_param(self.optimizer_dtype, self.master_copy)

    @property
    def master_copy(self) -> bool:
        """Mixed precision: weights narrower than fp32 come with an fp32 master copy."""
        return self.weights_dtype.nbytes < DType.FP32.nbytes


@dataclass(frozen=True)
class MemoryRow:
    """One strategy's per-GPU model states and whether they fit."""

    strategy: Strategy
    bytes: StateBytes
    fits: bool


@dataclass(frozen=True)
class CommRow:
    """One estimate of the step's all-reduce time: on a link, or two links in two phases."""

    label: str
    method: str
    seconds_fast: float
    seconds_slow: float
    links: tuple[Link, ...]


@dataclass(frozen=True)
class Plan:
    """The planner's answer."""

    config: PlanConfig
    memory: list[MemoryRow]
    payload_bytes: int
    buckets: list[int]
    sent_per_gpu_bytes: float
    comm: list[CommRow] = field(default_factory=list)
    gathered_bytes: int = 0  # ZeRO-3, between forward and backward, on top of its row

    @property
    def effective_batch(self) -> int:
        return self.config.batch_size * self.config.gpus * self.config.grad_accum


def memory_rows(cfg: PlanConfig) -> list[MemoryRow]:
    """Per-GPU model states under each strategy, and whether they fit in the GPU."""
    full = replicated_bytes(
        cfg.model.total_params + cfg.trainable.added_params,
        cfg.trainable.count,
        cfg.weights_dtype.nbytes,
        cfg.grads_dtype.nbytes,
        cfg.optimizer_bytes_per_param,
    )
    rows = []
    for strategy in Strategy:
        share = per_gpu_bytes(full, strategy, cfg.gpus)
        total, trainable = cfg.model.total_params + cfg.trainable.added_params, cfg.trainable.count
        share = with_policy(
            share,
            strategy,
            total,
            trainable,
            cfg.weights_dtype,
            cfg.param_dtype,
            cfg.reduce_dtype,
            cfg.gpus,
        )
        rows.append(MemoryRow(strategy, share, share.total <= cfg.gpu_memory_bytes))
    return rows


def comm_rows(cfg: PlanConfig, buckets: list[int]) -> list[CommRow]:
    """All-reduce time per step on each link asked for (or the default ones)."""
    topo = cfg.topology
    rows = []
    if topo.nodes == 1:
        for link in cfg.links or tuple(NAMED_LINKS[n] for n in ("nvlink", "pcie")):
            rows.append(_ring_row(link.name, buckets, topo.world_size, link))
    else:
        intra_links = cfg.links or (NAMED_LINKS["nvlink"],)
        inter_links = cfg.inter_links or tuple(NAMED_LINKS[n] for n in ("infiniband", "ethernet"))
        for inter in inter_links:
            for intra in intra_links:
                fast = two_phase_seconds(buckets, topo, intra, inter, fast=True)
                slow = two_phase_seconds(buckets, topo, intra, inter, fast=False)
                label = f"{intra.name} + {inter.name}"
                rows.append(CommRow(label, "two-phase", fast, slow, (intra, inter)))
            rows.append(_ring_row(inter.name, buckets, topo.world_size, inter, "flat ring"))
    if cfg.measured is not None:
        rows.append(_ring_row("measured", buckets, topo.world_size, cfg.measured))
    return rows


def _ring_row(label: str, buckets: list[int], world: int, link: Link, method="ring") -> CommRow:
    fast = step_seconds(buckets, world, link, fast=True)
    slow = step_seconds(buckets, world, link, fast=False)
    return CommRow(label, method, fast, slow, (link,))


def make_plan(cfg: PlanConfig) -> Plan:
    """Work out memory, payload, buckets and all-reduce time for `cfg`."""
    grad_bytes = cfg.grads_dtype.nbytes
    numels = cfg.trainable.numels
    param_bytes = None if numels is None else [n * grad_bytes for n in numels]
    payload = cfg.trainable.count * grad_bytes
    buckets = bucket_sizes(param_bytes, payload, cfg.bucket_cap_bytes)
    return Plan(
        config=cfg,
        memory=memory_rows(cfg),
        payload_bytes=payload,
        buckets=buckets,
        sent_per_gpu_bytes=ring_factor(cfg.gpus) * payload,
        comm=comm_rows(cfg, buckets),
        gathered_bytes=gathered_bytes(cfg.kept_params, cfg.weights_dtype, cfg.param_dtype),
    )
