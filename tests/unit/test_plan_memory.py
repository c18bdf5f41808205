"""The planner against the classic worked examples, figure for figure (GB = 1e9 bytes)."""

from __future__ import annotations

import json

import pytest

from lockstep.cli import main
from lockstep.plan.memory import Optimizer, Strategy, per_gpu_bytes, replicated_bytes
from lockstep.plan.planner import PlanConfig, make_plan
from lockstep.plan.shape import ModelShape, counted_trainable, full_trainable
from lockstep.plan.units import DType

GB = 1e9


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def _totals_gb(doc: dict) -> dict[str, float]:
    return {name: row["total_bytes"] / GB for name, row in doc["memory"].items()}


def test_7b_fp16_ddp_56gb_and_fully_sharded_14gb_over_4_gpus(capsys):
    # 2-byte weights, 2-byte gradients, 4 bytes of optimizer state per parameter.
    doc = _plan_json(
        capsys, "--model", "7B", "--gpus", "4", "--weights-dtype", "fp16", "--optimizer-bytes", "4"
    )
    ddp, zero3 = doc["memory"]["ddp"], doc["memory"]["zero3"]
    assert (ddp["weights_bytes"], ddp["grads_bytes"], ddp["optimizer_bytes"]) == (
        14 * GB,
        14 * GB,
        28 * GB,
    )
    assert ddp["total_bytes"] == 56 * GB
    assert (zero3["weights_bytes"], zero3["grads_bytes"], zero3["optimizer_bytes"]) == (
        3.5 * GB,
        3.5 * GB,
        7 * GB,
    )
    assert zero3["total_bytes"] == 14 * GB


def test_mixed_precision_adam_75b_on_64_gpus_matches_the_zero_paper(capsys):
    # ZeRO paper, figure 1: 16 bytes per parameter (2 + 2 + 12), Ψ = 7.5B, N = 64.
    doc = _plan_json(capsys, "--model", "7.5B", "--gpus", "64")
    assert doc["bytes_per_param"] == {"weights": 2, "grads": 2, "optimizer": 12}
    totals = _totals_gb(doc)
    assert totals["ddp"] == 120
    assert round(totals["zero1"], 1) == 31.4
    assert round(totals["zero2"], 1) == 16.6
    assert round(totals["zero3"], 1) == 1.9
    # the exact values behind the rounded ones: 2Ψ + 2Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
    assert totals["zero1"] == pytest.approx(30 + 90 / 64)
    assert totals["zero2"] == pytest.approx(15 + 105 / 64)
    assert totals["zero3"] == pytest.approx(120 / 64)


def test_table_states_the_figures_and_units(capsys):
    assert main(["plan", "--model", "7.5B", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    assert "GB = 1e9 bytes" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "120.0 GB" in rows["DDP"] and rows["DDP"].rstrip().endswith("no")
    assert "31.4 GB" in rows["ZeRO-1"] and rows["ZeRO-1"].rstrip().endswith("yes")
    assert "16.6 GB" in rows["ZeRO-2"]
    assert "1.9 GB" in rows["ZeRO-3"]


def test_gradient_payload_fp16_fp32_and_lora(capsys):
    fp16 = _plan_json(capsys, "--model", "7B", "--gpus", "8", "--grads-dtype", "fp16")
    fp32 = _plan_json(capsys, "--model", "7B", "--gpus", "8", "--grads-dtype", "fp32")
    lora = _plan_json(capsys, "--model", "7B", "--gpus", "8", "--trainable", "4M")
    assert fp16["payload_bytes"] == 14 * GB
    assert fp32["payload_bytes"] == 28 * GB
    assert lora["payload_bytes"] == 8 * 10**6  # 4M trainable x 2 bytes = 8 MB


def test_lora_payload_of_llama_2_7b_is_the_adapter_bytes(capsys):
    # peft's well-known figure for LLaMA-2-7B, r=8 on q_proj and v_proj:
    # "trainable params: 4,194,304 || all params: 6,742,609,920"
    doc = _plan_json(capsys, "--model", "llama-2-7b", "--lora-rank", "8", "--gpus", "8")
    assert doc["model"]["trainable_params"] == 4_194_304
    assert doc["model"]["total_params"] == 6_742_609_920
    assert doc["payload_bytes"] == 4_194_304 * 2  # 8 MiB, about 8 MB
    ddp = doc["memory"]["ddp"]
    assert ddp["weights_bytes"] == 6_742_609_920 * 2  # frozen base + adapters
    assert ddp["grads_bytes"] == 4_194_304 * 2  # only the adapters get gradients
    assert ddp["optimizer_bytes"] == 4_194_304 * 12


def test_sharding_rules_per_strategy():
    full = replicated_bytes(1000, 100, 2, 4, 12)
    assert (full.weights, full.grads, full.optimizer) == (2000, 400, 1200)
    expected = {
        Strategy.DDP: (2000, 400, 1200),
        Strategy.ZERO1: (2000, 400, 300),
        Strategy.ZERO2: (2000, 100, 300),
        Strategy.ZERO3: (500, 100, 300),
    }
    for strategy, parts in expected.items():
        share = per_gpu_bytes(full, strategy, 4)
        assert (share.weights, share.grads, share.optimizer) == parts


def test_optimizer_bytes_per_param():
    assert Optimizer.ADAM.bytes_per_param(DType.FP32, master_copy=True) == 12
    assert Optimizer.ADAM.bytes_per_param(DType.FP32, master_copy=False) == 8
    assert Optimizer.ADAM.bytes_per_param(DType.BF16, master_copy=False) == 4
    assert Optimizer.MOMENTUM.bytes_per_param(DType.FP32, master_copy=False) == 4
    assert Optimizer.SGD.bytes_per_param(DType.FP32, master_copy=True) == 4


def test_master_copy_only_with_narrow_weights(capsys):
    # fp32 Adam: 4 + 4 + 8 = 16 bytes; bf16 mixed precision: 2 + 2 + (4 + 8) = 16 bytes.
    fp32 = _plan_json(capsys, "--model", "1B", "--weights-dtype", "fp32")
    bf16 = _plan_json(capsys, "--model", "1B")
    assert fp32["bytes_per_param"] == {"weights": 4, "grads": 4, "optimizer": 8}
    assert bf16["bytes_per_param"] == {"weights": 2, "grads": 2, "optimizer": 12}


def test_fits_compares_total_with_gpu_memory_and_batch_is_multiplied():
    shape = ModelShape("7B", "count", 7 * 10**9)
    cfg = PlanConfig(
        shape,
        full_trainable(shape),
        gpus=4,
        gpu_memory_bytes=56 * 10**9,
        weights_dtype=DType.FP16,
        grads_dtype=DType.FP16,
        optimizer_bytes=4,
        batch_size=3,
        grad_accum=5,
    )
    plan = make_plan(cfg)
    fits = {row.strategy: row.fits for row in plan.memory}
    assert fits[Strategy.DDP]  # exactly 56 GB in 56 GB
    tighter = make_plan(PlanConfig(**{**cfg.__dict__, "gpu_memory_bytes": 56 * 10**9 - 1}))
    assert not {row.strategy: row.fits for row in tighter.memory}[Strategy.DDP]
    assert plan.effective_batch == 3 * 4 * 5


def test_counted_trainable_cannot_exceed_the_model():
    shape = ModelShape("1M", "count", 10**6)
    with pytest.raises(ValueError, match="--trainable must not exceed"):
        counted_trainable(shape, 2 * 10**6)
