"""Find the parameters a forward pass did not use, by walking its autograd graph.

With find_unused_parameters=True the engine calls `unreachable_parameters`
after each forward: a parameter whose AccumulateGrad node cannot be reached
from the outputs will get no gradient in this backward, so its slot is marked
ready (with zeros) as soon as backward starts, and its bucket is not held up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.utils._pytree import tree_leaves


def output_tensors(output: object) -> list[torch.Tensor]:
    """The tensors inside a forward's output (any nesting of lists, tuples, dicts)."""
    return [leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)]


def reachable_parameter_ids(outputs: Iterable[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors whose gradients backward from `outputs` would accumulate."""
    seen: set[object] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    found: set[int] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return found


def unreachable_parameters(output: object, params: Sequence[torch.Tensor]) -> list[int]:
    """Indices into `params` of those the output's graph does not reach."""
    reached = reachable_parameter_ids(output_tensors(output))
    return [i for i, p in enumerate(params) if id(p) not in reached]
