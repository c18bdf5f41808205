"""The benchmark workloads, shared by every benchmark that times a training step.

    from workloads import WORKLOADS, build    # benchmarks/ is on sys.path for its scripts
    w = WORKLOADS["mlp-8x1024"]; model = build(w.name)
    inputs, targets = w.batch(generator); w.loss(model(inputs), targets).backward()

Three shapes of gradient traffic: a few large tensors (8 x Linear(1024, 1024),
33.6 MB of fp32 gradients), many small ones (200 x Linear(64, 64), 3.3 MB in 400
tensors, where per-tensor overhead shows), and a small GPT (~5.8M parameters) whose
mix of embedding, attention and MLP weights is what real models look like.
`build` seeds the initialisation, so every rank and every rerun builds the same model;
`factory` alone builds it under any device context (the planner counts it on meta).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A model, its batches and its loss.

    Attributes:
        name: short label for tables.
        factory: builds the model (no seeding: use `build` for the seeded one).
        batch: generator -> (inputs, targets) for one step of one rank.
        loss: (model output, targets) -> scalar loss.
    """

    name: str
    factory: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build(name: str, seed: int = 0) -> nn.Module:
    """The workload's model with weights drawn from `seed`: the same on every rank."""
    torch.manual_seed(seed)
    return WORKLOADS[name].factory()


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def many_small() -> nn.Module:
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(200)))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class SmallGPT(nn.Module):
    """A GPT-2-style decoder: 6 blocks of width 256, vocabulary 2048, context 64 (5.8M)."""

    def __init__(self, vocab: int = 2048, width: int = 256, layers: int = 6, context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, 4) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _regression(width: int) -> Callable[[torch.Generator], Batch]:
    def batch(gen: torch.Generator) -> Batch:
        return torch.randn(32, width, generator=gen), torch.randn(32, width, generator=gen)

    return batch


def _tokens(gen: torch.Generator) -> Batch:
    tokens = torch.randint(0, 2048, (4, 65), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


WORKLOADS: dict[str, Workload] = {
    "mlp-8x1024": Workload("mlp-8x1024", mlp, _regression(1024), F.mse_loss),
    "linear-200x64": Workload("linear-200x64", many_small, _regression(64), F.mse_loss),
    "gpt-5m": Workload("gpt-5m", SmallGPT, _tokens, _next_token_loss),
}
