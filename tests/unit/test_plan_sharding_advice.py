"""`lockstep plan` names the first ShardedDataParallel stage that fits where DDP does not."""

from __future__ import annotations

from lockstep.cli import main


def test_plan_names_the_first_stage_that_fits(capsys):
    assert main(["plan", "--model", "llama-2-7b", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "DDP does not fit; lockstep.ShardedDataParallel(model, stage=1) (ZeRO-1)" in out
    assert main(["plan", "--model", "llama-2-7b", "--gpus", "4", "--gpu-memory", "40GB"]) == 0
    assert "ShardedDataParallel(model, stage=2) (ZeRO-2)" in capsys.readouterr().out


def test_plan_is_silent_when_ddp_fits_and_says_so_when_nothing_does(capsys):
    assert main(["plan", "--model", "gpt2", "--gpus", "4"]) == 0
    assert "ShardedDataParallel" not in capsys.readouterr().out
    assert main(["plan", "--model", "llama-2-70b", "--gpus", "2"]) == 0
    assert "no strategy fits" in capsys.readouterr().out
