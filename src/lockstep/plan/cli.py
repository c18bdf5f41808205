"""`lockstep plan`: the subcommand's flags, turned into a `PlanConfig`, planned and printed.

Every flag is parsed by the unit parsers, so a bad value fails with one line that
names the flag and the accepted forms (exit code 2, through `lockstep.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lockstep.plan.comm import BUCKET_BYTES
from lockstep.plan.links import LINK_FORMS, parse_link, read_measured
from lockstep.plan.memory import Optimizer, parse_optimizer
from lockstep.plan.model_count import MODEL_FORMS, resolve_model
from lockstep.plan.planner import PlanConfig, make_plan
from lockstep.plan.profile_cli import add_profile_flags, check_profile_flags, step_plan_from_flags
from lockstep.plan.report import format_table, to_json
from lockstep.plan.shape import (
    ModelShape,
    Trainable,
    counted_trainable,
    full_trainable,
    lora_trainable,
)
from lockstep.plan.step_report import format_step_plan, step_plan_json
from lockstep.plan.timeline import write_predicted
from lockstep.plan.units import DType, parse_bytes, parse_count, parse_dtype

DTYPES = ", ".join(d.label for d in DType)


def add_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="memory per GPU and all-reduce cost of a model, before renting GPUs",
        description="Will the model fit with DDP or does it need sharding, and what will "
        "each step's gradient all-reduce cost? Sizes print in GB = 1e9 bytes.",
    )
    add = plan.add_argument
    add("--model", default=None, help=f"the model: {MODEL_FORMS} (default: --profile's)")
    add("--gpus", type=int, default=1, help="data-parallel GPUs in total (default 1)")
    add("--nodes", type=int, default=1, help="nodes the GPUs sit on (default 1)")
    add("--gpu-memory", default="80GB", help="memory of one GPU, with a unit (default 80GB)")
    add("--weights-dtype", default="bf16", help=f"{DTYPES} (default bf16)")
    add("--grads-dtype", default=None, help=f"{DTYPES} (default: the weights' dtype)")
    add("--param-dtype", default=None, help="FSDP2 policy: compute dtype; shards keep weights'")
    add("--reduce-dtype", default=None, help="FSDP2 policy: gradient reduce dtype")
    add(
        "--keep-gathered",
        default=None,
        help="ZeRO-3: parameters gathered from forward to "
        "backward (root + reshard_after_forward=False units): a count or a share",
    )
    add("--optimizer", default="adam", help=_optimizer_help())
    add("--optimizer-dtype", default="fp32", help=f"dtype of optimizer state: {DTYPES}")
    add("--optimizer-bytes", type=float, default=None, help="override: bytes per parameter")
    add("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank only")
    add("--lora-targets", default="q_proj,v_proj", help="comma-separated Linear layer names")
    add("--trainable", default=None, help="trainable parameters: a count (4M) or a share (1%%)")
    add("--batch-size", type=int, default=1, help="samples per GPU per micro-step")
    add("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    add("--link", action="append", default=[], help=f"link inside a node: {LINK_FORMS}")
    add("--inter-link", action="append", default=[], help="link between nodes (same forms)")
    add("--bandwidth-from", default=None, help="a `lockstep bench allreduce --json` result")
    add("--bucket-cap", default=f"{BUCKET_BYTES // 2**20}MiB", help="DDP bucket cap")
    add("--json", default=None, metavar="FILE", help="also write JSON to FILE; '-': stdout only")
    add_profile_flags(add)
    plan.set_defaults(handler=main)


def _optimizer_help() -> str:
    names = ", ".join(o.label for o in Optimizer)
    return (
        f"{names} (default adam: momentum and variance; with fp16/bf16 weights an fp32 "
        "master copy is counted too, 12 bytes per parameter in all)"
    )


def _trainable(ns: argparse.Namespace, model: ModelShape) -> Trainable:
    if ns.lora_rank is not None and ns.trainable is not None:
        raise ValueError("give either --lora-rank or --trainable, not both")
    if ns.lora_rank is not None:
        targets = [t.strip() for t in ns.lora_targets.split(",") if t.strip()]
        return lora_trainable(model, ns.lora_rank, targets)
    if ns.trainable is None:
        return full_trainable(model)
    text = ns.trainable.strip()
    if text.endswith("%"):
        count = max(1, round(model.total_params * _share(text) / 100))
        return counted_trainable(model, count)
    return counted_trainable(model, parse_count(text, "--trainable"))


def _share(text: str) -> float:
    forms = "a count (4M, 4194304) or a share of the model (0.06%, 100%)"
    try:
        share = float(text[:-1])
    except ValueError:
        raise ValueError(f"--trainable expects {forms}; found {text!r}") from None
    if not 0 < share <= 100:
        raise ValueError(f"--trainable share must be in (0%, 100%]; found {text!r}")
    return share


def _model(ns: argparse.Namespace) -> ModelShape:
    if ns.model is not None:
        return resolve_model(ns.model)
    try:
        return resolve_model(ns.profile)
    except ValueError as error:  # name the flag the user gave
        raise ValueError(str(error).replace("--model", "--profile", 1)) from None


def _optional_dtype(text: str | None, arg: str) -> DType | None:
    return parse_dtype(text, arg) if text else None


def _kept(text: str | None, model: ModelShape) -> int:
    if text is None:
        return 0
    if text.strip().endswith("%"):
        return round(model.total_params * _share(text.strip()) / 100)
    return parse_count(text, "--keep-gathered")


def plan_config(ns: argparse.Namespace) -> PlanConfig:
    """Validate the flags into a `PlanConfig`; raises ValueError naming the flag."""
    if os.getcwd() not in sys.path:  # pkg.module:factory resolves like `python -m`
        sys.path.insert(0, os.getcwd())
    if ns.model is None and getattr(ns, "profile", None) is None:
        raise ValueError(f"--model is required (or --profile); give {MODEL_FORMS}")
    model = _model(ns)
    weights = parse_dtype(ns.weights_dtype, "--weights-dtype")
    measured = read_measured(ns.bandwidth_from) if ns.bandwidth_from else None
    return PlanConfig(
        model=model,
        trainable=_trainable(ns, model),
        gpus=ns.gpus,
        nodes=ns.nodes,
        gpu_memory_bytes=parse_bytes(ns.gpu_memory, "--gpu-memory"),
        weights_dtype=weights,
        grads_dtype=parse_dtype(ns.grads_dtype, "--grads-dtype") if ns.grads_dtype else None,
        param_dtype=_optional_dtype(ns.param_dtype, "--param-dtype"),
        reduce_dtype=_optional_dtype(ns.reduce_dtype, "--reduce-dtype"),
        kept_params=_kept(ns.keep_gathered, model),
        optimizer=parse_optimizer(ns.optimizer, "--optimizer"),
        optimizer_dtype=parse_dtype(ns.optimizer_dtype, "--optimizer-dtype"),
        optimizer_bytes=ns.optimizer_bytes,
        batch_size=ns.batch_size,
        grad_accum=ns.grad_accum,
        links=tuple(parse_link(text, "--link") for text in ns.link),
        inter_links=tuple(parse_link(text, "--inter-link") for text in ns.inter_link),
        measured=measured,
        bucket_cap_bytes=parse_bytes(ns.bucket_cap, "--bucket-cap"),
    )


def main(ns: argparse.Namespace) -> int:
    check_profile_flags(ns)
    cfg = plan_config(ns)
    plan = make_plan(cfg)
    step = step_plan_from_flags(ns, cfg)
    document = to_json(plan)
    if step is not None:
        document["step"] = step_plan_json(step)
        if ns.timeline:
            png, trace = write_predicted(step.sim, ns.timeline)
            document["step"]["timeline"] = {"png": str(png), "trace": str(trace)}
    if ns.json == "-":
        print(json.dumps(document, indent=2))
        return 0
    print(format_table(plan))
    if step is not None:
        print(format_step_plan(step))
        if ns.timeline:
            print(f"\npredicted timeline: {png} (trace: {trace})")
    if ns.json:
        with open(ns.json, "w") as fp:
            json.dump(document, fp, indent=2)
    return 0
