"""Ways to read every gradient for NaN/inf, side by side inside a real backward (one process).

    python benchmarks/finite_ops.py                       # every workload, every variant
    python benchmarks/finite_ops.py --workloads mlp-8x1024 --reps 8 --steps 5

Which read of the gradients does the non-finite check (`runtime/finite.py`) cost
least? Each variant trains the workload's model alone (no process group, one
thread) with hooks that do what the DDP engine's do: each fresh gradient is
multiplied by 1/2 into its slot of a flat bucket (the layout the engine builds:
1 MiB first bucket, 25 MiB after), and a complete bucket is "launched". Variants:

| variant | when | what it reads |
|---|---|---|
| off | - | nothing (the copies alone) |
| bucket.<op> | at the bucket's launch | the whole bucket, with <op> |
| param.sum | in each hook, after the copy | the gradient's slot (still in cache) |
| param.sum_out | the same, `torch.sum(..., out=)` into a preallocated slot | |
| param.grad_sum | in each hook, before the copy | autograd's gradient |
| hybrid.<KiB> | in the hook for slots of <KiB> and more; the rest at launch | |
| chunked.<KiB> | slots of 256 KiB and more: copied in <KiB> chunks, each summed | |
| | right after its copy (in the core's cache); the rest at launch | |
| result.<N> | at the launch, 1/N of the bucket (what one of N ranks would read | |
| | of a reduced result, cold: no attribution to a rank) | |

Variants take turns (A..Z then Z..A) over `--reps` repetitions of `--steps` steps.
Reported, median per step over repetitions (CPU time of the main thread,
`time.thread_time`): the hooks' and launches' work, the copies included (they
differ between variants), that work minus "off"'s in the same repetition (what the
check costs), and the whole step's CPU time minus "off"'s (cache effects on later
work included, but noisier).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

from lockstep.runtime.bucketing import assign_buckets, param_specs

KIB = 1024
BUCKET_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda b: b.sum(dtype=torch.float32),
    "aminmax": lambda b: torch.stack(torch.aminmax(b)),
    "isfinite_all": lambda b: torch.isfinite(b).all(),
    "dot": lambda b: torch.dot(b, b),
    "int_amax": lambda b: (b.view(torch.int32) & 0x7FFFFFFF).amax(),
}


class Sim:
    """The engine's hooks around one workload's model: copies into buckets, one check."""

    def __init__(self, name: str, variant: str) -> None:
        self.work = WORKLOADS[name]
        self.model = build(name)
        params = [p for p in self.model.parameters() if p.requires_grad]
        named = [(str(i), p) for i, p in enumerate(params)]
        groups = assign_buckets(param_specs(named), None, first_cap_bytes=1 << 20)
        self.bucket_of: dict[int, int] = {}
        self.buffers, self.views, self.pending_init = [], {}, []
        for b, group in enumerate(groups):
            buffer = torch.zeros(sum(params[i].numel() for i in group))
            offset = 0
            for i in group:
                n = params[i].numel()
                self.views[i] = buffer[offset : offset + n].view_as(params[i])
                self.bucket_of[i] = b
                offset += n
            self.buffers.append(buffer)
            self.pending_init.append(len(group))
        self.variant = variant
        self.half = torch.tensor(0.5)
        self.sums: list[torch.Tensor] = []
        self.slots = torch.zeros(len(params))
        self.slot_of = {i: self.slots[i] for i in range(len(params))}
        self.in_hook, self.spans = self._plan(groups, params)
        self.check_cpu = 0.0
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def _plan(self, groups: list[list[int]], params: list) -> tuple[set[int], list[list]]:
        """hybrid.<KiB>: slots summed in their hook, and each bucket's spans of the rest."""
        if self.variant.startswith("chunked."):
            threshold = CHUNK_MIN
        elif self.variant.startswith("hybrid."):
            threshold = int(self.variant.split(".")[1]) * KIB
        else:
            return set(), [[] for _ in groups]
        in_hook = {i for i, p in enumerate(params) if p.numel() * 4 >= threshold}
        spans: list[list[torch.Tensor]] = []
        for b, group in enumerate(groups):
            runs, start, offset = [], None, 0
            for i in group:
                n = params[i].numel()
                if i in in_hook:
                    if start is not None:
                        runs.append(self.buffers[b][start:offset])
                    start = None
                elif start is None:
                    start = offset
                offset += n
            if start is not None:
                runs.append(self.buffers[b][start:offset])
            spans.append(runs)
        return in_hook, spans

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            view, variant = self.views[index], self.variant
            grad = param.grad
            t = time.thread_time()
            if variant == "param.grad_sum":
                self.sums.append(grad.sum(dtype=torch.float32))
            chunked = variant.startswith("chunked.") and index in self.in_hook
            if chunked:
                self._chunked(grad, view, int(variant.split(".")[1]) * KIB // 4)
            else:
                torch.mul(grad, self.half, out=view)
            param.grad = view
            if (variant == "param.sum" or index in self.in_hook) and not chunked:
                self.sums.append(view.sum(dtype=torch.float32))
            elif variant == "param.sum_out":
                torch.sum(view.view(-1), 0, dtype=torch.float32, out=self.slot_of[index])
            self.check_cpu += time.thread_time() - t
            b = self.bucket_of[index]
            self.pending[b] -= 1
            if self.pending[b] == 0:
                self._launch(b)

        return hook

    def _chunked(self, grad: torch.Tensor, view: torch.Tensor, chunk: int) -> None:
        """The copy in chunks that fit the core's cache, each summed right after it."""
        for src, dst in zip(grad.view(-1).split(chunk), view.view(-1).split(chunk), strict=True):
            torch.mul(src, self.half, out=dst)
            self.sums.append(dst.sum(dtype=torch.float32))

    def _launch(self, b: int) -> None:
        t = time.thread_time()
        if self.variant.startswith("result."):  # 1/N of the bucket: a rank's share of a result
            shard = self.buffers[b][: self.buffers[b].numel() // int(self.variant[-1])]
            self.sums.append(shard.sum(dtype=torch.float32))
        if self.variant.startswith("bucket."):
            self.sums.append(BUCKET_OPS[self.variant.split(".", 1)[1]](self.buffers[b]))
        for span in self.spans[b]:
            self.sums.append(span.sum(dtype=torch.float32))
        self.check_cpu += time.thread_time() - t

    def _verdict(self) -> None:
        t = time.thread_time()
        if self.sums:
            flags = torch.stack([s.float() for s in self.sums]).isfinite().logical_not().sum()
            assert int(flags) == 0
        elif self.variant == "param.sum_out":
            assert int(self.slots.isfinite().logical_not().sum()) == 0
        self.sums = []
        self.check_cpu += time.thread_time() - t

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
        """One step; (its CPU seconds, the check's CPU seconds)."""
        self.pending = list(self.pending_init)
        self.check_cpu = 0.0
        cpu = time.thread_time()
        self.opt.zero_grad()
        self.work.loss(self.model(batch[0]), batch[1]).backward()
        self._verdict()
        self.opt.step()
        return time.thread_time() - cpu, self.check_cpu


HOOK_VARIANTS = ("param.sum", "param.sum_out", "param.grad_sum", "hybrid.64", "hybrid.256")
OTHER_VARIANTS = ("chunked.256", "chunked.1024", "result.2", "result.4")
CHUNK_MIN = 256 * KIB


def variants(name: str) -> list[str]:
    return ["off", *(f"bucket.{op}" for op in BUCKET_OPS), *HOOK_VARIANTS, *OTHER_VARIANTS]


def measure(name: str, reps: int, steps: int) -> dict[str, dict[str, float]]:
    names = variants(name)
    sims = {v: Sim(name, v) for v in names}
    gen = torch.Generator().manual_seed(0)
    batch = WORKLOADS[name].batch(gen)
    for sim in sims.values():
        for _ in range(2):
            sim.step(batch)
    step_cpu: dict[str, list[float]] = {v: [] for v in names}
    check_cpu: dict[str, list[float]] = {v: [] for v in names}
    for rep in range(reps):
        for v in names if rep % 2 == 0 else names[::-1]:
            figures = [sims[v].step(batch) for _ in range(steps)]
            step_cpu[v].append(statistics.median(f[0] for f in figures))
            check_cpu[v].append(statistics.median(f[1] for f in figures))
    out = {}
    for v in names:
        extra = [a - b for a, b in zip(step_cpu[v], step_cpu["off"], strict=True)]
        check = [a - b for a, b in zip(check_cpu[v], check_cpu["off"], strict=True)]
        out[v] = {
            "step": 1e3 * statistics.median(step_cpu[v]),
            "hooks": 1e3 * statistics.median(check_cpu[v]),
            "check": 1e3 * statistics.median(check),
            "extra": 1e3 * statistics.median(extra),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {Path('/proc/loadavg').read_text().split()[:3]}")
    print(
        "| workload | variant | step cpu ms | hooks + launches cpu ms | the same - off's "
        "| step - off's, cpu ms |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        for v, m in measure(name, args.reps, args.steps).items():
            print(
                f"| {name} | {v} | {m['step']:.2f} | {m['hooks']:.3f} | {m['check']:+.3f} "
                f"| {m['extra']:+.3f} |"
            )


if __name__ == "__main__":
    main()
