"""Accelerate and transformers Trainer scripts, each run with torch's DDP and with lockstep's.

`run_all(ctx, tmp)` runs every case twice in the same ranks: with accelerate's
`Accelerator` (torch's engine) and with `lockstep.adopt.accelerate.Accelerator`; the
Trainer case with transformers' `Trainer` and `lockstep.adopt.accelerate.Trainer`.
Each case returns what it can compare: final parameters, optimizer state,
gradients, saved files. Tiny models built in code, data made from seeds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator as TorchAccelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from safetensors.torch import load_file
from torch import nn

from lockstep.adopt.accelerate import Accelerator as LockstepAccelerator

ENGINES = {"torch": TorchAccelerator, "lockstep": LockstepAccelerator}


class Branchy(nn.Module):
    """Two layers and a branch that only some steps use (for find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.out = nn.Linear(16, 3)
        self.side = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h) + (self.side(h) if use_side else 0)


def _batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=gen)


def _accelerator(engine: str, **kwargs: Any) -> Any:
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return ENGINES[engine](cpu=True, **kwargs)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Branchy()


def _with_optimizer(kind: type[torch.optim.Optimizer], **kw: Any) -> tuple[nn.Module, Any]:
    """A fresh model and an optimizer over its own parameters (not another model's)."""
    model = _model()
    return model, kind(model.parameters(), **kw)


def _state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"params": [p.detach().clone() for p in model.parameters()]}
    if opt is not None:
        out["opt"] = opt.state_dict()["state"]
    return out


def _train(acc: Any, model: nn.Module, opt: Any, rank: int, steps: int, **fw: Any) -> None:
    for step in range(steps):
        loss = model(_batch(rank, step), **fw).square().mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


