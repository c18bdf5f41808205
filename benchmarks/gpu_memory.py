"""Device memory per rank: lockstep DDP and stages 1-3 against `lockstep plan` and FSDP2.

    PYTHONPATH=src python benchmarks/gpu_memory.py            # on a GPU: 2 gloo ranks, one GPU
    PYTHONPATH=src python benchmarks/gpu_memory.py --smoke    # tiny model; on CPU no device figures

Two gloo ranks hold CUDA tensors on the one GPU (NCCL refuses two ranks on one
device). Each engine trains the GPT of benchmarks/gpu_vs_torch.py's part 2 in
fp32 with AdamW for three steps, alone on the device (the one before is deleted
and the cache emptied). Per rank: the states after a step, before zero_grad
(`torch.cuda.memory_allocated` minus what was allocated before the model was
built: weights, gradients, optimizer state, bucket and gather buffers), the peak
of the step (`torch.cuda.max_memory_allocated`, activations included), and what
`lockstep plan` predicts for the states (`plan/measured.py`, planned_bytes;
FSDP2 is compared with the ZeRO-3 row). On the CPU only the plan column and the
storage count of the states (`measured_bytes`) are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_vs_torch import MID, TINY, gpt, tokens, wrap_sharded
from workloads import _next_token_loss

from lockstep.plan.measured import measured_bytes, planned_bytes
from lockstep.testing import run_ranks

ENGINES = {"ddp": 0, "stage1": 1, "stage2": 2, "stage3": 3, "fsdp2": 3}
MIB = 2**20


def _engine_memory(engine: str, size: dict, device: str, world: int) -> dict:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    plain = gpt(size, device)
    planned = planned_bytes(plain, world, ENGINES[engine]).total
    model = wrap_sharded(engine, plain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    row = {"plan_mib": planned / MIB}
    for step in range(3):
        x, y = tokens(size, device, gen)
        _next_token_loss(model(x), y).backward()
        opt.step()
        if step == 2:
            if cuda:
                row["states_mib"] = (torch.cuda.memory_allocated() - base) / MIB
                row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
            if engine != "fsdp2":  # DTensor parameters have no plain storage to count
                row["storage_mib"] = measured_bytes(model, opt).total / MIB
        opt.zero_grad()
    del model, opt, plain
    return row


def memory_rank(ctx, size: dict, device: str) -> dict:
    if device == "cuda":
        torch.cuda.set_device(0)
    return {e: _engine_memory(e, size, device, ctx.world_size) for e in ENGINES}


def render(out: dict) -> str:
    lines = [f"device: {out['device']}, torch {out['torch']}; MiB per rank (max over ranks)"]
    lines.append(f"{'engine':8} {'plan':>9} {'states':>9} {'peak':>9} {'storages':>9}")
    for engine, row in out["rows"].items():
        cells = [row.get(k) for k in ("plan_mib", "states_mib", "peak_mib", "storage_mib")]
        text = " ".join(f"{c:9.1f}" if c is not None else f"{'-':>9}" for c in cells)
        lines.append(f"{engine:8} {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    size = TINY if args.smoke else MID
    ranks = run_ranks(memory_rank, 2, size, args.device, deadline_s=400, timeout_s=120)
    rows = {e: {k: max(r[e].get(k, 0.0) for r in ranks) for k in ranks[0][e]} for e in ENGINES}
    out = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    print(render(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
