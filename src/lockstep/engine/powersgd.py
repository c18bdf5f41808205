"""PowerSGD: all-reduce two thin matrices instead of each gradient matrix.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (NeurIPS 2019), Algorithm 1. For each
gradient reshaped to an n x m matrix M, with error feedback e and a warm-started
Q (m x r):  M += e;  P = M Q;  P = mean(P);  P = orthonormalise(P);  Q = M^T P;
Q = mean(Q);  M' = P Q^T;  e = M - M'. Rank-r matrices cost (n + m) r numbers
on the wire instead of n m. Vectors and matrices too small to gain are averaged
uncompressed. The first `start_iter` steps are plain all-reduces, as the paper
advises. Collectives run on one worker thread, bucket after bucket, so ranks
issue them in the same order while backward goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lockstep.engine.comm_hooks import HookState
from lockstep.runtime import threads
from lockstep.runtime.bucket import GradBucket
from lockstep.runtime.threads import Worker


@dataclass
class PowerSGDState(HookState):
    """Settings and per-parameter memory of PowerSGD.

    Attributes:
        rank: the rank r of the approximation.
        start_iter: steps of plain all-reduce before compression starts.
        min_compression_ratio: compress a matrix only if n m > ratio x (n + m) r.
        seed: seed of the initial Q, the same on every rank.
    """

    rank: int = 2
    start_iter: int = 2
    min_compression_ratio: float = 2.0
    seed: int = 0
    iteration: int = 0
    errors: dict[int, torch.Tensor] = field(default_factory=dict)
    qs: dict[int, torch.Tensor] = field(default_factory=dict)
    _thread: Worker = field(default_factory=lambda: Worker("lockstep-powersgd"))

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"PowerSGD rank must be at least 1; found {self.rank}")
        # The worker's thread ends with the state, a destroyed group, or the interpreter.
        threads.stops_with_group(self._thread, owner=self)

    def submit(self, work: Callable[[], None]) -> None:
        """Run `work` on the state's one thread (the hook's future is set there)."""
        self._thread.submit(work)

    def compresses(self, grad: torch.Tensor) -> bool:
        if grad.dim() < 2:
            return False
        n, m = grad.shape[0], grad[0].numel()
        return n * m > self.min_compression_ratio * (n + m) * self.rank

    def rank_for(self, m: torch.Tensor) -> int:
        """The approximation's rank for matrix `m`: never above its own rank bound."""
        return min(self.rank, m.shape[0], m.shape[1])

    def initial_q(self, key: int, m: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + key)
        q = torch.randn(m.shape[1], self.rank_for(m), generator=gen, dtype=torch.float32)
        return q.to(device=m.device, dtype=m.dtype)


def _orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of `p` (reduced QR, stable where Gram-Schmidt drifts)."""
    return torch.linalg.qr(p.float(), mode="reduced").Q.to(p.dtype)


def _compress_bucket(state: PowerSGDState, bucket: GradBucket) -> torch.Tensor:
    world = state.world_size
    buffer = bucket.buffer()
    grads, params = bucket.gradients(), bucket.parameters()
    matrices = [(g, p) for g, p in zip(grads, params, strict=True) if state.compresses(g)]
    plain = [g for g in grads if not state.compresses(g)]
    if plain:
        flat = torch.cat([g.reshape(-1) for g in plain]).div_(world)
        state.all_reduce(flat).wait()
        offset = 0
        for g in plain:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    if not matrices:
        return buffer
    ms, ps, qs = [], [], []
    for grad, param in matrices:
        key = id(param)
        m = grad.reshape(grad.shape[0], -1)
        m.add_(state.errors.setdefault(key, torch.zeros_like(m)))
        q = state.qs.get(key)
        if q is None:
            q = state.initial_q(len(state.qs), m)
            state.qs[key] = q
        ms.append(m)
        qs.append(q)
        ps.append(m @ q)
    flat_p = torch.cat([p.reshape(-1) for p in ps])
    state.all_reduce(flat_p).wait()
    offset = 0
    for i, m in enumerate(ms):
        r = state.rank_for(m)
        n = m.shape[0] * r
        ps[i] = _orthonormalise(flat_p[offset : offset + n].view(m.shape[0], r))
        offset += n
        qs[i] = m.t() @ ps[i]
    flat_q = torch.cat([q.reshape(-1) for q in qs])
    state.all_reduce(flat_q).wait()
    offset = 0
    for i, (m, (_, param)) in enumerate(zip(ms, matrices, strict=True)):
        r = state.rank_for(m)
        n = m.shape[1] * r
        q = flat_q[offset : offset + n].view(m.shape[1], r).div_(world)
        offset += n
        state.qs[id(param)] = q.clone()
        approx = ps[i] @ q.t()
        state.errors[id(param)] = m - approx
        m.copy_(approx)
    return buffer


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """Compress the bucket's gradient matrices to rank `state.rank` and average them."""
    future: torch.futures.Future = torch.futures.Future()

    def work() -> None:
        try:
            if state.iteration < state.start_iter:
                buffer = bucket.buffer().div_(state.world_size)
                state.all_reduce(buffer).wait()
                future.set_result(buffer)
            else:
                future.set_result(_compress_bucket(state, bucket))
        except BaseException as exc:  # surfaces in the engine's wait, on this rank
            future.set_exception(exc)
        finally:
            if bucket.is_last():
                state.iteration += 1

    state.submit(work)
    return future
