"""Training scripts written for torch's DDP, run unchanged with either class.

Each scenario takes the wrapper class (`torch.nn.parallel.DistributedDataParallel`
or `lockstep.DistributedDataParallel`) and returns what the script left behind:
parameters, gradients, buffers, flags. The tests compare lockstep's result with
torch's, rank by rank: the oracle is torch DDP itself. Where the numbers cannot tell
whether an argument was honoured, a scenario also returns what was `seen` from
outside the engine: the backend's all-reduces (torch's profiler) and the buckets.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import torch
from engine_models import MLP, WithBatchNorm, WithUnused
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

FLOATING = {"float", "double", "c10::Half", "c10::BFloat16"}


def batches(ctx, steps: int, per_rank: int = 4, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(per_rank * ctx.world_size, 8, generator=gen)
        y = torch.randn(per_rank * ctx.world_size, 4, generator=gen)
        out.append((x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]))
    return out


def built(cls: type[nn.Module], perturb_rank: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = cls()
    if perturb_rank is not None and torch.distributed.get_rank() == perturb_rank:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.add_(0.25)
    return model


def result(model: nn.Module, **extra) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        **extra,
    }


def train(ddp, model, data, micro: int = 1, seen: list | None = None, **loss_kwargs) -> None:
    """SGD over `data`; with `seen`, each step's floating-point all-reduces are appended."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y) -> None:
        opt.zero_grad()
        for k, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            ddp.require_backward_grad_sync = k == micro - 1
            ((ddp(xs, **loss_kwargs) - ys) ** 2).mean().backward()
        opt.step()

    if seen is None:
        for x, y in data:
            step(x, y)
        return
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for x, y in data:
            with record_function(STEP):
                step(x, y)
    seen.extend(float_all_reduces(prof.events()))


# ------------------------------------------------------------- observations
STEP = "dropin-scenario-step"


def float_all_reduces(events) -> list[list[int]]:
    """From torch's profiler: per training step, the element count of each floating-point
    all-reduce the backend ran in it, in the order they started.

    Seen from outside either class: gradient buckets and delayed buffers are floating
    point; lockstep's step fingerprint and the used-parameter vote are integers.
    """
    steps = sorted((e.time_range for e in events if e.name == STEP), key=lambda r: r.start)
    reduces = sorted(
        (
            e
            for e in events
            if e.name == "gloo:all_reduce" and e.input_dtypes and e.input_dtypes[0] in FLOATING
        ),
        key=lambda e: e.time_range.start,
    )
    return [
        [math.prod(e.input_shapes[0]) for e in reduces if r.start <= e.time_range.start <= r.end]
        for r in steps
    ]


def bucket_layout(ddp) -> list[list[str]]:
    """Parameter names per bucket, in launch order, as each class shows them.

    The one place that reads a private interface: torch's class describes its rebuilt
    buckets only in its logging data (indices into the trainable parameters).
    """
    if hasattr(ddp, "bucket_layout"):  # lockstep's engine, under its name or torch's
        return ddp.bucket_layout()
    names = [n for n, p in ddp.module.named_parameters() if p.requires_grad]
    cut = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    return [[names[int(i)] for i in bucket.split()] for bucket in cut.split(",")]


# ------------------------------------------------------------------ scenarios
def positional(DDP, ctx):
    model = built(MLP, perturb_rank=1)
    ddp = DDP(model, None, None, 0, None, True, None, 25, False, False, True)
    train(ddp, model, batches(ctx, 3))
    return result(model)


def toggle_sync(DDP, ctx):
    """The attribute, not no_sync(): three micro-batches, the last one synchronised."""
    model = built(WithBatchNorm, perturb_rank=1)
    ddp = DDP(model)
    flags = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(ctx, 3):
        opt.zero_grad()
        for k, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            ddp.require_backward_grad_sync = k == 1
            flags.append(ddp.will_sync_module_buffers())
            ((ddp(xs) - ys) ** 2).mean().backward()
            flags.append(ddp.require_forward_param_sync)
        opt.step()
    steps = getattr(getattr(ddp.reducer, "driver", None), "steps", None)
    return result(model, flags=flags, synced_steps=steps)


