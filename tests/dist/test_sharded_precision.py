"""The mixed-precision policy trains exactly like torch's `fully_shard` with the same policy.

Two gloo ranks train TinyGPT (stage 3: one unit per block, the rest in the root)
with `param_dtype=bf16`: once with `reduce_dtype=fp32` (torchtitan's default),
once reducing in bf16. torch FSDP2 gets the same policy on every block and on
the root. The arithmetic is the same (each shard cast to bf16 and gathered, bf16
compute, the gradient cast to the reduce dtype, a sum of two addends and a
halving, which are exact and order-free at world size 2, cast back to fp32 and
added to the fp32 shard gradient, AdamW on fp32 shards), so losses and final
fp32 parameters must be bitwise equal, for stages 1, 2 and 3; also when an
fp32 buffer makes a block's input fp32 (each unit casts its inputs). Gradient
accumulation under no_sync (FSDP2: `set_requires_gradient_sync(False)`) must
accumulate in the reduce dtype as FSDP2 does, and the step fingerprint must
still name a rank that accumulates alone.
"""

from __future__ import annotations

import pytest
import torch
from sharded_cases import Block, TinyGPT, build, global_batches, loss_of
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

import lockstep
from lockstep.errors import NonFiniteGradientError, RankMismatchError
from lockstep.testing import run_ranks
from lockstep.testing.mesh import device_mesh

BF16, FP32 = torch.bfloat16, torch.float32
ENGINES = ("fsdp2", "stage1", "stage2", "stage3")


