"""What goes into a checkpoint and how it is put back: the model, optimizer, sampler, scheduler.

The model is saved unwrapped (no `module.` prefix), so a checkpoint of a
data-parallel model loads into the plain model and the other way round. Before
anything is written, the payload is checked to hold only tensors and plain
containers, the things torch.load(weights_only=True) accepts. Before a model
is loaded, its keys and shapes are compared, so a checkpoint of another model
is refused with the differences named and leaves the model untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from lockstep.checkpoint.files import FORMAT_KEY, FORMAT_VERSION
from lockstep.errors import CheckpointError

_PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)
_LISTED = 6  # how many keys an error message names before "..."


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost module: follows `.module` through any data-parallel wrapper."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module  # type: ignore[assignment]
    return model


def device_of(model: nn.Module) -> torch.device:
    """Where the model's tensors live (the first parameter's or buffer's device), else CPU."""
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def check_plain(value: Any, where: str) -> None:
    """Raise unless `value` holds only tensors, numbers, strings and plain containers.

    Raises:
        CheckpointError: naming the first offending entry, for example extra['loss_fn'].
    """
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(
                    f"{where} has a key of type {type(key).__name__}; expected str or int keys"
                )
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint may "
        "hold only tensors, numbers, strings, None and lists/tuples/dicts of them, so that it "
        "loads with torch.load(weights_only=True). Convert it (for example to a tensor or a "
        "dict) before saving."
    )


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_LISTED])
    return f"[{shown}{', ...' if len(keys) > _LISTED else ''}] ({len(keys)})"


def shape_differences(
    expected: dict[str, tuple[int, ...] | None], saved: dict[str, tuple[int, ...] | None]
) -> list[str]:
    """What keeps a checkpoint from fitting a model, given each side's keys and shapes.

    None stands for a value without a shape (not a tensor); it is not compared.
    """
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k}: checkpoint {saved[k]} vs model {shape}"
        for k, shape in expected.items()
        if k in saved and shape is not None and saved[k] is not None and saved[k] != shape
    ]
    parts = []
    if missing:
        parts.append(f"keys missing from the checkpoint {_listed(missing)}")
    if unexpected:
        parts.append(f"keys the model does not have {_listed(unexpected)}")
    if shapes:
        parts.append(f"shape mismatches {_listed(shapes)}")
    return parts


def _shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def load_model(model: nn.Module, saved: dict[str, Any], source: str) -> None:
    """Load `saved` into the (unwrapped) model, or raise without touching it.

    Raises:
        CheckpointError: the keys or shapes differ; the message lists the differences.
    """
    module = unwrap(model)
    saved = dict(saved)
    consume_prefix_in_state_dict_if_present(saved, "module.")
    parts = shape_differences(_shapes(module.state_dict()), _shapes(saved))
    if parts:
        raise CheckpointError(
            f"{source} does not fit this model: " + "; ".join(parts) + ". Expected a "
            "checkpoint of the same architecture; check the model config, or use a new "
            "checkpoint directory for a new model."
        )
    module.load_state_dict(saved)


def load_component(component: Any, saved: Any, name: str, source: str) -> None:
    """Load the saved state of the optimizer, sampler or scheduler into `component`.

    Raises:
        CheckpointError: the checkpoint has no such state, or it does not fit.
    """
    if saved is None:
        raise CheckpointError(
            f"{source} holds no {name} state (it was saved without {name}=); restore without "
            f"{name}=, or save it next time"
        )
    try:
        component.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as error:
        raise CheckpointError(f"the {name} state in {source} does not fit: {error}") from None


def build_payload(
    step: int, world_size: int, components: dict[str, Any], rng_states: list[Any], extra: Any
) -> dict[str, Any]:
    """The dict that is saved: format tag, step, world size, component states, RNG per rank.

    Raises:
        CheckpointError: something in it is not a tensor or plain container.
    """
    payload: dict[str, Any] = {
        FORMAT_KEY: FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "model": unwrap(components["model"]).state_dict(),
    }
    for name in ("optimizer", "sampler", "scheduler"):
        component = components.get(name)
        payload[name] = None if component is None else component.state_dict()
    payload["extra"] = extra
    payload["rng"] = rng_states
    check_plain(payload, "checkpoint")
    return payload
