"""Small models and a training loop shared by the engine's multi-rank tests.

Every scenario trains the same model from the same weights on the same global
batches; rank r takes the r-th contiguous slice of each global batch, so
data-parallel training at any world size must match one process on the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import lockstep


class MLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
        )

    def forward(self, x, **_):
        return self.net(x)


class Tied(nn.Module):
    """Input projection and output head share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.proj.weight

    def forward(self, x, **_):
        return self.head(torch.tanh(self.mid(torch.tanh(self.proj(x[:, :4])))))


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, **_):
        return self.out(torch.relu(self.bn(self.fc(x))))


class PartlyFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 16)
        self.base.requires_grad_(False)
        self.adapter = nn.Linear(16, 4)

    def forward(self, x, **_):
        return self.adapter(torch.tanh(self.base(x)))


class WithUnused(nn.Module):
    """`never` gets no gradient anywhere; `sometimes` only where use_sometimes is true."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.never = nn.Linear(8, 4)
        self.sometimes = nn.Linear(8, 4)

    def forward(self, x, use_sometimes: bool = False):
        out = self.fc(x)
        return out + self.sometimes(x) if use_sometimes else out


MODELS = {
    "mlp": MLP,
    "tied": Tied,
    "batchnorm": WithBatchNorm,
    "frozen": PartlyFrozen,
    "unused": WithUnused,
}


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    ddp_kwargs: dict = field(default_factory=dict)
    steps: int = 3
    micro_batches: int = 1
    global_batch: int = 8
    sometimes_on_rank0: bool = False  # WithUnused: only rank 0 uses `sometimes`
    set_to_none: bool = False


SCENARIOS = [
    Scenario("mlp", "mlp"),
    Scenario("mlp_set_to_none", "mlp", set_to_none=True),
    Scenario("tied", "tied"),
    Scenario("batchnorm", "batchnorm"),
    Scenario("frozen", "frozen"),
    Scenario("unused", "unused", {"find_unused_parameters": True}),
    Scenario(
        "unused_on_some_ranks", "unused", {"find_unused_parameters": True}, sometimes_on_rank0=True
    ),
    Scenario("no_sync_4_micro", "mlp", micro_batches=4),
    Scenario("tiny_buckets", "mlp", {"bucket_cap_mb": 1e-6, "first_bucket_cap_mb": 1e-6}),
    Scenario("one_bucket", "mlp", {"bucket_cap_mb": 1000, "first_bucket_cap_mb": 1000}),
    Scenario("grad_copy", "mlp", {"gradient_as_bucket_view": False}),
]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def batches(s: Scenario) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1234)
    return [
        [
            (
                torch.randn(s.global_batch, 8, generator=gen),
                torch.randn(s.global_batch, 4, generator=gen),
            )
            for _ in range(s.micro_batches)
        ]
        for _ in range(s.steps)
    ]


def _wrap(engine: str, model: nn.Module, s: Scenario) -> nn.Module:
    if engine == "lockstep":
        return lockstep.DistributedDataParallel(model, **s.ddp_kwargs)
    if engine == "naive":
        return lockstep.NaiveDataParallel(model)
    if engine == "torch":
        kwargs = {k: v for k, v in s.ddp_kwargs.items() if k != "first_bucket_cap_mb"}
        kwargs.setdefault("gradient_as_bucket_view", True)
        return nn.parallel.DistributedDataParallel(model, **kwargs)
    assert engine == "single"
    return model


def _step(engine: str, wrapped: nn.Module, s: Scenario, micro, rank: int, world: int) -> None:
    use = s.sometimes_on_rank0 and rank == 0
    for k, (x, y) in enumerate(micro):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        last = k == len(micro) - 1
        skip = (not last) and engine in ("lockstep", "torch")
        ctx = wrapped.no_sync() if skip else _nothing()
        with ctx:
            loss = ((wrapped(xs, use_sometimes=use) - ys) ** 2).mean() / len(micro)
            loss.backward()
    if engine == "naive":
        wrapped.sync_gradients()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def train(engine: str, s: Scenario, rank: int = 0, world: int = 1) -> dict:
    """Train and return final parameters, buffers and last gradients by name."""
    model = build(s.model)
    if world > 1 and rank == 1:  # a different start: the wrap's broadcast must fix it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    wrapped = _wrap(engine, model, s)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for micro in batches(s):
        opt.zero_grad(set_to_none=s.set_to_none)
        _step(engine, wrapped, s, micro, rank, world)
        grads = {
            n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()
        }
        opt.step()
    out = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "grads": grads,
    }
    if engine == "lockstep":
        out["payload_bytes"] = wrapped.payload_bytes
        out["buckets"] = wrapped.bucket_layout()
    return out


def train_all(ctx, engines: tuple[str, ...] = ("lockstep", "naive", "torch")) -> dict:
    """On every rank: each scenario with each engine."""
    return {
        (s.name, engine): train(engine, s, ctx.rank, ctx.world_size)
        for s in SCENARIOS
        for engine in engines
        # the textbook engine needs the same set of gradients on every rank
        if not (engine == "naive" and s.sometimes_on_rank0)
    }
