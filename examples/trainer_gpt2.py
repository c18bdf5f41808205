"""The transformers Trainer on a tiny GPT-2 (built from a config), run on lockstep's engine.

    lockstep run --nproc-per-node 2 --engine lockstep examples/trainer_gpt2.py
    torchrun --nproc-per-node 2 -m lockstep.adopt examples/trainer_gpt2.py
    lockstep run --nproc-per-node 2 examples/trainer_gpt2.py       # torch's engine, to compare

The script is a plain Trainer script: the Trainer hands the model to Accelerate,
which builds torch's DistributedDataParallel, which `--engine lockstep` turns into
lockstep's engine. In code instead: `from lockstep.adopt.accelerate import Trainer`.
Checkpoints go to runs/trainer_gpt2/ every 4 steps; a re-run with `--resume`
continues from the last one. Nothing is downloaded: model and data are made here.
"""

from __future__ import annotations

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

OUT = "runs/trainer_gpt2"


class Tokens(torch.utils.data.Dataset):
    """Sequences that count up modulo the vocabulary: learnable in a few steps."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(16) + i) % 64
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
    args = TrainingArguments(
        output_dir=OUT,
        max_steps=12,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=5e-3,
        save_steps=4,
        logging_steps=4,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint="--resume" in sys.argv[1:])
    if trainer.is_world_process_zero():
        print(f"wrapper {type(trainer.model_wrapped).__name__}")


if __name__ == "__main__":
    main()
