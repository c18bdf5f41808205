"""The step prediction of `lockstep plan --profile`: one profile, a link, a slowdown, the tables.

`make_step_plan` joins the pieces: the engine's buckets for the profile
(simulate.engine_buckets), the predicted step at the planned world size on the
planned route, and the what-if tables (whatif.py): step time per route and rank
count, and per trainable set and strategy. step_report.py prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lockstep.plan.links import NAMED_LINKS
from lockstep.plan.memory import Strategy
from lockstep.plan.planner import PlanConfig
from lockstep.plan.profile import StepProfile
from lockstep.plan.shape import LinearInfo
from lockstep.plan.simulate import SimStep, engine_buckets
from lockstep.plan.whatif import (
    GPUS_PER_NODE,
    WORLD_SIZES,
    Route,
    default_routes,
    lora_profile,
    predict,
)

FIRST_CAP_BYTES = 1 * 2**20


@dataclass(frozen=True)
class Slowdown:
    """The factor for communication during backward, and where it comes from."""

    factor: float
    source: str

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(
                f"--comm-slowdown must be >= 1.0 (1.0: communication has its own hardware); "
                f"found {self.factor}"
            )


@dataclass(frozen=True)
class Cell:
    """One what-if prediction."""

    row: str
    column: str
    sim: SimStep | None  # None: the route cannot reach that many ranks
    efficiency: float | None


@dataclass(frozen=True)
class StepPlan:
    """The answer of `lockstep plan --profile`."""

    profile: StepProfile
    layout: list[list[int]]
    route: Route
    world_size: int
    slowdown: Slowdown
    sim: SimStep
    scaling: list[Cell]
    strategies: list[Cell]
    strategy_world: int
    notes: list[str]


def main_route(cfg: PlanConfig) -> Route:
    """The route of the main prediction: measured, else two-phase across nodes, else a ring."""
    if cfg.measured is not None:
        return Route("measured", "ring", cfg.measured)
    intra = cfg.links[0] if cfg.links else NAMED_LINKS["nvlink"]
    if cfg.nodes > 1:
        inter = cfg.inter_links[0] if cfg.inter_links else NAMED_LINKS["infiniband"]
        return Route(f"{intra.name} + {inter.name}", "two-phase", intra, inter)
    return Route(intra.name, "ring", intra)


def _main_sim(cfg: PlanConfig, profile: StepProfile, layout, route: Route, slow: float) -> SimStep:
    cost = route.bucket_seconds(cfg.gpus, gpus_per_node=cfg.topology.gpus_per_node)
    if cost is None:  # one rank: nothing crosses a link
        return predict(profile, layout, lambda _: 0.0, cfg.gpus, slow)
    return predict(profile, layout, cost, cfg.gpus, slow)


def scaling_cells(profile: StepProfile, layout, routes: list[Route], slow: float) -> list[Cell]:
    cells = []
    for route in routes:
        for n in WORLD_SIZES:
            cost = route.bucket_seconds(n)
            sim = None if cost is None else predict(profile, layout, cost, n, slow)
            eff = None if sim is None else profile.compute_s / sim.step_s
            cells.append(Cell(f"{route.label}|{route.method}", f"N={n}", sim, eff))
    return cells


def strategy_cells(
    profile: StepProfile,
    lora: tuple[str, StepProfile] | None,
    world: int,
    routes: list[Route],
    slow: float,
    bucket_cap: int,
) -> list[Cell]:
    """DDP full fine-tune, DDP LoRA (when given), ZeRO-1/2 and ZeRO-3 on each route."""
    rows = [("DDP, full fine-tune", profile, Strategy.DDP)]
    if lora is not None:
        rows.append((f"DDP, {lora[0]}", lora[1], Strategy.DDP))
    rows.append(("ZeRO-1/2, full fine-tune", profile, Strategy.ZERO2))
    rows.append(("ZeRO-3, full fine-tune", profile, Strategy.ZERO3))
    cells = []
    for label, prof, strategy in rows:
        layout = engine_buckets(prof, FIRST_CAP_BYTES, bucket_cap)
        for route in routes:
            cost = route.bucket_seconds(world)
            if cost is not None:
                sim = predict(prof, layout, cost, world, slow, strategy)
                cells.append(Cell(label, route.label, sim, profile.compute_s / sim.step_s))
    return cells


def _notes(
    cfg: PlanConfig, profile: StepProfile, lora_found: bool, targets: list[str]
) -> list[str]:
    """What the reader of the tables should know: a missing LoRA row, a dtype mismatch."""
    notes = []
    if not lora_found:
        notes.append(
            f"no LoRA row: targets {','.join(targets)} match no profiled Linear weight "
            "(set --lora-targets; a trace profile has buckets, not layers)"
        )
    planned = cfg.trainable.count * cfg.grads_dtype.nbytes
    if profile.payload_bytes != planned and not profile.prebucketed:
        notes.append(
            f"the step moves the profiled gradients ({profile.payload_bytes} bytes); the plan "
            f"above assumes {planned} ({cfg.grads_dtype.label}): match --weights-dtype to the model"
        )
    return notes


def make_step_plan(
    cfg: PlanConfig,
    profile: StepProfile,
    slowdown: Slowdown,
    linears: tuple[LinearInfo, ...],
    lora: tuple[int, list[str]] = (8, ["q_proj", "v_proj"]),
) -> StepPlan:
    """Predict the step of `profile` for `cfg`, and the what-if tables.

    Args:
        cfg: the validated plan (world size, nodes, links, measured link, bucket cap).
        profile: the profiled (or traced) step.
        slowdown: communication slowdown during backward.
        linears: the model's Linear layers, for the LoRA row.
        lora: (rank, targets) of the LoRA row.
    """
    layout = engine_buckets(profile, FIRST_CAP_BYTES, cfg.bucket_cap_bytes)
    route = main_route(cfg)
    sim = _main_sim(cfg, profile, layout, route, slowdown.factor)
    routes = default_routes(NAMED_LINKS, cfg.measured)
    rank, targets = lora
    lora_prof = lora_profile(profile, linears, rank, targets)
    lora_row = None if lora_prof is None else (f"LoRA r={rank}", lora_prof)
    world = cfg.gpus if cfg.gpus > 1 else GPUS_PER_NODE
    world_routes = [r for r in routes if r.bucket_seconds(world) is not None]
    return StepPlan(
        profile=profile,
        layout=layout,
        route=route,
        world_size=cfg.gpus,
        slowdown=slowdown,
        sim=sim,
        scaling=scaling_cells(profile, layout, routes, slowdown.factor),
        strategies=strategy_cells(
            profile, lora_row, world, world_routes, slowdown.factor, cfg.bucket_cap_bytes
        ),
        strategy_world=world,
        notes=_notes(cfg, profile, lora_prof is not None, targets),
    )