class Reentrant(nn.Module):
    """One block run twice under reentrant checkpointing, and one unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True)
        return self.out(h)


def static_reentrant(DDP, ctx):
    model = built(Reentrant, perturb_rank=1)
    ddp = DDP(model, static_graph=True)
    train(ddp, model, batches(ctx, 4))
    return result(model)


def set_static_graph(DDP, ctx):
    model = built(Reentrant)
    ddp = DDP(model)
    ddp._set_static_graph()
    train(ddp, model, batches(ctx, 3))
    return result(model)


def no_sync_unused(DDP, ctx):
    """`sometimes` is used in the accumulated micro-batch only: its gradient must travel."""
    model = built(WithUnused)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(ctx, 3):
        opt.zero_grad()
        with ddp.no_sync():
            ((ddp(x[:2], use_sometimes=True) - y[:2]) ** 2).mean().backward()
        ((ddp(x[2:]) - y[2:]) ** 2).mean().backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return dict(result(model), grads=grads)


class Scalar(nn.Module):
    """torch's own create_graph test model: one scalar parameter, squared."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self):
        return self.p.pow(2)


def create_graph(DDP, ctx, gradient_as_bucket_view: bool = False):
    model = built(Scalar)
    with torch.no_grad():
        model.p.add_(ctx.rank)  # init_sync makes them equal
    ddp = DDP(model, gradient_as_bucket_view=gradient_as_bucket_view)
    grads, with_graph = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            (ddp() * (1 + ctx.rank)).backward(create_graph=True)
            grads.append(model.p.grad.detach().clone())
            with_graph.append(model.p.grad.requires_grad)
    said = sum("not synchronised" in str(w.message) for w in caught)  # lockstep's own
    return dict(result(model), grads=grads, with_graph=with_graph, warnings=said)


def create_graph_views(DDP, ctx):
    return create_graph(DDP, ctx, gradient_as_bucket_view=True)


def join(DDP, ctx, divide_by_initial: bool = True, model_cls=WithBatchNorm):
    """Rank r has 2 + r batches; the ranks that run out shadow the others."""
    model = built(model_cls, perturb_rank=1)
    ddp = DDP(model)
    data = batches(ctx, 2 + ctx.rank, seed=ctx.rank)
    with ddp.join(divide_by_initial_world_size=divide_by_initial):
        train(ddp, model, data)
    train(ddp, model, batches(ctx, 1, seed=9))  # training goes on after the context
    return result(model)


def join_by_remaining(DDP, ctx):
    return join(DDP, ctx, divide_by_initial=False, model_cls=MLP)


def join_unused(DDP, ctx):
    """Join with find_unused_parameters: the shadow also takes part in the used vote."""
    model = built(WithUnused, perturb_rank=1)
    ddp = DDP(model, find_unused_parameters=True)
    with ddp.join():
        train(ddp, model, batches(ctx, 2 + ctx.rank, seed=ctx.rank), use_sometimes=True)
    return result(model)


def join_accumulate(DDP, ctx):
    """Join with two micro-batches a step: joined ranks learn which forwards synchronise."""
    model = built(MLP, perturb_rank=1)
    ddp = DDP(model)
    with ddp.join():
        train(ddp, model, batches(ctx, 1 + ctx.rank, seed=ctx.rank), micro=2)
    return result(model)


def join_throw(DDP, ctx):
    """throw_on_early_termination: every rank raises once the first runs out."""
    model = built(MLP)
    ddp = DDP(model)
    raised = None
    try:
        with ddp.join(throw_on_early_termination=True):
            train(ddp, model, batches(ctx, 1 + ctx.rank, seed=ctx.rank))
    except RuntimeError as error:
        raised = type(error).__name__
    return result(model, raised=raised)


