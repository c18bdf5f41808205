"""Lightning Fabric and Trainer scripts, run with Lightning's DDP strategy and with lockstep's.

Engine "torch" uses Lightning's `DDPStrategy` (or the name "ddp"); engine
"lockstep" uses `lockstep.adopt.lightning.LockstepStrategy` / `LockstepFabricStrategy`
(or the registered name "lockstep") with the same arguments. Each case returns
parameters, optimizer state and what it saved. The ranks' process group already
exists; Lightning sees LOCAL_RANK and does not start processes of its own.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lockstep.adopt.lightning import LockstepFabricStrategy, LockstepStrategy

FABRIC = {"torch": FabricDDPStrategy, "lockstep": LockstepFabricStrategy}
TRAINER = {"torch": DDPStrategy, "lockstep": LockstepStrategy}
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _with_optimizer(kind: type[torch.optim.Optimizer], **kw: Any) -> tuple[nn.Module, Any]:
    """A fresh network and an optimizer over its own parameters (not another network's)."""
    net = _net()
    return net, kind(net.parameters(), **kw)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * step + rank))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _fabric(engine: str, by_name: bool = False, **kwargs: Any) -> L.Fabric:
    strategy = {"torch": "ddp", "lockstep": "lockstep"}[engine] if by_name else FABRIC[engine]()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, **kwargs)
    fabric.launch()  # processes exist already (LOCAL_RANK): this joins the group
    return fabric


def case_fabric(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """no_backward_sync over 2 micro-batches, clip_gradients, save, load and resume."""
    fabric = _fabric(engine)
    model, opt = fabric.setup(*_with_optimizer(torch.optim.Adam, lr=1e-2))
    for step in range(4):
        accumulating = step % 2 == 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(model(_batch(rank, step)).square().mean())
        if not accumulating:
            fabric.clip_gradients(model, opt, max_norm=0.05)
            opt.step()
            opt.zero_grad()
    path = tmp / engine / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt})
    fabric.backward(model(_batch(rank, 9)).square().mean())  # moves away from the save
    opt.step()
    opt.zero_grad()
    fabric.load(path, {"model": model, "optimizer": opt})
    fabric.backward(model(_batch(rank, 10)).square().mean())
    opt.step()
    saved = torch.load(path, weights_only=True)["model"]
    return {
        "params": _params(model),
        "opt": opt.state_dict()["state"],
        "saved": saved,
        "wrapper": type(model._forward_module).__name__,
    }


def case_fabric_bf16(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """precision="bf16-mixed" (autocast on CPU), the strategy given by its registered name."""
    fabric = _fabric(engine, by_name=True, precision="bf16-mixed")
    model, opt = fabric.setup(*_with_optimizer(torch.optim.SGD, lr=0.1))
    for step in range(2):
        fabric.backward(model(_batch(rank, step)).square().mean())
        opt.step()
        opt.zero_grad()
    return {"params": _params(model)}


class Module(L.LightningModule):
    """The same network as a LightningModule; `side` is used every other step when asked."""

    def __init__(self, use_side_every: int = 1) -> None:
        super().__init__()
        self.net = _net()
        self.side = nn.Linear(6, 3)
        self.every = use_side_every

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        out = self.net(batch[0])
        if self.global_step % self.every == 0:
            out = out + self.side(batch[0])
        return out.square().mean()

    def on_train_start(self) -> None:
        self.wrapper = type(self.trainer.strategy.model).__name__

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Manual(Module):
    """Manual optimization: Lightning arms the backward through `reducer.prepare_for_backward`."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], index: int) -> None:
        opt = self.optimizers()
        self.manual_backward((self.net(batch[0]) + self.side(batch[0])).square().mean())
        opt.step()
        opt.zero_grad()


class Gan(Module):
    """Two optimizers, each stepped under `toggle_model`, as Lightning's GAN pattern has
    them, each synchronising every other batch and accumulating locally
    (`sync_grad=False`) in between: several backwards inside one DDP forward, a local
    one first (even batches) or after a synchronised one (odd batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], index: int) -> None:
        x, odd = batch[0], index % 2 == 1
        plan = zip(self.optimizers(), (self._first, self._second), (odd, not odd), strict=True)
        for opt, loss, sync in plan:
            with opt.toggle_model(sync_grad=sync):  # the other optimizer's parameters frozen
                self.manual_backward(loss(x))
                if sync:
                    opt.step()
                    opt.zero_grad()

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        return (self.net(x) + self.side(x)).square().mean()

    def _second(self, x: torch.Tensor) -> torch.Tensor:
        return (self.side(x) - self.net(x)).abs().mean()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.net.parameters(), lr=1e-2),
            torch.optim.SGD(self.side.parameters(), lr=0.1),
        ]


def _loader() -> torch.utils.data.DataLoader:
    data = torch.randn(32, 6, generator=torch.Generator().manual_seed(3))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)


def _fit(
    strategy: Any,
    tmp: Path,
    steps: int,
    module: Module | None = None,
    ckpt: str | None = None,
    **kw: Any,
) -> Any:
    module = module or Module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        default_root_dir=str(tmp),
        enable_checkpointing=False,
        **QUIET,
        **kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and log intervals
        trainer.fit(module, _loader(), ckpt_path=ckpt)
    return trainer, module


def _fit_state(trainer: Any, module: Module) -> dict[str, Any]:
    return {"params": _params(module), "opt": trainer.optimizers[0].state_dict()["state"]}


def case_trainer_accumulate(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """accumulate_grad_batches=2, gradient_clip_val, a checkpoint, and a resumed fit."""
    name = {"torch": "ddp", "lockstep": "lockstep"}[engine]  # the registered names
    kw = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    trainer, module = _fit(name, tmp / engine, 3, **kw)
    path = tmp / engine / "last.ckpt"
    trainer.save_checkpoint(path)
    straight = _fit_state(trainer, module)
    trainer, module = _fit(name, tmp / engine, 5, ckpt=str(path), **kw)
    keys = sorted(torch.load(path, weights_only=False)["state_dict"])
    resumed = _fit_state(trainer, module)
    return {"straight": straight, "resumed": resumed, "keys": keys, "wrapper": module.wrapper}


def case_trainer_ddp_args(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """find_unused_parameters, static_graph, bf16-mixed, manual optimization, the GAN pattern.

    Not here: `ddp_comm_hook`, which Lightning registers on CUDA only (on CPU the run
    would train without the hook): tests/gpu/test_lightning_comm_hook.py.
    """
    runs = {
        "unused": ({"find_unused_parameters": True}, Module(use_side_every=2), {}),
        "static": ({"static_graph": True}, Module(), {}),
        "bf16": ({}, Module(), {"precision": "bf16-mixed"}),
        "manual": ({}, Manual(), {}),
        "gan": ({"find_unused_parameters": True}, Gan(), {}),
    }
    out = {}
    for key, (strategy_kw, module, trainer_kw) in runs.items():
        strategy = TRAINER[engine](**strategy_kw)
        trainer, module = _fit(strategy, tmp / engine, 3, module, **trainer_kw)
        out[key] = _fit_state(trainer, module)
    return out


def case_unused_hint(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """A parameter the loss never uses, without find_unused_parameters: both engines raise
    at the second step, and Lightning adds its hint to the message (it matches torch's
    "Expected to have finished reduction in the prior iteration")."""
    try:
        _fit(TRAINER[engine](), tmp / engine, 3, Module(use_side_every=1000))
    except RuntimeError as exc:
        return {"raised": "RuntimeError", "hint": "LightningModule has parameters" in str(exc)}
    return {"raised": None}


CASES = {
    name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")
}
