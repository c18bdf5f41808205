"""Non-finite gradients are caught at their step, on the rank they appear, before averaging.

Real gloo ranks and a real NaN: rank 1's loss is multiplied by NaN at synchronised
step 5 of 7. By default every rank raises `NonFiniteGradientError` at step 5,
naming rank 1 (and only it), the step and a parameter, and the parameters are
bitwise those after step 4 (the NaN average never reached them). With
nonfinite="skip" the run goes on and ends bitwise equal to an oracle run without
the NaN whose script skips optimizer.step() at step 5 (torch's DDP for the DDP
engine; the sharded engine with the check off for itself). With the check off,
the NaN spreads to every rank (what torch's DDP does), which the tests would see.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_models import MLP
from torch import nn

import lockstep
from lockstep.errors import NonFiniteGradientError, NonFiniteSkipWarning
from lockstep.testing import run_ranks

STEPS, NAN_STEP = 7, 5
NAMES = ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "net.4.weight", "net.4.bias")


def _wrap(engine: str, mode: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = MLP()
    if engine == "torch":
        return model, nn.parallel.DistributedDataParallel(model)
    if engine == "ddp":
        return model, lockstep.DistributedDataParallel(model, nonfinite=mode)
    wrapped = lockstep.ShardedDataParallel(model, stage=int(engine[-1]), nonfinite=mode)
    return wrapped, wrapped


def _train(ctx, engine: str, mode: str, nan_step: int, skip_step: int, steps: int) -> dict:
    """`steps` steps; rank 1's loss is NaN at `nan_step`; the script skips `skip_step`."""
    model, wrapped = _wrap(engine, mode)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(100 * step + ctx.rank)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        opt.zero_grad()
        loss = ((wrapped(x) - y) ** 2).mean()
        if ctx.rank == 1 and step == nan_step:
            loss = loss * float("nan")
        try:
            loss.backward()
        except NonFiniteGradientError as error:
            return {"raised_at": step, "error": str(error), "state": _state(model)}
        if step != skip_step:
            opt.step()
    skipped = getattr(wrapped, "nonfinite", None)
    return {"state": _state(model), "skipped": skipped.skipped if skipped else None}


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _raise_then_oracle(ctx, engine: str) -> dict:
    caught = _train(ctx, engine, "raise", NAN_STEP, -1, STEPS)
    caught["oracle"] = _train(ctx, engine, "off", -1, -1, NAN_STEP - 1)["state"]
    return caught


@pytest.mark.parametrize("engine", ["ddp", "sharded2", "sharded3"])
def test_a_nan_on_rank_1_stops_every_rank_at_its_step_naming_rank_step_and_parameter(engine):
    for rank, result in enumerate(run_ranks(_raise_then_oracle, 2, engine, deadline_s=120)):
        assert result.get("raised_at") == NAN_STEP, (rank, result)
        error = result["error"]
        assert "step 5" in error and "rank(s) 1's own gradients" in error, error
        assert "Ranks with finite gradients: 0." in error, error
        assert f"raised on rank {rank}" in error, error
        assert any(f"rank 1: '{name}' holds NaN" in error for name in NAMES), error
        # Caught before the average: every rank still holds step 4's parameters.
        for mine, oracle in zip(result["state"], result["oracle"], strict=True):
            assert torch.equal(mine, oracle)
            assert torch.isfinite(mine).all()


def _skip_and_oracle(ctx, engine: str, oracle: str) -> dict:
    return {
        "skipped": _train(ctx, engine, "skip", NAN_STEP, -1, STEPS),
        "oracle": _train(ctx, oracle, "off", -1, NAN_STEP, STEPS),
    }


@pytest.mark.parametrize(("engine", "oracle"), [("ddp", "torch"), ("sharded2", "sharded2")])
def test_skip_mode_equals_a_run_that_skips_the_step_bitwise(engine, oracle):
    for result in run_ranks(_skip_and_oracle, 2, engine, oracle, deadline_s=120):
        run = result["skipped"]
        assert "raised_at" not in run and run["skipped"] == 1, run
        for mine, theirs in zip(run["state"], result["oracle"]["state"], strict=True):
            assert torch.equal(mine, theirs)


