"""Lightning's `ddp_comm_hook` on lockstep's engine, on a GPU (Lightning registers it on CUDA).

On CPU Lightning's DDP strategy never calls `register_comm_hook`, so a CPU run with
`ddp_comm_hook=` trains without a hook and proves nothing. Here, on one CUDA device
(world size 1 over NCCL, one process): both engines take the hook through Lightning
(torch's `_get_ddp_logging_data()["comm_hook"]` names it, as Lightning's own tests
read it), train to the same parameters bitwise, and differ from a run without the
hook (the hook really ran: fp16 rounds the gradients).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]


def _fit(engine: str, hook: bool) -> tuple[list[torch.Tensor], str | None]:
    L = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DDPStrategy

    from lockstep.adopt.lightning import LockstepStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            return (self.net(batch[0]) - 1).square().mean()

        def on_train_end(self) -> None:
            data = self.trainer.strategy.model._get_ddp_logging_data()
            self.hook_name = data.get("comm_hook")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    kind = {"torch": DDPStrategy, "lockstep": LockstepStrategy}[engine]
    strategy = kind(ddp_comm_hook=default_hooks.fp16_compress_hook if hook else None)
    data = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
    module = Module()
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return [p.detach().cpu().clone() for p in module.parameters()], module.hook_name


def test_lightning_comm_hook_runs_on_both_engines_alike(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # Lightning sets them: restored after
        monkeypatch.delenv(name)
    try:
        theirs, their_hook = _fit("torch", hook=True)
        ours, our_hook = _fit("lockstep", hook=True)
        plain, _ = _fit("lockstep", hook=False)
    finally:
        if dist.is_initialized():  # Lightning leaves its group open
            dist.destroy_process_group()
    assert their_hook == our_hook == "fp16_compress_hook", (their_hook, our_hook)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(ours, plain, strict=True))
