"""Count a model's parameters without allocating them, and read `--model` in all its forms.

`pkg.module:factory` is imported and the factory called under the meta device:
every tensor gets a shape and a dtype but no storage, so a 70B model is counted
in milliseconds on a laptop. Parameters that share storage (tied embeddings) are
counted once; parameters with requires_grad=False (a frozen base) are not trainable.
`--model` may also be a parameter count (`7B`) or a preset name (`llama-2-7b`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lockstep.plan.presets import PRESETS, preset_shape
from lockstep.plan.shape import LinearInfo, ModelShape
from lockstep.plan.units import looks_like_count, parse_count

MODEL_FORMS = (
    f"a parameter count (7B, 125M, 7e9), a preset ({', '.join(PRESETS)}), or pkg.module:factory"
)


class _SkipInitOnMeta(TorchFunctionMode):
    """Skip random initialisers on meta tensors: there are no values to fill.

    Besides being useless there, torch's meta `normal_` imports torch._dynamo on
    first use, which costs seconds; every nn.Embedding would pay it.
    """

    SKIP = frozenset(
        {
            nn.init.normal_,
            nn.init.trunc_normal_,
            nn.init.uniform_,
            nn.init.kaiming_normal_,
            nn.init.kaiming_uniform_,
            nn.init.xavier_normal_,
            nn.init.xavier_uniform_,
            nn.init.orthogonal_,
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            torch.Tensor.random_,
        }
    )

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in self.SKIP:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def count_module(module: nn.Module, label: str = "module") -> ModelShape:
    """The shape of a built module: tied parameters once, trainable in registration order."""
    seen: set[int] = set()
    total, trainable = 0, []
    for param in module.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        if param.requires_grad:
            trainable.append(param.numel())
    linears = tuple(
        LinearInfo(name, sub.in_features, sub.out_features)
        for name, sub in module.named_modules()
        if isinstance(sub, nn.Linear)
    )
    return ModelShape(label, "module", total, tuple(trainable), linears)


def load_factory(spec: str) -> object:
    """Import `pkg.module:factory` and return the factory.

    Raises:
        ValueError: malformed spec, the module does not import, or no such attribute.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model: expected pkg.module:factory; found {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any import-time failure is bad input here
        raise ValueError(
            f"--model: cannot import {module_name!r} ({type(error).__name__}: {error}); "
            f"expected {MODEL_FORMS}"
        ) from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(
                f"--model: module {module_name!r} has no attribute {attr!r}; expected "
                "pkg.module:factory where factory() returns an nn.Module"
            )
        factory = getattr(factory, part)
    return factory


def count_on_meta(factory: Callable[[], Any], label: str = "module") -> ModelShape:
    """Call `factory()` on the meta device (shapes, no storage, no init) and count the result.

    Raises:
        ValueError: the factory fails, or does not return an nn.Module.
    """
    try:
        with torch.device("meta"), _SkipInitOnMeta():
            module = factory()
    except Exception as error:
        raise ValueError(
            f"--model: {label}() failed on the meta device ({type(error).__name__}: {error}); "
            "expected a factory that builds the model without arguments"
        ) from None
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"--model: {label}() returned {type(module).__name__}; expected an nn.Module"
        )
    return count_module(module, label)


def count_factory(spec: str) -> ModelShape:
    """Import `pkg.module:factory` and count what it builds, on the meta device.

    Raises:
        ValueError: the factory cannot be loaded or called, or returns no nn.Module.
    """
    factory = load_factory(spec)
    if not callable(factory):
        raise ValueError(f"--model: {spec!r} is not callable; expected a factory function")
    return count_on_meta(factory, spec)


def resolve_model(text: str) -> ModelShape:
    """Read `--model`: `pkg.module:factory`, a parameter count, or a preset name.

    Raises:
        ValueError: none of the forms; the message lists them.
    """
    text = text.strip()
    if ":" in text:
        return count_factory(text)
    if looks_like_count(text):
        return ModelShape(text, "count", parse_count(text, "--model"))
    return preset_shape(text)