def _amp_fp16(ctx, engine: str) -> dict:
    """fp16 autocast with a GradScaler whose first scales overflow on purpose (default mode)."""
    model, wrapped = _wrap(engine, "raise")
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    scales = []
    for step in range(1, 5):
        gen = torch.Generator().manual_seed(100 * step + ctx.rank)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = wrapped(x)
        loss = ((out.float() - y) ** 2).mean()
        try:
            scaler.scale(loss).backward()
        except NonFiniteGradientError as error:
            return {"raised_at": step, "error": str(error)}
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"state": _state(model), "scales": scales}


def test_fp16_autocast_overflow_is_left_to_the_grad_scaler():
    """A GradScaler's deliberate inf is not an error: lockstep's default equals torch's DDP."""
    ours = run_ranks(_amp_fp16, 2, "ddp", deadline_s=120)
    torch_ddp = run_ranks(_amp_fp16, 2, "torch", deadline_s=120)
    for rank in range(2):
        assert "raised_at" not in ours[rank], ours[rank].get("error")
        assert ours[rank]["scales"] == torch_ddp[rank]["scales"]
        assert ours[rank]["scales"][0] < 2.0**40  # the scaler did skip overflowing steps
        for mine, theirs in zip(ours[rank]["state"], torch_ddp[rank]["state"], strict=True):
            assert torch.equal(mine, theirs)


def _nan_while_joined(ctx) -> dict:
    """Under DDP's Join, rank 1 runs out after 2 steps; rank 0's third loss is NaN."""
    from torch.distributed.algorithms.join import Join

    _, ddp = _wrap("ddp", "raise")
    steps = 3 if ctx.rank == 0 else 2
    try:
        with Join([ddp]):
            for step in range(1, steps + 1):
                gen = torch.Generator().manual_seed(100 * step + ctx.rank)
                loss = ((ddp(torch.randn(4, 8, generator=gen)) - 1) ** 2).mean()
                (loss * float("nan") if step == 3 else loss).backward()
    except NonFiniteGradientError as error:
        return {"error": str(error)}
    return {"error": None}


def test_a_rank_joined_under_join_raises_with_the_rank_that_found_a_nan():
    """The joined rank shadows the step's fingerprint, which carries the verdict."""
    for rank, result in enumerate(run_ranks(_nan_while_joined, 2, deadline_s=120)):
        error = result["error"]
        assert error is not None, f"rank {rank} did not raise"
        assert "step 3" in error and "rank(s) 0's own gradients" in error, error
        assert "Ranks with finite gradients: 1." in error, error
        assert any(f"rank 0: '{name}' holds NaN" in error for name in NAMES), error


def _skip_warnings(ctx) -> list[str]:
    """The warnings of a "skip" run whose rank 1 loss is NaN at steps 2, 3 and 5."""
    _, wrapped = _wrap("ddp", "skip")
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            gen = torch.Generator().manual_seed(100 * step + ctx.rank)
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
            opt.zero_grad()
            loss = ((wrapped(x) - y) ** 2).mean()
            if ctx.rank == 1 and step in (2, 3, 5):
                loss = loss * float("nan")
            loss.backward()
            opt.step()
    return [str(w.message) for w in caught if w.category is NonFiniteSkipWarning]


def test_skip_mode_says_which_steps_it_skipped():
    said, quiet = run_ranks(_skip_warnings, 2, deadline_s=120)
    assert quiet == []  # rank 0 speaks for the group
    assert len(said) == 2, said  # at 1 and 2 skipped steps (then 4, 8, ...)
    assert "skipped synchronised step 2 (nonfinite='skip')" in said[0], said
    assert "rank 1: 'net." in said[0] and "holds NaN" in said[0], said
    assert "step 3" in said[1] and "2 step(s) skipped so far" in said[1], said