def pickled(DDP, ctx):
    """Save and deep-copy the wrapper after a step; both copies train on."""
    model = built(MLP, perturb_rank=1)
    ddp = DDP(model)
    train(ddp, model, batches(ctx, 1))
    buffer = io.BytesIO()
    torch.save(ddp, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    deep = copy.deepcopy(ddp)
    train(loaded, loaded.module, batches(ctx, 2, seed=1))
    train(deep, deep.module, batches(ctx, 2, seed=2))
    return {"loaded": result(loaded.module), "deep": result(deep.module)}


def init_sync_off(DDP, ctx):
    model = built(MLP, perturb_rank=1)
    ddp = DDP(model, init_sync=False)
    train(ddp, model, batches(ctx, 2))
    return result(model)


def buffers_not_synced(DDP, ctx):
    model = built(WithBatchNorm, perturb_rank=1)
    ddp = DDP(model, forward_sync_buffers=False)
    train(ddp, model, batches(ctx, 2))
    return result(model)


def broadcast_buffers_off(DDP, ctx):
    model = built(WithBatchNorm, perturb_rank=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DDP(model, broadcast_buffers=False)
    train(ddp, model, batches(ctx, 2))
    return result(model, broadcast=ddp.broadcast_buffers)


def skip_unused(DDP, ctx):
    """Only `fc` gets gradients; a bucket holding none of them is not all-reduced."""
    model = built(WithUnused)
    kwargs = {"find_unused_parameters": True, "skip_all_reduce_unused_params": True}
    ddp = DDP(model, bucket_cap_mb=0.0001, **kwargs)  # `never` gets buckets of its own
    seen: list = []
    train(ddp, model, batches(ctx, 3), seen=seen)
    # torch does not rebuild its buckets with find_unused_parameters, nor tell them.
    layout = bucket_layout(ddp) if DDP is not nn.parallel.DistributedDataParallel else None
    return result(model, seen={"all_reduced": seen, "layout": layout})


def delayed(DDP, ctx):
    """The oracle is torch DDP without the delay: the same average (bitwise at N = 2).

    torch's own delayed all-reduce is launched and never waited for, so on gloo the
    optimizer may read the buffer before it is reduced: a race, not an oracle.
    """
    model = built(MLP, perturb_rank=1)
    last = model.net[4]
    delay = {
        "delay_all_reduce_named_params": [("net.4.weight", last.weight), ("net.4.bias", last.bias)],
        "param_to_hook_all_reduce": model.net[0].weight,
    }
    ddp = DDP(model, **delay) if DDP is not nn.parallel.DistributedDataParallel else DDP(model)
    seen: list = []
    train(ddp, model, batches(ctx, 3), seen=seen)
    grads = [last.weight.grad, last.bias.grad]
    storages = {(g.untyped_storage().data_ptr(), g.untyped_storage().nbytes()) for g in grads}
    layout = bucket_layout(ddp) if DDP is not nn.parallel.DistributedDataParallel else None
    return result(model, seen={"all_reduced": seen, "layout": layout, "storages": storages})


# Per-bucket caps (MiB) whose cut differs from one cap, and from a first cap and a second.
BUCKET_CAPS_MB = [0.00025, 0.001, 0.00005]


def bucket_list(DDP, ctx):
    """Seen: the buckets, and the all-reduces once both classes have rebuilt them.

    The first step's all-reduces differ: torch cuts its first buckets in registration
    order, lockstep in reverse; both rebuild in the order gradients arrived.
    """
    model = built(MLP)
    ddp = DDP(model, bucket_cap_mb_list=BUCKET_CAPS_MB)
    seen: list = []
    train(ddp, model, batches(ctx, 3), seen=seen)
    return result(model, seen={"all_reduced": seen[1:], "layout": bucket_layout(ddp)})


def batched_copy(DDP, ctx, batched: bool = True):
    """One parameter per bucket, so both classes cut the same buffers: at world size 3 the
    bits then show the arithmetic, copies divided by 3 with their bucket (batched) or
    each gradient multiplied by 1/3 on its way in (not batched). A cap list, because
    torch's first step ignores `bucket_cap_mb` and puts every gradient in one bucket."""
    model = built(MLP, perturb_rank=1)
    ddp = DDP(
        model,
        gradient_as_bucket_view=False,
        batched_grad_copy=batched,
        bucket_cap_mb_list=[1e-6],
    )
    train(ddp, model, batches(ctx, 3), micro=2)
    return result(model)


def copy_per_param(DDP, ctx):
    """batched_copy without the flag: the control that shows the bits can differ."""
    return batched_copy(DDP, ctx, batched=False)


def ignored(DDP, ctx):
    model = built(MLP, perturb_rank=1)
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["net.0.bias"])
    ddp = DDP(model)
    train(ddp, model, batches(ctx, 2))
    return result(model)


def mesh(DDP, ctx):
    from torch.distributed.device_mesh import init_device_mesh

    model = built(MLP, perturb_rank=1)
    ddp = DDP(model, device_mesh=init_device_mesh("cpu", (ctx.world_size,)))
    train(ddp, model, batches(ctx, 2))
    return result(model)


def autocast_bf16(DDP, ctx):
    model = built(MLP, perturb_rank=1)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(ctx, 3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return result(model)


def _mixed_precision_by_hand(ctx, reduce_dtype) -> dict:
    """torch's mixed-precision arithmetic written out with the native all-reduce.

    torch's own class needs accelerator events for it ("cpu backend doesn't support
    events"), so on CPU this is the oracle: bf16 compute, the sum in reduce_dtype, the
    division, rounding to bf16, upcast for an fp32 optimizer step.
    """
    dist = torch.distributed
    model = built(WithBatchNorm, perturb_rank=1)
    params, buffers = list(model.parameters()), list(model.buffers())
    for tensor in params + buffers:
        dist.broadcast(tensor.data, 0)
    for buffer in buffers:
        buffer.data = buffer.to(torch.bfloat16)
    opt = torch.optim.SGD(params, lr=0.1)
    for x, y in batches(ctx, 3):
        opt.zero_grad()
        full = [p.data for p in params]
        for p in params:
            p.data = p.data.to(torch.bfloat16)
        for buffer in buffers:
            dist.broadcast(buffer, 0)
        ((model(x.to(torch.bfloat16)) - y) ** 2).mean().backward()
        for p, f in zip(params, full, strict=True):
            wire = p.grad.to(reduce_dtype)
            dist.all_reduce(wire)
            grad = wire.div_(ctx.world_size).to(torch.bfloat16)
            p.grad, p.data = None, f
            p.grad = grad.to(f.dtype)
        opt.step()
    return result(model, dtypes=[str(p.dtype) for p in params])


def mixed_precision(DDP, ctx, reduce_dtype=torch.float32):
    from torch.nn.parallel.distributed import _MixedPrecision

    if DDP is nn.parallel.DistributedDataParallel:
        return _mixed_precision_by_hand(ctx, reduce_dtype)
    model = built(WithBatchNorm, perturb_rank=1)
    config = _MixedPrecision(torch.bfloat16, reduce_dtype, torch.bfloat16)
    ddp = DDP(model, mixed_precision=config)
    train(ddp, model, batches(ctx, 3))
    return result(model, dtypes=[str(p.dtype) for p in model.parameters()])


def mixed_precision_bf16_reduce(DDP, ctx):
    return mixed_precision(DDP, ctx, reduce_dtype=torch.bfloat16)


SCENARIOS = {
    f.__name__: f
    for f in [
        positional,
        toggle_sync,
        static_reentrant,
        set_static_graph,
        no_sync_unused,
        create_graph,
        create_graph_views,
        join,
        join_by_remaining,
        join_unused,
        join_accumulate,
        join_throw,
        pickled,
        init_sync_off,
        buffers_not_synced,
        broadcast_buffers_off,
        skip_unused,
        delayed,
        bucket_list,
        batched_copy,
        ignored,
        mesh,
        autocast_bf16,
        mixed_precision,
        mixed_precision_bf16_reduce,
    ]
}
# Run only where a test asks for them (controls of an observation).
CONTROLS = {f.__name__: f for f in [copy_per_param]}


def run_all(ctx, names: list[str]) -> dict:
    """On every rank: each scenario with lockstep's class and with torch's."""
    import lockstep

    out = {}
    for name in names:
        for engine, cls in [("lockstep", lockstep.DistributedDataParallel), ("torch", nn.parallel.DistributedDataParallel)]:
            torch.distributed.barrier()
            try:
                out[(name, engine)] = {**SCENARIOS, **CONTROLS}[name](cls, ctx)
            except Exception as error:  # reported by the test, with the scenario's name
                out[(name, engine)] = {"error": f"{type(error).__name__}: {error}"}
    return out