def case_accumulate_clip(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """accumulate() over 2 micro-batches, clip_grad_norm_ at each sync, Adam."""
    acc = _accelerator(engine, gradient_accumulation_steps=2)
    model, opt = acc.prepare(*_with_optimizer(torch.optim.Adam, lr=1e-2))
    for step in range(4):
        with acc.accumulate(model):
            acc.backward(model(_batch(rank, step)).square().mean())
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
    return {**_state(model, opt), "wrapper": type(model).__name__}


def case_trigger_sync(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """no_sync() for two forwards, then trigger_sync_in_backward() for the second backward."""
    acc = _accelerator(engine)
    model, opt = acc.prepare(*_with_optimizer(torch.optim.SGD, lr=0.1))
    with acc.no_sync(model):
        acc.backward(model(_batch(rank, 0)).square().mean())
    with acc.no_sync(model):
        loss = model(_batch(rank, 1)).square().mean()
    with acc.trigger_sync_in_backward(model):
        acc.backward(loss)
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return {**_state(model), "grads": grads}


def case_save_load(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """unwrap_model, save_model (safetensors keys), save_state / load_state and resume."""
    acc = _accelerator(engine)
    model, opt = acc.prepare(*_with_optimizer(torch.optim.Adam, lr=1e-2))
    _train(acc, model, opt, rank, 2)
    where = tmp / engine
    acc.save_model(model, where / "model")
    acc.save_state(str(where / "state"))
    _train(acc, model, opt, rank, 1)  # moves away from the saved state
    acc.wait_for_everyone()
    acc.load_state(str(where / "state"))
    _train(acc, model, opt, rank, 2)
    saved = load_file(str(where / "model" / "model.safetensors"))
    unwrapped = acc.unwrap_model(model)
    return {**_state(model, opt), "saved": saved, "unwrapped": type(unwrapped).__name__}


def _hooked(engine: str, rank: int, hook: str, wrapper: str = "no", **options: Any) -> Any:
    """A comm hook set through DistributedDataParallelKwargs; `hook` is the enum's value.

    The enum itself is passed: Accelerate looks the hook up by enum, and a plain
    string registers no hook at all (a case that then cannot fail).
    """
    kwargs = DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType(hook),
        comm_wrapper=DDPCommunicationHookType(wrapper),
        comm_state_option=options,
    )
    acc = _accelerator(engine, kwargs_handlers=[kwargs])
    try:
        model, opt = acc.prepare(*_with_optimizer(torch.optim.SGD, lr=0.1))
    except TypeError as exc:  # torch refuses bf16 hooks without NCCL: so must lockstep
        return {"refused": type(exc).__name__}
    assert getattr(model, "_comm_hooks", None) or getattr(model, "_hooked", False), "no hook"
    _train(acc, model, opt, rank, 3)
    return _state(model, opt)


def case_comm_hooks(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """fp16, bf16 and PowerSGD hooks set through DistributedDataParallelKwargs, and
    comm_wrapper="fp16" around PowerSGD (whose first steps are plain all-reduces).

    bf16 (hook or wrapper) is refused by torch on a build without NCCL, with TypeError.
    """
    power_sgd = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    return {
        "fp16": _hooked(engine, rank, "fp16"),
        "bf16": _hooked(engine, rank, "bf16"),
        "power_sgd": _hooked(engine, rank, "power_sgd", **power_sgd),
        "fp16_wrapper": _hooked(engine, rank, "power_sgd", "fp16", **power_sgd),
        "bf16_wrapper": _hooked(engine, rank, "power_sgd", "bf16", **power_sgd),
    }


def case_graph_kwargs(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """find_unused_parameters (a branch used every other step) and static_graph."""
    out = {}
    for name, kwargs in (("unused", {"find_unused_parameters": True}), ("static", {})):
        if name == "static":
            kwargs = {"static_graph": True}
        handler = DistributedDataParallelKwargs(**kwargs)
        acc = _accelerator(engine, kwargs_handlers=[handler])
        model, opt = acc.prepare(*_with_optimizer(torch.optim.SGD, lr=0.1))
        for step in range(3):
            use_side = name != "unused" or step % 2 == 1
            acc.backward(model(_batch(rank, step), use_side=use_side).square().mean())
            opt.step()
            opt.zero_grad()
        out[name] = _state(model)
    return out


def case_mixed_bf16(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """mixed_precision="bf16" (autocast on CPU).

    Not here: join_uneven_inputs, which accelerate turns into a no-op on CPU.
    """
    acc = _accelerator(engine, mixed_precision="bf16")
    model, opt = acc.prepare(*_with_optimizer(torch.optim.SGD, lr=0.1))
    _train(acc, model, opt, rank, 2)
    return _state(model)


def case_peft_lora(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """A LoRA adapter (peft) on a 2-layer GPT-2 built from a config; unwrap finds the PeftModel."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    acc = _accelerator(engine)
    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    for step in range(2):
        ids = _tokens(rank, step)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    unwrapped = acc.unwrap_model(model)
    adapter = get_peft_model_state_dict(unwrapped)
    return {**_state(model, opt), "adapter": adapter, "unwrapped": type(unwrapped).__name__}


class Stream(torch.utils.data.IterableDataset):
    """Eight samples from a seed, as a stream: Accelerate then dispatches batches."""

    def __iter__(self) -> Any:
        gen = torch.Generator().manual_seed(7)
        return iter([torch.randn(6, generator=gen) for _ in range(8)])


def case_dispatch_batches(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """An IterableDataset, so dispatch_batches=True (Accelerate's default for one): rank 0
    alone reads the DataLoader and sends every rank its slice; two epochs of two steps.

    The ranks' counts of reads differ by design; lockstep's step fingerprint must not
    take that for uneven data (it once raised RankMismatchError at step 1).
    """
    acc = _accelerator(engine)
    loader = torch.utils.data.DataLoader(Stream(), batch_size=2)
    model, opt, loader = acc.prepare(*_with_optimizer(torch.optim.SGD, lr=0.1), loader)
    seen = []
    for _ in range(2):
        for x in loader:
            seen.append(x.clone())
            acc.backward(model(x).square().mean())
            opt.step()
            opt.zero_grad()
    return {**_state(model), "batches": seen, "dispatcher": type(loader).__name__}


def case_fingerprint(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """Rank 0 accumulates 2 micro-batches per step, rank 1 none: ranks pair different steps.

    torch's DDP pairs the all-reduces silently; lockstep's step fingerprint raises on
    every rank at the first synchronised step, as in a plain script.
    """
    acc = _accelerator(engine, gradient_accumulation_steps=2 if rank == 0 else 1)
    model, opt = acc.prepare(*_with_optimizer(torch.optim.SGD, lr=0.1))
    try:
        for step in range(4 if rank == 0 else 2):
            with acc.accumulate(model):
                acc.backward(model(_batch(rank, step)).square().mean())
                opt.step()
                opt.zero_grad()
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
    return GPT2LMHeadModel(config)


def _tokens(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 64, (2, 12), generator=gen)


CASES = {
    name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")
}
