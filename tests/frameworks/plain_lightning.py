"""A plain Lightning script (no lockstep in it): `strategy="ddp"` on 2 CPU processes.

    python -m lockstep.adopt tests/frameworks/plain_lightning.py

Lightning starts rank 1 itself, as `python tests/frameworks/plain_lightning.py`,
without the adoption wrapper; each rank prints the class of the model's wrapper.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_start(self) -> None:
        wrapper = type(self.trainer.strategy.model).__name__
        print(f"rank {self.global_rank}: wrapper {wrapper}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader)
