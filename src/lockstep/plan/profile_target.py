"""What `lockstep plan --profile` runs: the user's model, a batch for it, a loss, an optimizer.

`--profile pkg.module:factory` builds the model and makes a batch from its first
layer: token ids of `--batch-size` x `--seq-len` for an Embedding, random
features of `--batch-size` x in_features for a Linear; the loss is the mean
square of the output. A model that needs its own input names a hook instead,
`--profile-script pkg.module:fn`, where `fn(batch_size)` returns
`(model, inputs, loss_fn)`: inputs a tuple of forward arguments, loss_fn(output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep.plan.memory import Optimizer
from lockstep.plan.model_count import load_factory

SCRIPT_FORM = "pkg.module:fn, where fn(batch_size) returns (model, inputs, loss_fn)"


@dataclass
class ProfileTarget:
    """A model ready to profile: `loss_fn(model(*inputs))` is one step's loss."""

    model: nn.Module
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    label: str

    def run_step(self) -> tuple[Any, Callable[[Any], torch.Tensor]]:
        return self.model(*self.inputs), self.loss_fn


def mean_square(output: Any) -> torch.Tensor:
    """A loss that reaches every output element: the mean square of the (first) output."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if hasattr(output, "logits"):  # model outputs of the transformers library
        output = output.logits
    return output.float().pow(2).mean()


def _first_layer(model: nn.Module) -> nn.Module | None:
    for sub in model.modules():
        if isinstance(sub, (nn.Embedding, nn.Linear)):
            return sub
    return None


def guess_inputs(model: nn.Module, batch_size: int, seq_len: int, label: str) -> tuple:
    """A batch shaped for the model's first Embedding or Linear layer.

    Raises:
        ValueError: the model starts with neither; the message points at --profile-script.
    """
    first = _first_layer(model)
    gen = torch.Generator().manual_seed(0)
    if isinstance(first, nn.Embedding):
        return (torch.randint(0, first.num_embeddings, (batch_size, seq_len), generator=gen),)
    if isinstance(first, nn.Linear):
        return (torch.randn(batch_size, first.in_features, generator=gen),)
    raise ValueError(
        f"--profile: cannot make a batch for {label}: its first layer is neither nn.Embedding "
        f"nor nn.Linear; give --profile-script {SCRIPT_FORM}"
    )


def target_from_factory(spec: str, batch_size: int, seq_len: int) -> ProfileTarget:
    """Build `pkg.module:factory` and a batch for it (see the module docstring).

    Raises:
        ValueError: the factory cannot be loaded, fails, or returns no nn.Module.
    """
    factory = load_factory(spec)
    model = _call(factory, (), spec, "--profile")
    if not isinstance(model, nn.Module):
        raise ValueError(f"--profile: {spec}() returned {type(model).__name__}; expected nn.Module")
    return ProfileTarget(model, guess_inputs(model, batch_size, seq_len, spec), mean_square, spec)


def target_from_script(spec: str, batch_size: int) -> ProfileTarget:
    """Call the hook `pkg.module:fn(batch_size)` -> (model, inputs, loss_fn).

    Raises:
        ValueError: the hook cannot be loaded or called, or returns something else.
    """
    fn = load_factory(spec)
    found = _call(fn, (batch_size,), spec, "--profile-script")
    ok = isinstance(found, tuple) and len(found) == 3
    if not ok or not isinstance(found[0], nn.Module) or not callable(found[2]):
        raise ValueError(
            f"--profile-script: {spec}({batch_size}) returned {type(found).__name__}; "
            f"expected {SCRIPT_FORM}"
        )
    model, inputs, loss_fn = found
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return ProfileTarget(model, inputs, loss_fn, spec)


def _call(fn: Any, args: tuple, spec: str, flag: str) -> Any:
    if not callable(fn):
        raise ValueError(f"{flag}: {spec!r} is not callable")
    try:
        return fn(*args)
    except Exception as error:  # the user's code failing is bad input here
        raise ValueError(f"{flag}: {spec}() failed ({type(error).__name__}: {error})") from None


def make_optimizer(kind: Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer `--optimizer` names: Adam, SGD with momentum, or plain SGD."""
    if kind is Optimizer.ADAM:
        return torch.optim.Adam(params, lr=1e-4)
    momentum = 0.9 if kind is Optimizer.MOMENTUM else 0.0
    return torch.optim.SGD(params, lr=1e-4, momentum=momentum)
