"""What-if: one profile replayed over other links, world sizes, trainable sets and strategies.

Each cell is a `simulate` of the same profile with another cost per bucket: a
ring over N ranks on one link, or the two-phase all-reduce (a ring inside each
node of `GPUS_PER_NODE`, then across the nodes). Scaling efficiency is the step
on one process over the predicted step (weak scaling: the same batch per rank).
LoRA keeps the profiled compute (an upper bound: a frozen base skips its weight
gradients) and gives each adapter its base layer's ready time. ZeRO follows the
planner's volumes: ZeRO-1/2 reduce-scatter in backward (half an all-reduce), run
the optimizer on 1/N of the state and all-gather the weights after it; ZeRO-3
gathers the weights again in forward (hidden up to the forward time) and backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lockstep.plan.comm import Topology, ring_seconds, two_phase_seconds
from lockstep.plan.links import Link
from lockstep.plan.memory import Strategy
from lockstep.plan.profile import ParamTiming, StepProfile
from lockstep.plan.shape import LinearInfo, matches_target
from lockstep.plan.simulate import BucketSeconds, SimStep, simulate

GPUS_PER_NODE = 8
WORLD_SIZES = (2, 4, 8, 16, 64, 256, 1024)


@dataclass(frozen=True)
class Route:
    """How one all-reduce crosses the machines: a ring on one link, or two phases."""

    label: str
    method: str
    intra: Link
    inter: Link | None = None
    max_world: int | None = None  # a link inside one node reaches this many ranks at most

    def bucket_seconds(
        self, world_size: int, fast: bool = False, gpus_per_node: int = GPUS_PER_NODE
    ) -> BucketSeconds | None:
        """The link time of one bucket at `world_size` ranks; None where the route cannot go.

        Args:
            world_size: ranks in the all-reduce.
            fast: the high end of each link's range (else the low end).
            gpus_per_node: ranks per node of a two-phase route.
        """
        if self.max_world is not None and world_size > self.max_world:
            return None
        if self.inter is None:
            bps = self.intra.high_bps if fast else self.intra.low_bps
            return lambda b: ring_seconds(b, world_size, bps, self.intra.hop_latency_s)
        if world_size <= gpus_per_node or world_size % gpus_per_node:
            return None
        topo = Topology(gpus_per_node, world_size // gpus_per_node)
        inter = self.inter
        return lambda b: two_phase_seconds([b], topo, self.intra, inter, fast)


def predict(
    profile: StepProfile,
    layout: Sequence[Sequence[int]],
    cost: BucketSeconds,
    world_size: int,
    slowdown: float = 1.0,
    strategy: Strategy = Strategy.DDP,
) -> SimStep:
    """The step of `profile` under `strategy` at `world_size` ranks with per-bucket `cost`."""
    if strategy is Strategy.DDP:
        return simulate(profile, layout, cost, slowdown)
    half = lambda nbytes: cost(nbytes) / 2  # noqa: E731  reduce-scatter or all-gather: half a ring
    sizes = [sum(profile.params[i].nbytes for i in bucket) for bucket in layout]
    gather_s = sum(half(b) for b in sizes)
    optimizer_s = profile.optimizer_s / world_size
    if strategy is Strategy.ZERO3:
        forward_s = max(profile.forward_s, gather_s)
        sim = simulate(replace(profile, forward_s=forward_s), layout, cost, slowdown)
        return replace(sim, optimizer_s=optimizer_s)
    sim = simulate(profile, layout, half, slowdown)
    return replace(sim, optimizer_s=optimizer_s, tail_s=gather_s)


def efficiency(profile: StepProfile, sim: SimStep) -> float:
    """One process's step over the predicted step at N ranks (1.0: perfect scaling)."""
    return profile.compute_s / sim.step_s


def lora_profile(
    profile: StepProfile, linears: Sequence[LinearInfo], rank: int, targets: Sequence[str]
) -> StepProfile | None:
    """The profile with only LoRA adapters trainable; None when no target matches.

    Each target Linear gets A (rank x in) and B (out x rank), ready when the base
    layer's weight gradient was in the full profile.
    """
    by_name = {p.name: p for p in profile.params}
    params = []
    for lin in linears:
        if not any(matches_target(lin.name, t) for t in targets):
            continue
        base = by_name.get(f"{lin.name}.weight")
        if base is None:
            continue
        adapters = (("lora_A", rank * lin.in_features), ("lora_B", lin.out_features * rank))
        for suffix, numel in adapters:
            params.append(
                ParamTiming(
                    f"{lin.name}.{suffix}", numel, base.element_size, base.dtype, base.ready_s
                )
            )
    if not params or profile.prebucketed:
        return None
    return replace(profile, params=tuple(params), source=profile.source + f", LoRA r={rank}")


def default_routes(named: dict[str, Link], measured: Link | None) -> list[Route]:
    """The routes of the what-if table: every named link, flat and two-phase, and `measured`."""
    nvlink, pcie = named["nvlink"], named["pcie"]
    routes = [
        Route("nvlink", "ring", nvlink, max_world=GPUS_PER_NODE),
        Route("pcie", "ring", pcie, max_world=GPUS_PER_NODE),
    ]
    for name in ("infiniband", "ethernet"):
        routes.append(Route(name, "flat ring", named[name]))
        routes.append(Route(f"nvlink + {name}", "two-phase", nvlink, named[name]))
    if measured is not None:
        routes.append(Route("measured", "ring", measured))
    return routes
