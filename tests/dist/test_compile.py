"""torch.compile and lockstep's wrapper: three ways train as torch DDP does, and no lockstep code
is ever traced into a graph.

The ways: `inner` = DDP(torch.compile(model)), `outer` = torch.compile(DDP(model)),
`blocks` = compile each block, then wrap. Each trains 3 SGD steps at world size 2
(different data per rank) from the same weights as torch's DDP run eagerly (the
oracle); compiled graphs may use decompositions, so agreement is to 1e-6
absolute. The backend is aot_eager: like inductor it goes through AOTAutograd
(one backward node per compiled region, which is what decides overlap), without
inductor's code generation, which is slow on 2 cores. A recording backend keeps
every captured graph: none holds a node whose source is in the lockstep package,
and `outer` captures the same ops as compiling the bare model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # four or compiled ranks: make test, not the inner loop

WAYS = ("inner", "outer", "blocks")
ATOL = 1e-6
LOCKSTEP_DIR = str(Path(lockstep.__file__).parent)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(8), Block(8)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Recorder:
    """An aot_eager backend that keeps the source files of every captured graph's nodes."""

    def __init__(self) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.aot_eager = lookup_backend("aot_eager")
        self.sources: list[str] = []
        self.ops = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        for node in gm.graph.nodes:
            self.sources.append(node.meta.get("stack_trace") or "")
            self.ops += node.op in ("call_function", "call_method", "call_module")
        return self.aot_eager(gm, example_inputs)


def _wrap(way: str, model: Net, backend: Recorder) -> tuple[nn.Module, nn.Module]:
    if way == "inner":
        model = torch.compile(model, backend=backend)
    elif way == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)
    ddp = lockstep.DistributedDataParallel(model)
    return ddp, torch.compile(ddp, backend=backend) if way == "outer" else ddp


def _train(ddp: nn.Module, run: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        opt.zero_grad()
        run(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
    return {name: p.detach().clone() for name, p in ddp.module.named_parameters()}


def _plain(name: str) -> str:
    """A parameter's name without the compiled wrapper's `_orig_mod` part."""
    return name.replace("._orig_mod", "").removeprefix("_orig_mod.")


def _ways(ctx: lockstep.DistContext) -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    oracle_ddp = nn.parallel.DistributedDataParallel(Net())
    results = {"torch": _train(oracle_ddp, oracle_ddp, ctx.rank)}
    bare = Recorder()
    torch._dynamo.reset()
    torch.manual_seed(0)
    torch.compile(Net(), backend=bare)(torch.randn(4, 8))
    results["bare_ops"] = bare.ops
    for way in WAYS:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        backend = Recorder()
        ddp, run = _wrap(way, Net(), backend)
        params = _train(ddp, run, ctx.rank)
        names = {
            k.replace("._orig_mod", "").removeprefix("_orig_mod."): v for k, v in params.items()
        }
        results[way] = {
            "params": names,
            "sources": backend.sources,
            "ops": backend.ops,
            "breaks": [str(reason) for reason in counters["graph_break"]],
        }
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ways, 2, deadline_s=420, timeout_s=300)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("way", WAYS)
def test_compiled_training_matches_torch_ddp(results: list[dict], way: str) -> None:
    for rank, result in enumerate(results):
        ours, oracle = result[way]["params"], result["torch"]
        assert ours.keys() == oracle.keys(), way
        for name in oracle:
            torch.testing.assert_close(
                ours[name], oracle[name], atol=ATOL, rtol=0, msg=f"{way} rank {rank} {name}"
            )
        torch.testing.assert_close(ours, results[0][way]["params"], atol=0, rtol=0)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("way", WAYS)
def test_lockstep_is_never_traced(results: list[dict], way: str) -> None:
    for result in results:
        traced = [s for s in result[way]["sources"] if LOCKSTEP_DIR in s]
        assert not traced, f"{way}: lockstep code inside a captured graph:\n{traced[0]}"
        if way != "blocks":  # the whole model is one graph, with exactly the bare model's ops
            assert result[way]["ops"] == result["bare_ops"], way
        if way == "outer":
            # The wrapper's frame is skipped, as torch's own DDP's is: one break at its edge.
            assert all("DistributedDataParallel.forward" in b for b in result[way]["breaks"]), (
                result[way]["breaks"]
            )
        else:
            assert result[way]["breaks"] == [], result[way]["breaks"]
