"""LoRA + DDP for real: peft adapters under lockstep's engine put only adapter bytes on the wire."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lockstep.cli import main
from lockstep.testing import run_ranks

# find_spec, not import: importing peft costs seconds, and only the ranks need it.
if importlib.util.find_spec("peft") is None:
    pytest.skip("peft is the `lora` extra: pip install -e '.[lora]'", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lora_ddp.py"
RANK = 4


def _example():
    spec = importlib.util.spec_from_file_location("lora_ddp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _lora_and_full_step(ctx):
    import lockstep

    ex = _example()
    model = ex.add_lora(ex.build_model(), RANK)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in adapters]
    ddp = lockstep.DistributedDataParallel(model)
    opt = torch.optim.AdamW(adapters, lr=1e-2)
    ex.train_step(ddp, opt, ex.batch(0, ctx.rank, ex.GPTConfig(), (1, 3)))

    flat = torch.cat([p.detach().reshape(-1) for p in adapters])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat)

    full = lockstep.DistributedDataParallel(ex.build_model())
    ex.train_step(full, None, ex.batch(0, ctx.rank, ex.GPTConfig(), (1, 3)))
    return {
        "lora_payload": ddp.stats.payload_bytes,
        "lora_payload_property": ddp.payload_bytes,
        "lora_wire": ddp.stats.wire_bytes,
        "adapter_bytes": _nbytes(adapters),
        "peft_trainable": model.get_nb_trainable_parameters()[0],
        "planned_lora": ex.planned_payload(RANK),
        "full_payload": full.stats.payload_bytes,
        "all_param_bytes": _nbytes(full.module.parameters()),
        "planned_full": ex.planned_payload(None),
        "frozen_unchanged": all(
            torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen
        ),
        "adapters_moved": any(not torch.equal(p, b) for p, b in zip(adapters, before, strict=True)),
        "adapters_same_on_all_ranks": all(torch.equal(g, gathered[0]) for g in gathered),
    }


@pytest.mark.slow
@pytest.mark.timeout(240)  # each rank imports peft (and transformers): seconds on a busy machine
def test_lora_payload_is_the_adapter_bytes_and_matches_the_planner(monkeypatch, capsys):
    results = run_ranks(_lora_and_full_step, 2, deadline_s=200)
    for r in results:
        assert r["frozen_unchanged"] and r["adapters_moved"] and r["adapters_same_on_all_ranks"]
        # 4 blocks x (q_proj, v_proj) x (A: r x 128, B: 128 x r), fp32 gradients
        expected = 4 * 2 * (RANK * 128 + 128 * RANK) * 4
        assert r["adapter_bytes"] == expected
        assert r["lora_payload"] == r["lora_payload_property"] == expected
        assert r["peft_trainable"] * 4 == expected
        assert r["planned_lora"] == expected
        assert r["lora_wire"] == expected  # ring at N = 2: 2(N-1)/N = 1
        assert r["full_payload"] == r["all_param_bytes"] == r["planned_full"]
        assert r["full_payload"] > 50 * r["lora_payload"]
    # The same figure from the command line, counting the example's factory on meta.
    monkeypatch.chdir(ROOT)
    args = ["plan", "--model", "examples.lora_ddp:build_model", "--gpus", "2"]
    args += ["--lora-rank", str(RANK), "--weights-dtype", "fp32", "--json", "-"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["payload_bytes"] == results[0]["lora_payload"]
