"""The planner behind `lockstep plan`: memory per GPU and all-reduce cost, before training.

Pure arithmetic on counts, dtypes and link figures; the only torch it touches is the
meta device, to count a model without allocating it.
"""

from lockstep.plan.model_count import count_module, count_on_meta, resolve_model
from lockstep.plan.planner import Plan, PlanConfig, make_plan
from lockstep.plan.shape import full_trainable, lora_trainable

__all__ = [
    "Plan",
    "PlanConfig",
    "count_module",
    "count_on_meta",
    "full_trainable",
    "lora_trainable",
    "make_plan",
    "resolve_model",
]
