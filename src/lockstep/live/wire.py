"""Bytes between live peers: a survivor's state, packed as torch.save packs a checkpoint.

The donor of a live recovery (`live/registry.py`) packs what it hands over into bytes
and broadcasts them over the new default group, size first; the replacement unpacks
them with torch.load(weights_only=True), as it would read a checkpoint file. Used by
both hand-overs: the Checkpointer's (`live/checkpoint.py`) and the plain one
(`live/plain.py`).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist


def pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def broadcast(data: bytes | None, src: int) -> bytes:
    """`data` from `src` to every rank of the default group (size first, then bytes)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    if data is not None:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=src)
    return buffer.numpy().tobytes()
