"""A LightningModule trained by the Lightning Trainer with lockstep's strategy.

    lockstep run --nproc-per-node 2 examples/lightning_module.py
    torchrun --nproc-per-node 2 examples/lightning_module.py
    python examples/lightning_module.py --devices 2    # Lightning starts the processes itself

`import lockstep.adopt.lightning` registers the strategy name "lockstep" (for the
Trainer and for Fabric); it takes the arguments of Lightning's DDP strategy. With
`--strategy ddp` the script is a plain Lightning script, and `lockstep run
--engine lockstep` (or `torchrun -m lockstep.adopt`) still runs it on lockstep's
engine. The last line prints the wrapper's class: TorchFacedDDP for lockstep's.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep.adopt.lightning  # noqa: F401 (registers strategy="lockstep")


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_train_start(self) -> None:
        self.wrapper = type(self.trainer.strategy.model).__name__

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    parser.add_argument("--strategy", default="lockstep", help='"ddp": Lightning\'s own')
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=16)
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        default_root_dir="runs/lightning_module",
    )
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        print(f"wrapper {model.wrapper}")


if __name__ == "__main__":
    main()
