"""Models and a training loop shared by the sharded engine's multi-rank tests.

Every run trains the same model from the same seed on the same global batches,
rank r taking the r-th slice of each; an engine is a name ("ddp", "stage1",
"stage2", "stage3", "fsdp2" for torch's fully_shard) so runs differ only there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from engine_models import MLP, PartlyFrozen, Tied
from torch import nn

import lockstep
from lockstep.testing.mesh import device_mesh


class Block(nn.Module):
    """A pre-norm transformer block, the unit of stage 3."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, `layers` blocks, a head tied to the embedding."""

    def __init__(self, vocab: int = 32, width: int = 16, layers: int = 2, context: int = 8):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


MODELS = {"mlp": MLP, "tied": Tied, "frozen": PartlyFrozen, "gpt": TinyGPT}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def global_batches(name: str, steps: int, batch: int = 8) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    if name == "gpt":
        return [(torch.randint(0, 32, (batch, 9), generator=gen),) for _ in range(steps)]
    return [
        (torch.randn(batch, 8, generator=gen), torch.randn(batch, 4, generator=gen))
        for _ in range(steps)
    ]


def loss_of(name: str, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if name == "gpt":
        (idx,) = batch
        logits = model(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    x, y = batch
    return F.mse_loss(model(x), y)


def wrap(engine: str, model: nn.Module, name: str) -> nn.Module:
    if engine == "ddp":
        return lockstep.DDP(model)
    if engine == "fsdp2":  # an explicit mesh: the accelerator's would not fit a CPU model
        from torch.distributed.fsdp import fully_shard

        mesh = device_mesh("cpu")
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    hybrid = {"hybrid": True, "shard_group_size": 2} if engine.startswith("hsdp") else {}
    stage = int(engine.removeprefix("hsdp").removeprefix("stage"))
    wrap_cls = [Block] if stage == 3 and name == "gpt" else None
    return lockstep.ShardedDataParallel(
        model, stage=stage, wrap=wrap_cls, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005, **hybrid
    )


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def train(
    ctx,
    engine: str,
    name: str,
    steps: int = 3,
    micro: int = 1,
    clip: float | None = None,
    optimizer: str = "adamw",
    eval_forward: bool = False,
) -> dict:
    """Train and return the losses, per step, and the full state dict at the end."""
    model = wrap(engine, build(name), name)
    opt = make_optimizer(optimizer, model)
    losses, norms = [], []
    for batch in global_batches(name, steps):
        mine = [t.chunk(ctx.world_size)[ctx.rank] for t in batch]
        parts = list(zip(*[t.chunk(micro) for t in mine], strict=True))
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            ctxm = model.no_sync() if not last and hasattr(model, "no_sync") else _nothing()
            with ctxm:
                loss = loss_of(name, model, part) / micro
                loss.backward()
        if clip is not None:
            if hasattr(model, "clip_grad_norm_"):
                norms.append(model.clip_grad_norm_(clip))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        if eval_forward:  # a forward without grad between steps changes nothing
            with torch.no_grad():
                losses.append(loss_of(name, model, mine))
    return {
        "losses": torch.stack(losses),
        "norms": torch.stack(norms) if norms else None,
        "state": _full_state(engine, model),
    }


def _full_state(engine: str, model: nn.Module) -> dict[str, torch.Tensor]:
    if engine == "fsdp2":
        return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
