"""A small character-level GPT and its data: the Python standard library's own source.

Every machine with Python has the text already: the standard library's `.py`
files (found through `sysconfig`), read in name order up to a byte budget, so
every rank reads the same text without a download. Characters are tab, newline
and printable ASCII; anything else becomes a space. `CharWindows` cuts the
token stream into fixed windows (input, next-character target). `CharGPT` is a
pre-norm decoder-only transformer with a tied input/output embedding.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = len(CHARS)
_INDEX = {c: i for i, c in enumerate(CHARS)}
_SPACE = _INDEX[" "]


def stdlib_text(max_bytes: int = 2_000_000) -> tuple[str, int]:
    """The standard library's top-level `.py` files, in name order, up to `max_bytes`.

    Returns:
        The text and the number of files it came from.

    Raises:
        FileNotFoundError: the standard library directory holds no `.py` file.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"expected the standard library's .py files in {root}; found none. This Python "
            "ships compiled files only: point --max-bytes at another text, or install python3."
        )
    parts, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text[: max_bytes - size])
        size += len(parts[-1])
        if size >= max_bytes:
            break
    return "".join(parts), len(parts)


def encode(text: str) -> torch.Tensor:
    """Characters to token ids (uint8); unknown characters become a space."""
    return torch.tensor([_INDEX.get(c, _SPACE) for c in text], dtype=torch.uint8)


def decode(tokens: torch.Tensor) -> str:
    return "".join(CHARS[int(t)] for t in tokens)


class CharWindows(Dataset):
    """Non-overlapping windows of `context` tokens; the target is the input shifted by one."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.context : (i + 1) * self.context + 1].long()
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = (part.transpose(1, 2) for part in qkv.unbind(2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


def _init(module: nn.Module) -> None:
    """Small normal weights (std 0.02) and zero biases: the first loss is close to ln(VOCAB)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CharGPT(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm and a tied head."""

    def __init__(self, context: int, dim: int = 96, layers: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.norm(self.blocks(self.tok(idx) + self.pos(pos))))

    @torch.no_grad()
    def generate(self, prompt: str, length: int, temperature: float = 0.8, seed: int = 0) -> str:
        """Continue `prompt` by `length` characters, sampling at `temperature`."""
        gen = torch.Generator().manual_seed(seed)
        idx = encode(prompt).long().unsqueeze(0)
        for _ in range(length):
            logits = self(idx[:, -self.context :])[0, -1] / temperature
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)
            idx = torch.cat([idx, nxt.unsqueeze(0)], dim=1)
        return decode(idx[0])
