"""The transformers Trainer, run with transformers' class and with lockstep's (`adopt.accelerate`).

One case: a 2-layer GPT-2 built from a config, gradient_accumulation_steps=2,
max_grad_norm (clipping), a checkpoint at step 2, then a second Trainer that
resumes from it and trains to step 4. Returns the parameters and the optimizer
state after the first run and after the resumed one, and the checkpoint's keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.state import AcceleratorState, GradientState, PartialState
from safetensors.torch import load_file

from lockstep.adopt.accelerate import Trainer as LockstepTrainer

TRAINERS = {"torch": transformers.Trainer, "lockstep": LockstepTrainer}


class Tokens(torch.utils.data.Dataset):
    """32 rows of random token ids, the same on every rank (the Trainer shards them)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (32, 12), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: Path, max_steps: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        save_steps=2,
        save_strategy="steps",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )


def _trainer(engine: str, out: Path, max_steps: int) -> Any:
    from accelerate_cases import tiny_gpt2

    AcceleratorState._reset_state()
    GradientState._reset_state()
    PartialState()  # the ranks' process group already exists
    return TRAINERS[engine](model=tiny_gpt2(), args=_args(out, max_steps), train_dataset=Tokens())


def _state(trainer: Any) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "opt": trainer.optimizer.state_dict()["state"],
    }


def case_trainer(engine: str, rank: int, tmp: Path) -> dict[str, Any]:
    """Train 3 steps (checkpoint at 2), then resume from checkpoint-2 to step 4."""
    out = tmp / engine
    first = _trainer(engine, out, 3)
    first.train()
    straight, wrapper = _state(first), type(first.model_wrapped).__name__
    saved = load_file(str(out / "checkpoint-2" / "model.safetensors"))
    resumed = _trainer(engine, out, 4)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    return {
        "straight": straight,
        "saved_keys": sorted(saved),
        "resumed": _state(resumed),
        "wrapper": wrapper,
    }


CASES = {"trainer": case_trainer}
