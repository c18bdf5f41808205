"""Bytes per link and memory per GPU of HSDP beside DDP and flat ZeRO, across M nodes of G GPUs.

Per step, P = gradient bytes (trainable x gradient dtype), W = weight bytes that are
all-gathered (stage 2: the trainable ones, once; stage 3: all, twice: forward and
backward), N = G x M, ranks numbered node by node (a ring crosses each node boundary
once per direction, so every node sends what one rank of the ring sends):

| strategy | each GPU sends (all links) | each node sends across nodes |
|---|---|---|
| DDP, two-phase | 2(G-1)/G P + 2(M-1)/M P / G | 2(M-1)/M P |
| ZeRO-2, flat ring | (N-1)/N (P + W) | (N-1)/N (P + W) |
| ZeRO-3, flat ring | (N-1)/N (P + 2W) | (N-1)/N (P + 2W) |
| HSDP-2 / HSDP-3 | (G-1)/G (P + W or 2W) + 2(M-1)/M P / G | 2(M-1)/M P |

HSDP shards inside the node only, so its all-gathers never cross nodes; each GPU
all-reduces its shard (P / G) with the GPUs holding it on the other nodes.
Memory: stage 2 keeps full weights and 1/G of gradients and optimizer state,
stage 3 1/G of all three (`memory.per_gpu_bytes` with G in place of N).
"""

from __future__ import annotations

from dataclasses import dataclass

from lockstep.plan.memory import StateBytes, Strategy, per_gpu_bytes

HYBRID_STRATEGIES = {2: Strategy.ZERO2, 3: Strategy.ZERO3}


@dataclass(frozen=True)
class LinkBytes:
    """What one step sends: from each GPU over all its links, and from each node across nodes."""

    label: str
    per_gpu: float
    across_per_node: float


def _ring(n: int) -> float:
    """(n-1)/n: the share each rank sends in a ring reduce-scatter or all-gather."""
    return (n - 1) / n


def link_bytes(
    gpus_per_node: int, nodes: int, grad_bytes: float, weight_bytes: float, gathered: float
) -> list[LinkBytes]:
    """Bytes per step of DDP, ZeRO-2, ZeRO-3 and HSDP-2/3 (see the module's table).

    Args:
        gpus_per_node: G.
        nodes: M.
        grad_bytes: P, the gradient payload.
        weight_bytes: W of stage 2: the trainable weights, all-gathered once a step.
        gathered: W of stage 3: the bytes of every weight (all-gathered twice a step).
    """
    g, m = gpus_per_node, nodes
    n = g * m
    across = 2 * _ring(m) * grad_bytes
    replica = across / g  # each GPU's shard, all-reduced with its M-1 copies
    return [
        LinkBytes("DDP, two-phase", 2 * _ring(g) * grad_bytes + replica, across),
        LinkBytes(
            "ZeRO-2", _ring(n) * (grad_bytes + weight_bytes), _ring(n) * (grad_bytes + weight_bytes)
        ),
        LinkBytes(
            "ZeRO-3", _ring(n) * (grad_bytes + 2 * gathered), _ring(n) * (grad_bytes + 2 * gathered)
        ),
        LinkBytes("HSDP-2", _ring(g) * (grad_bytes + weight_bytes) + replica, across),
        LinkBytes("HSDP-3", _ring(g) * (grad_bytes + 2 * gathered) + replica, across),
    ]


def hybrid_memory(full: StateBytes, stage: int, gpus_per_node: int) -> StateBytes:
    """Per-GPU model states of HSDP at `stage` (2 or 3), sharded over the node's G GPUs."""
    return per_gpu_bytes(full, HYBRID_STRATEGIES[stage], gpus_per_node)
