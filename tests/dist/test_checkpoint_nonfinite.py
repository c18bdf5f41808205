"""A diverged run never replaces or prunes its last finite checkpoint.

Real gloo ranks under torch's own DDP (which spreads a NaN to every rank, as the
check-free engines do): rank 1's loss turns NaN at step 5, and the loop saves after
every step with keep=3 and goes on after a failed save, as a careless loop would.
Every save from step 5 on must fail on every rank naming a non-finite tensor; the
directory must still hold steps 2-4, `latest` must name step 4, the refused state
must sit aside (newest only), and a restore must bring back step 4's finite weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from engine_models import MLP
from torch import nn

import lockstep
from lockstep.errors import CheckpointError
from lockstep.testing import run_ranks

STEPS, NAN_STEP = 7, 5


def _diverge_and_save(ctx, directory: str) -> dict:
    torch.manual_seed(0)
    model = MLP()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ckpt = lockstep.Checkpointer(directory, keep=3, timeout_s=20)
    refused, finite_at_4 = {}, None
    for step in range(1, STEPS + 1):
        gen = torch.Generator().manual_seed(100 * step + ctx.rank)
        loss = ((ddp(torch.randn(4, 8, generator=gen)) - 1.0) ** 2).mean()
        if ctx.rank == 1 and step == NAN_STEP:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        try:
            ckpt.save(step, model=ddp, optimizer=opt)
        except CheckpointError as error:
            refused[step] = str(error)
        if step == NAN_STEP - 1:
            finite_at_4 = [p.detach().clone() for p in model.parameters()]
    fresh = MLP()
    restored = lockstep.Checkpointer(directory, timeout_s=20).restore(model=fresh)
    return {
        "refused": refused,
        "restored": restored,
        "params": [p.detach().clone() for p in fresh.parameters()],
        "finite_at_4": finite_at_4,
    }


def test_non_finite_saves_are_refused_and_the_last_finite_checkpoint_survives(tmp_path):
    results = run_ranks(_diverge_and_save, 2, str(tmp_path), deadline_s=120)
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == [
        "latest",
        "step_00000002.pt",
        "step_00000003.pt",
        "step_00000004.pt",
        "step_00000007.nonfinite.pt",
    ], names
    assert (tmp_path / "latest").read_text().strip() == "step_00000004.pt"
    for rank, result in enumerate(results):
        assert sorted(result["refused"]) == [5, 6, 7], result["refused"]
        message = result["refused"][5]
        assert "refused to commit checkpoint step 5" in message, message
        assert "holds NaN" in message and "['model']" in message, message
        assert "step 4" in message and f"raised on rank {rank}" in message, message
        assert result["restored"] == 4
        for mine, expected in zip(result["params"], result["finite_at_4"], strict=True):
            assert torch.isfinite(mine).all() and torch.equal(mine, expected)
    assert Path(tmp_path / "step_00000007.nonfinite.pt").stat().st_size > 0
