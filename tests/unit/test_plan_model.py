"""Counting models: presets against published totals, meta-device counting, LoRA adapters."""

from __future__ import annotations

import sys
import time
import types

import pytest
from torch import nn

from lockstep.plan.model_count import count_factory, count_module, resolve_model
from lockstep.plan.presets import PRESETS, Architecture, Family
from lockstep.plan.shape import lora_numels, lora_trainable

# Totals published with the models (model cards and papers).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_totals_match_published_counts(name):
    assert resolve_model(name).total_params == PUBLISHED[name]


class _TinyLlamaBlock(nn.Module):
    """A LLaMA-layout block with the usual module names, built by hand."""

    def __init__(self, h: int, kv: int, inter: int) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        for name, out in (("q_proj", h), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)):
            setattr(self.self_attn, name, nn.Linear(h, out, bias=False))
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, inter, bias=False)
        self.mlp.up_proj = nn.Linear(h, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, h, bias=False)
        self.input_layernorm = nn.RMSNorm(h)
        self.post_attention_layernorm = nn.RMSNorm(h)


def tiny_llama() -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(101, 48)
    model.model.layers = nn.ModuleList(_TinyLlamaBlock(48, 16, 80) for _ in range(3))
    model.model.norm = nn.RMSNorm(48)
    model.lm_head = nn.Linear(48, 101, bias=False)
    return model


def test_meta_count_of_a_built_module_equals_the_preset_arithmetic():
    arch = Architecture(Family.LLAMA, vocab=101, hidden=48, layers=3, intermediate=80, kv_dim=16)
    built = count_module(tiny_llama())
    preset = arch.shape("tiny")
    assert built.total_params == preset.total_params
    assert built.trainable_numels == preset.trainable_numels  # same sizes, same order
    assert [(x.name, x.in_features, x.out_features) for x in built.linears] == [
        (x.name, x.in_features, x.out_features) for x in preset.linears
    ]
    lora_built = lora_trainable(built, 4, ["q_proj", "v_proj"])
    assert lora_built == lora_trainable(preset, 4, ["q_proj", "v_proj"])
    assert lora_built.count == 3 * (4 * (48 + 48) + 4 * (48 + 16))


def _huge() -> nn.Module:
    return nn.Sequential(nn.Linear(100_000, 100_000), nn.Linear(100_000, 10))  # 10B params


def _frozen_embedding() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    return model


def test_factory_is_counted_on_meta_without_allocating(monkeypatch):
    mod = types.ModuleType("plan_test_factories")
    mod.huge = _huge
    mod.frozen = _frozen_embedding
    mod.not_a_module = lambda: 3
    monkeypatch.setitem(sys.modules, "plan_test_factories", mod)
    start = time.monotonic()
    shape = count_factory("plan_test_factories:huge")  # 40 GB in fp32 if it were allocated
    assert time.monotonic() - start < 10
    assert shape.total_params == 100_000 * 100_000 + 100_000 + 100_000 * 10 + 10
    frozen = count_factory("plan_test_factories:frozen")
    assert frozen.total_params == 40 + 16 + 4
    assert sum(frozen.trainable_numels) == 20  # the frozen embedding does not train
    with pytest.raises(ValueError, match=r"returned int; expected an nn\.Module"):
        count_factory("plan_test_factories:not_a_module")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        count_factory("plan_test_factories:missing")


def test_tied_parameters_count_once():
    emb = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    assert count_module(nn.ModuleList([emb, head])).total_params == 400


def test_lora_targets_match_like_peft_and_unknown_targets_are_named():
    shape = resolve_model("gpt2")
    # "c_proj" matches both attn.c_proj (768->768) and mlp.c_proj (3072->768).
    numels = lora_numels(shape.linears, 2, ["c_proj"])
    assert sum(numels) == 12 * 2 * (768 + 768 + 3072 + 768)
    with pytest.raises(ValueError, match="'q_proj' matches no Linear layer"):
        lora_trainable(shape, 8, ["q_proj"])
    with pytest.raises(ValueError, match="--lora-rank needs the model's layer shapes"):
        lora_trainable(resolve_model("7B"), 8, ["q_proj"])


def test_every_preset_resolves_and_has_linears():
    for name in PRESETS:
        shape = resolve_model(name)
        assert shape.kind == "preset" and shape.linears
        assert sum(shape.trainable_numels) == shape.total_params


def test_meta_count_of_a_factory_equals_the_real_build():
    shape = count_factory(f"{__name__}:tiny_llama")
    real = tiny_llama()
    assert shape.total_params == sum(p.numel() for p in real.parameters())
    assert shape.trainable_numels == tuple(p.numel() for p in real.parameters())
