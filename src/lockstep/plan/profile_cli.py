"""The `--profile` flags of `lockstep plan`: where the step profile comes from, and the slowdown.

`--profile pkg.module:factory` (or `--profile-script pkg.module:fn`) profiles a few
steps on this process; `--profile-trace DIR` reads a real run's trace instead.
The slowdown of communication during backward is `--comm-slowdown`, else the one
`lockstep bench allreduce --json` measured (in the `--bandwidth-from` file), else
1.0. `--timeline PNG` draws the predicted step.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from lockstep.plan.memory import parse_optimizer
from lockstep.plan.model_count import count_module
from lockstep.plan.planner import PlanConfig
from lockstep.plan.profile import StepProfile, profile_step
from lockstep.plan.profile_target import (
    SCRIPT_FORM,
    make_optimizer,
    target_from_factory,
    target_from_script,
)
from lockstep.plan.profile_trace import profile_from_trace
from lockstep.plan.shape import LinearInfo
from lockstep.plan.step_plan import Slowdown, StepPlan, make_step_plan

SOURCES = ("profile", "profile_script", "profile_trace")


def add_profile_flags(add: Callable[..., object]) -> None:
    """The flags of the step prediction (see the module docstring)."""
    add(
        "--profile",
        default=None,
        metavar="PKG.MODULE:FACTORY",
        help="profile this model on one process and predict the step at --gpus ranks",
    )
    add("--profile-script", default=None, metavar="PKG.MODULE:FN", help=f"instead: {SCRIPT_FORM}")
    add(
        "--profile-trace",
        default=None,
        metavar="TRACE",
        help="instead: a trace recorded by a real run (LOCKSTEP_TRACE=<dir>)",
    )
    add("--profile-steps", type=int, default=5, help="timed steps of the profile (default 5)")
    add("--seq-len", type=int, default=64, help="tokens per sample for an Embedding (default 64)")
    add(
        "--comm-slowdown",
        type=float,
        default=None,
        help="communication slowdown during backward (default: the bench's, else 1.0)",
    )
    add("--timeline", default=None, metavar="PNG", help="draw the predicted step here")


def wants_profile(ns: argparse.Namespace) -> bool:
    given = [s for s in SOURCES if getattr(ns, s) is not None]
    if len(given) > 1:
        flags = ", ".join("--" + s.replace("_", "-") for s in given)
        raise ValueError(f"give one of --profile, --profile-script, --profile-trace; found {flags}")
    return bool(given)


def check_profile_flags(ns: argparse.Namespace) -> None:
    """Check the profile flags before anything is built or run.

    Raises:
        ValueError: two profile sources, a slowdown below 1, or no profiled step.
    """
    if wants_profile(ns):
        if ns.comm_slowdown is not None:
            Slowdown(ns.comm_slowdown, "--comm-slowdown")
        if ns.profile_steps < 1:
            raise ValueError(f"--profile-steps must be >= 1; found {ns.profile_steps}")


def read_profile(ns: argparse.Namespace) -> tuple[StepProfile, tuple[LinearInfo, ...]]:
    """The step profile the flags ask for, and the model's Linear layers (for LoRA).

    Raises:
        ValueError: a bad flag, a model that cannot be built or run, an unreadable trace.
    """
    if ns.profile_trace is not None:
        return profile_from_trace(ns.profile_trace), ()
    if ns.batch_size < 1 or ns.seq_len < 1:
        raise ValueError(
            f"--batch-size and --seq-len must be >= 1; found {ns.batch_size}, {ns.seq_len}"
        )
    if ns.profile is not None:
        target = target_from_factory(ns.profile, ns.batch_size, ns.seq_len)
    else:
        target = target_from_script(ns.profile_script, ns.batch_size)
    params = [p for p in target.model.parameters() if p.requires_grad]
    devices = {p.device.type for p in params}
    if devices - {"cpu"}:
        raise ValueError(
            f"--profile: {target.label} has parameters on {sorted(devices)}; expected a CPU "
            "model (the profile reads the host clock). For a GPU model, record a run with "
            "LOCKSTEP_TRACE=<dir> and pass --profile-trace <dir>"
        )
    optimizer = make_optimizer(parse_optimizer(ns.optimizer, "--optimizer"), params)
    source = (
        f"{target.label}, batch {ns.batch_size}, {ns.optimizer}, median of "
        f"{ns.profile_steps} steps on {torch.get_num_threads()} thread(s)"
    )
    try:
        profile = profile_step(
            target.model, target.run_step, optimizer, steps=ns.profile_steps, source=source
        )
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"--profile: a training step of {target.label} failed ({type(error).__name__}: "
            f"{error}); give --profile-script {SCRIPT_FORM}"
        ) from None
    return profile, count_module(target.model, target.label).linears


def read_slowdown(ns: argparse.Namespace) -> Slowdown:
    """--comm-slowdown, else the bench's measurement in --bandwidth-from, else 1.0."""
    if ns.comm_slowdown is not None:
        return Slowdown(ns.comm_slowdown, "given by --comm-slowdown")
    if ns.bandwidth_from:
        with open(ns.bandwidth_from) as fp:  # read_measured already checked the file
            measured = json.load(fp).get("overlap_slowdown")
        if isinstance(measured, dict) and measured.get("factor", 0) >= 1.0:
            return Slowdown(float(measured["factor"]), f"measured, {ns.bandwidth_from}")
    return Slowdown(1.0, "not measured: communication assumed on its own hardware, as on GPUs")


def step_plan_from_flags(ns: argparse.Namespace, cfg: PlanConfig) -> StepPlan | None:
    """The step plan, or None when no profile was asked for."""
    if not wants_profile(ns):
        return None
    slowdown = read_slowdown(ns)
    profile, linears = read_profile(ns)
    targets = [t.strip() for t in ns.lora_targets.split(",") if t.strip()]
    return make_step_plan(cfg, profile, slowdown, linears, (ns.lora_rank or 8, targets))
