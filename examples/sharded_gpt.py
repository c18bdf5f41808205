"""The same GPT trained under DDP and under fully sharded data parallelism (stage 3), side by side.

    lockstep run --nproc-per-node 2 examples/sharded_gpt.py
    python examples/sharded_gpt.py                   # one process: nothing to shard

Two copies of one small GPT start from the same weights: one wrapped in
`lockstep.DDP`, one in `lockstep.FSDP` (ZeRO-3, each transformer block its own
unit). Both see the same batches and the same AdamW; the training loop is the
same lines for both. Rank 0 prints both losses each step (identical at world
size 2: the arithmetic is the same) and then the memory each rank holds for
weights, gradients and optimizer state, measured from the tensors' storages,
next to what `lockstep plan` predicts for this model and world size.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.plan.measured import measured_bytes, planned_bytes


class Block(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 4, context: int = 32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor) -> float:
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    ctx = lockstep.init()
    torch.manual_seed(0)
    plain = GPT()
    models = {"DDP": lockstep.DDP(GPT()), "FSDP": lockstep.FSDP(GPT(), wrap=[Block])}
    models["DDP"].load_state_dict(plain.state_dict())
    models["FSDP"].load_state_dict(plain.state_dict())
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        batch = torch.randint(0, 256, (args.global_batch, 33), generator=data)
        mine = batch.chunk(ctx.world_size)[ctx.rank]
        for opt in opts.values():
            opt.zero_grad()
        losses = {k: train_step(m, opts[k], mine) for k, m in models.items()}
        if ctx.rank == 0:
            same = "identical" if losses["DDP"] == losses["FSDP"] else "DIFFERENT"
            print(f"step {step}: loss DDP {losses['DDP']:.6f}  FSDP {losses['FSDP']:.6f}  {same}")
    report_memory(ctx, plain, models, opts)
    lockstep.shutdown()


def report_memory(ctx, plain: nn.Module, models: dict, opts: dict) -> None:
    """Per rank: measured state bytes (after the last step) next to the plan's prediction."""
    rows = []
    for (name, model), stage in zip(models.items(), (0, 3), strict=True):
        got, want = measured_bytes(model, opts[name]), planned_bytes(plain, ctx.world_size, stage)
        rows.append(
            f"rank {ctx.rank} {name:<5} measured {got.weights / 1e6:6.2f} / {got.grads / 1e6:6.2f}"
            f" / {got.optimizer / 1e6:6.2f} MB  plan {want.weights / 1e6:6.2f} / "
            f"{want.grads / 1e6:6.2f} / {want.optimizer / 1e6:6.2f} MB"
        )
    for rank in range(ctx.world_size):
        if rank == ctx.rank:
            if rank == 0:
                print("memory per rank: weights / gradients / optimizer state (MB = 1e6 bytes)")
            print("\n".join(rows), flush=True)
        if ctx.world_size > 1:
            torch.distributed.barrier()


if __name__ == "__main__":
    main()
