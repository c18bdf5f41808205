"""An Accelerate training loop, written for torch's DDP, run on lockstep's engine unchanged.

    lockstep run --nproc-per-node 2 --engine lockstep examples/accelerate_loop.py
    torchrun --nproc-per-node 2 -m lockstep.adopt examples/accelerate_loop.py
    accelerate launch --multi_gpu --num_processes 2 -m lockstep.adopt examples/accelerate_loop.py
    lockstep run --nproc-per-node 2 examples/accelerate_loop.py    # torch's engine, to compare

Nothing below names lockstep: `--engine lockstep` (LOCKSTEP_ENGINE=lockstep) makes
torch's DistributedDataParallel, which Accelerate builds, lockstep's engine in each
worker. The one-line alternative in code: `from lockstep.adopt.accelerate import Accelerator`.
The last line prints the wrapper's class (TorchFacedDDP with lockstep's engine) and
a checksum of the weights, the same with both engines.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = DataLoader(data, batch_size=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(2):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        accelerator.print(f"epoch {epoch} loss {loss.item():.4f}")
    weights = accelerator.unwrap_model(model).state_dict()
    checksum = sum(float(w.double().sum()) for w in weights.values())
    accelerator.print(f"wrapper {type(model).__name__} checksum {checksum:.10f}")


if __name__ == "__main__":
    main()
