"""LoRA + DDP: fine-tune a small transformer with peft adapters under lockstep's engine.

    lockstep run --nproc-per-node 2 examples/lora_ddp.py
    lockstep run --nproc-per-node 2 examples/lora_ddp.py --steps 80 --rank 16
    python examples/lora_ddp.py                      # one process, same code
    lockstep plan --model examples.lora_ddp:build_model --gpus 2 --lora-rank 8 \\
        --weights-dtype fp32                         # the planner's view of the same model

The model is built here (no download): a GPT-style decoder with q_proj, k_proj,
v_proj and o_proj in every block. peft adds LoRA adapters to q_proj and v_proj and
freezes everything else; lockstep.DistributedDataParallel all-reduces only
parameters that require grad, so the frozen base never travels. At the end, rank 0
prints the bytes each step put on the wire for LoRA and for a full fine-tune of the
same model, next to the planner's prediction. Needs `pip install lockstep[lora]`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.plan import count_on_meta, full_trainable, lora_trainable

TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    context: int = 64
    width: int = 128
    layers: int = 4
    heads: int = 4


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q_proj = nn.Linear(cfg.width, cfg.width)
        self.k_proj = nn.Linear(cfg.width, cfg.width)
        self.v_proj = nn.Linear(cfg.width, cfg.width)
        self.o_proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, w // self.heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, w))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.up_proj = nn.Linear(cfg.width, 4 * cfg.width)
        self.down_proj = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.down_proj(F.gelu(self.up_proj(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> TinyGPT:
    """The base model (random weights stand in for a pretrained checkpoint)."""
    torch.manual_seed(0)  # every rank builds the same base
    return TinyGPT(GPTConfig())


def add_lora(model: nn.Module, rank: int = 8, targets: tuple[str, ...] = TARGETS) -> nn.Module:
    """Freeze `model` and add peft LoRA adapters of `rank` to the `targets` Linear layers."""
    from peft import LoraConfig, get_peft_model  # imported here: `lockstep plan` needs no peft

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets))
    return get_peft_model(model, config)


def batch(step: int, rank: int, cfg: GPTConfig, strides: tuple[int, int], size: int = 16):
    """Arithmetic sequences mod vocab, stride drawn from `strides`: learnable next tokens."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, cfg.vocab, (size, 1), generator=gen)
    stride = torch.randint(strides[0], strides[1] + 1, (size, 1), generator=gen)
    return (start + stride * torch.arange(cfg.context + 1)) % cfg.vocab


def train_step(ddp: nn.Module, opt: torch.optim.Optimizer | None, tokens: torch.Tensor) -> float:
    """One synchronised step: forward, backward (the all-reduce happens here), update."""
    logits = ddp(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def planned_payload(lora_rank: int | None, grad_bytes: int = 4) -> int:
    """The planner's payload for this model, counted on the meta device."""
    shape = count_on_meta(build_model)
    trainable = lora_trainable(shape, lora_rank, TARGETS) if lora_rank else full_trainable(shape)
    return trainable.count * grad_bytes


def train(ctx, ddp, opt, steps: int, strides: tuple[int, int], name: str) -> None:
    for step in range(steps):
        loss = train_step(ddp, opt, batch(step, ctx.rank, GPTConfig(), strides))
        if ctx.is_main and (step % 10 == 0 or step == steps - 1):
            print(f"{name} step {step:3d}  loss {loss:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of each phase")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    args = parser.parse_args()
    ctx = lockstep.init()

    # Phase 1, a full fine-tune: every parameter trains, every gradient travels.
    base = build_model()
    ddp = lockstep.DistributedDataParallel(base)
    opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
    train(ctx, ddp, opt, args.steps, (1, 3), "full")
    full = ddp.stats

    # Phase 2, LoRA on a new task (longer strides): only the adapters train and travel.
    # A fresh module holding the fine-tuned weights, so no hook of the first wrapper remains.
    tuned = build_model()
    tuned.load_state_dict(base.state_dict())
    model = add_lora(tuned, args.rank)
    ddp = lockstep.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train(ctx, ddp, opt, args.steps, (4, 6), "lora")
    lora = ddp.stats

    if ctx.is_main:
        report(ctx, model, args.rank, full, lora)
    lockstep.shutdown()


def report(ctx: lockstep.DistContext, model: nn.Module, rank: int, full, lora) -> None:
    """Bytes per step of both phases, as the engine measured them, beside the planner's."""
    trainable, total = model.get_nb_trainable_parameters()
    rows = [
        ("full fine-tune", total - trainable, full, planned_payload(None)),
        (f"LoRA r={rank} {','.join(TARGETS)}", trainable, lora, planned_payload(rank)),
    ]
    print(f"\nbytes per step, world size {ctx.world_size}, fp32 gradients")
    print(f"{'':<26}{'trainable':>11}{'payload':>12}{'wire/rank':>12}{'planner':>12}")
    for name, params, stats, plan in rows:
        line = f"{name:<26}{params:>11,}{stats.payload_bytes:>12,}{stats.wire_bytes:>12,}"
        print(f"{line}{plan:>12,}")
    print(f"LoRA puts {full.payload_bytes / lora.payload_bytes:.0f}x fewer bytes on the wire")


if __name__ == "__main__":
    main()