class ShiftedGPT(TinyGPT):
    """TinyGPT plus an fp32 buffer on the embeddings: the first block's input is fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.randn(16, generator=torch.Generator().manual_seed(3)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1])) + self.shift
        for block in self.blocks:
            x = block(x)  # cast to bf16 on the way in (each unit casts its inputs)
        return self.head(self.ln_f(x))


def _wrap(engine: str, reduce_dtype: torch.dtype, output: torch.dtype | None, shifted=False):
    torch.manual_seed(0)
    model = ShiftedGPT() if shifted else build("gpt")
    policy = TorchPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype, output_dtype=output)
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        inner = TorchPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
        mesh = device_mesh("cpu")  # explicit: the accelerator's would not fit a CPU model
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=inner)
        return fully_shard(model, mesh=mesh, mp_policy=policy)
    stage = int(engine.removeprefix("stage"))
    ours = lockstep.MixedPrecisionPolicy(BF16, reduce_dtype, output)
    return lockstep.ShardedDataParallel(
        model,
        stage=stage,
        wrap=[Block] if stage == 3 else None,
        mp_policy=policy if stage == 3 else ours,  # torch's policy and ours are both taken
        bucket_cap_mb=0.001,
        first_bucket_cap_mb=0.0005,
    )


def _sync_toggle(model, engine: str, sync: bool) -> None:
    if engine == "fsdp2":
        model.set_requires_gradient_sync(sync)
    else:
        model.require_backward_grad_sync = sync


def _train(ctx, engine: str, reduce_dtype: torch.dtype, micro: int = 1, shifted=False) -> dict:
    output = FP32 if micro == 1 else None
    model = _wrap(engine, reduce_dtype, output, shifted)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, dtypes = [], set()
    for batch in global_batches("gpt", 2):
        mine = [t.chunk(ctx.world_size)[ctx.rank] for t in batch]
        parts = list(zip(*[t.chunk(micro) for t in mine], strict=True))
        for i, part in enumerate(parts):
            _sync_toggle(model, engine, i == len(parts) - 1)
            logits = model(part[0][:, :-1])
            dtypes.add(logits.dtype)
            loss = loss_of("gpt", model, part) / micro
            loss.backward()
        dtypes.update(p.grad.dtype for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float())
    state = model.state_dict()
    if engine == "fsdp2":
        state = {k: getattr(v, "full_tensor", v.detach)() for k, v in state.items()}
    return {"losses": torch.stack(losses), "state": state, "dtypes": sorted(map(str, dtypes))}


def _all(ctx) -> dict:
    out = {}
    for reduce_dtype in (FP32, BF16):
        for engine in ENGINES:
            out[(engine, str(reduce_dtype))] = _train(ctx, engine, reduce_dtype)
    for engine in ("fsdp2", "stage2", "stage3"):
        out[(engine, "no_sync")] = _train(ctx, engine, FP32, micro=2)
    for engine in ("fsdp2", "stage3"):
        out[(engine, "shifted")] = _train(ctx, engine, FP32, shifted=True)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_all, 2, deadline_s=240, timeout_s=60)


def _equal(ref: dict, out: dict, what: str) -> None:
    assert torch.equal(out["losses"], ref["losses"]), f"{what}: losses {out['losses']} {ref}"
    assert list(out["state"]) == list(ref["state"]), f"{what}: keys differ"
    for key, value in ref["state"].items():
        mine = out["state"][key]
        assert mine.dtype == value.dtype == FP32, f"{what}: {key} is {mine.dtype}"
        diff = (mine - value).abs().max().item()
        assert torch.equal(mine, value), f"{what}: {key} differs by {diff:.3g}"


@pytest.mark.parametrize("reduce_dtype", [FP32, BF16])
@pytest.mark.parametrize("engine", ["stage1", "stage2", "stage3"])
def test_policy_matches_torch_fully_shard_bitwise(world2, engine, reduce_dtype):
    for rank, results in enumerate(world2):
        ref, out = results[("fsdp2", str(reduce_dtype))], results[(engine, str(reduce_dtype))]
        _equal(ref, out, f"{engine} reduce {reduce_dtype} vs fully_shard on rank {rank}")
        # forward in bf16, its logits cast to fp32 by output_dtype; fp32 shard gradients
        assert out["dtypes"] == ref["dtypes"] == ["torch.float32"], out["dtypes"]


@pytest.mark.parametrize("engine", ["stage2", "stage3"])
def test_no_sync_accumulates_in_the_reduce_dtype_as_fully_shard(world2, engine):
    for rank, results in enumerate(world2):
        ref, out = results[("fsdp2", "no_sync")], results[(engine, "no_sync")]
        _equal(ref, out, f"{engine} no_sync vs fully_shard on rank {rank}")
        assert "torch.bfloat16" in out["dtypes"], "without output_dtype the logits stay bf16"


def test_each_unit_casts_its_inputs_as_fully_shard(world2):
    for rank, results in enumerate(world2):
        ref, out = results[("fsdp2", "shifted")], results[("stage3", "shifted")]
        _equal(ref, out, f"an fp32 input to a bf16 block, on rank {rank}")


def _uneven_no_sync(ctx) -> str | None:
    model = _wrap("stage2", FP32, None)  # stage 3's forward gathers would hang first
    batch = [t.chunk(2)[ctx.rank] for t in global_batches("gpt", 1)[0]]
    try:
        if ctx.rank == 0:  # an extra micro-batch on rank 0 only
            with model.no_sync():
                loss_of("gpt", model, batch).backward()
        loss_of("gpt", model, batch).backward()
    except RankMismatchError as error:
        return str(error)
    return None


def test_the_fingerprint_names_a_lone_no_sync_under_a_policy():
    errors = run_ranks(_uneven_no_sync, 2, deadline_s=60, timeout_s=20)
    for error in errors:
        assert error is not None, "the fingerprint must catch the lone no_sync"
        assert "rank 0: step 1, data pass 0, 2 micro-batch(es)" in error, error


def _guarantees(ctx, reduce_dtype: torch.dtype) -> dict:
    """One step (its stats), then a NaN loss on rank 1 (the guard must stop every rank)."""
    model = _wrap("stage3", reduce_dtype, None)
    batches = [[t.chunk(2)[ctx.rank] for t in b] for b in global_batches("gpt", 2)]
    loss_of("gpt", model, batches[0]).backward()
    stats = model.step_driver.last_stats
    out = {"payload": stats.payload_bytes, "buckets": len(stats.buckets), "error": None}
    loss = loss_of("gpt", model, batches[1])
    try:
        (loss * float("nan") if ctx.rank == 1 else loss).backward()
    except NonFiniteGradientError as error:
        out["error"] = str(error)
    return out


def _both_reduce_dtypes(ctx) -> dict:
    return {str(d): _guarantees(ctx, d) for d in (FP32, BF16)}


def test_step_stats_and_the_nonfinite_guard_hold_under_a_policy():
    numel = sum(p.numel() for p in build("gpt").parameters())
    for rank, results in enumerate(run_ranks(_both_reduce_dtypes, 2, deadline_s=60)):
        fp32, bf16 = results[str(FP32)], results[str(BF16)]
        assert fp32["buckets"] == bf16["buckets"] == 3, "one bucket per flat: root, 2 blocks"
        # the payload is the gradient in the reduce dtype (padding: a few elements per flat)
        assert 0 <= fp32["payload"] - numel * 4 < 64 and fp32["payload"] == 2 * bf16["payload"]
        for result in (fp32, bf16):
            error = result["error"]
            assert error is not None and "rank(s) 1's own gradients" in error, (rank, error)
            assert f"raised on rank {rank}" in error, error


class TwoDtypes(torch.nn.Module):
    """One unit holding fp32 and fp64 parameters: two flats of one unit, each its own dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _two_dtypes(ctx, split: bool) -> dict:
    torch.manual_seed(0)
    policy = lockstep.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    wrap = [torch.nn.Linear] if split else None  # split: each unit of one dtype only
    model = lockstep.ShardedDataParallel(TwoDtypes(), stage=3, wrap=wrap, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + ctx.rank))
        model(x).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _both_splits(ctx) -> dict:
    return {split: _two_dtypes(ctx, split) for split in (False, True)}


def test_a_unit_of_two_dtypes_casts_each_flat_from_its_own_dtype():
    """Each flat's dtypes come from its own parameters, not from the unit's last group."""
    for rank, out in enumerate(run_ranks(_both_splits, 2, deadline_s=60)):
        together, apart = out[False], out[True]
        assert together["scale"].dtype == torch.float64, together["scale"].dtype
        for key, value in apart.items():
            assert torch.equal(together[key], value), f"rank {rank}: {key}"
