"""Named model presets: decoder-only transformer architectures, counted from their shapes.

`lockstep plan --model llama-2-7b` needs no download and no import: the layer
shapes below give every parameter and every Linear layer (for LoRA targets), with
the module names of the usual implementations (q_proj, v_proj, ...; c_attn, c_fc
for GPT-2). The totals match the published parameter counts; the unit tests say
which. Two families: GPT-2 (learned positions, biases, tied output embedding) and
LLaMA-style (gated MLP, RMSNorm without bias, grouped-query attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lockstep.plan.shape import LinearInfo, ModelShape


class Family(Enum):
    """The layout of a transformer block."""

    GPT2 = "gpt2"
    LLAMA = "llama"


@dataclass(frozen=True)
class Architecture:
    """Shapes of a decoder-only transformer.

    Attributes:
        family: block layout.
        vocab: vocabulary size.
        hidden: model width.
        layers: number of blocks.
        intermediate: MLP width.
        kv_dim: width of the key and value projections (hidden without grouped queries).
        positions: learned position embeddings (GPT-2), 0 for rotary ones.
        tied: the output layer shares the input embedding.
    """

    family: Family
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int
    positions: int = 0
    tied: bool = False

    def named_params(self) -> list[tuple[str, int]]:
        """Every parameter's name and size, in registration order (tied ones once)."""
        if self.family is Family.GPT2:
            return self._gpt2_params()
        return self._llama_params()

    def linears(self) -> list[LinearInfo]:
        """Every Linear layer (GPT-2's Conv1D included), in module order."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        if self.family is Family.GPT2:
            block = [("attn.c_attn", h, 3 * h), ("attn.c_proj", h, h)]
            block += [("mlp.c_fc", h, i), ("mlp.c_proj", i, h)]
            prefix = "transformer.h"
        else:
            block = [(f"self_attn.{n}", h, o) for n, o in (("q_proj", h), ("k_proj", kv))]
            block += [("self_attn.v_proj", h, kv), ("self_attn.o_proj", h, h)]
            block += [("mlp.gate_proj", h, i), ("mlp.up_proj", h, i), ("mlp.down_proj", i, h)]
            prefix = "model.layers"
        out = [
            LinearInfo(f"{prefix}.{n}.{name}", fan_in, fan_out)
            for n in range(self.layers)
            for name, fan_in, fan_out in block
        ]
        if not self.tied:
            out.append(LinearInfo("lm_head", h, self.vocab))
        return out

    def _gpt2_params(self) -> list[tuple[str, int]]:
        h, i = self.hidden, self.intermediate
        out = [
            ("transformer.wte.weight", self.vocab * h),
            ("transformer.wpe.weight", self.positions * h),
        ]
        block = [("ln_1", 2 * h), ("attn.c_attn", h * 3 * h + 3 * h), ("attn.c_proj", h * h + h)]
        block += [("ln_2", 2 * h), ("mlp.c_fc", h * i + i), ("mlp.c_proj", i * h + h)]
        for n in range(self.layers):
            out += [(f"transformer.h.{n}.{name}", size) for name, size in block]
        out.append(("transformer.ln_f", 2 * h))
        return out

    def _llama_params(self) -> list[tuple[str, int]]:
        h = self.hidden
        out = [("model.embed_tokens.weight", self.vocab * h)]
        by_name = {lin.name: lin.in_features * lin.out_features for lin in self.linears()}
        for n in range(self.layers):
            prefix = f"model.layers.{n}"
            out += [(k, v) for k, v in by_name.items() if k.startswith(prefix + ".")]
            out += [(f"{prefix}.input_layernorm", h), (f"{prefix}.post_attention_layernorm", h)]
        out.append(("model.norm.weight", h))
        if not self.tied:
            out.append(("lm_head", by_name["lm_head"]))
        return out

    def shape(self, label: str) -> ModelShape:
        """The planner's view of this architecture, every parameter trainable."""
        numels = tuple(size for _, size in self.named_params())
        return ModelShape(label, "preset", sum(numels), numels, tuple(self.linears()))


def _gpt2(hidden: int, layers: int) -> Architecture:
    return Architecture(Family.GPT2, 50257, hidden, layers, 4 * hidden, hidden, 1024, True)


def _llama(vocab: int, hidden: int, layers: int, intermediate: int, kv_heads: int, heads: int):
    kv_dim = hidden * kv_heads // heads
    return Architecture(Family.LLAMA, vocab, hidden, layers, intermediate, kv_dim)


PRESETS: dict[str, Architecture] = {
    "gpt2": _gpt2(768, 12),
    "gpt2-medium": _gpt2(1024, 24),
    "gpt2-large": _gpt2(1280, 36),
    "gpt2-xl": _gpt2(1600, 48),
    "llama-2-7b": _llama(32000, 4096, 32, 11008, 32, 32),
    "llama-2-13b": _llama(32000, 5120, 40, 13824, 40, 40),
    "llama-2-70b": _llama(32000, 8192, 80, 28672, 8, 64),
    "llama-3-8b": _llama(128256, 4096, 32, 14336, 8, 32),
    "llama-3-70b": _llama(128256, 8192, 80, 28672, 8, 64),
    "mistral-7b": _llama(32000, 4096, 32, 14336, 8, 32),
}


def preset_shape(name: str) -> ModelShape:
    """The shape of preset `name`.

    Raises:
        ValueError: unknown preset; the message lists the known ones.
    """
    arch = PRESETS.get(name.strip().lower())
    if arch is None:
        raise ValueError(
            f"--model: unknown preset {name!r}; expected one of {', '.join(PRESETS)}, "
            "a parameter count such as 7B, or pkg.module:factory"
        )
    return arch.shape(name.strip().lower())
