"""The sharded engine's pure parts: the flat layout and the choice of units, without processes."""

from __future__ import annotations

import pytest
from torch import nn

from lockstep.sharded.layout import Piece, flat_layout
from lockstep.sharded.units import ROOT, collect_params, owning_unit, wrap_units, wrapped_modules


def test_layout_pads_to_equal_shards_and_places_parameters_back_to_back():
    layout = flat_layout([5, 3, 2], world_size=4)
    assert layout.offsets == (0, 5, 8)
    assert layout.shard_numel == 3 and layout.padded_numel == 12
    assert layout.split_sizes == [5, 3, 2, 2]
    assert [layout.shard_range(r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_pieces_cover_every_element_once():
    layout = flat_layout([5, 3, 2], world_size=4)
    assert layout.pieces(1) == [Piece(0, 3, 0, 2), Piece(1, 0, 2, 1)]
    assert layout.pieces(3) == [Piece(2, 1, 0, 1)]
    covered = sorted(
        (p.param, p.param_offset + i)
        for r in range(4)
        for p in layout.pieces(r)
        for i in range(p.numel)
    )
    assert covered == [(j, i) for j, n in enumerate(layout.numels) for i in range(n)]


@pytest.mark.parametrize("numels, world", [([7], 1), ([1], 8), ([4, 4], 2)])
def test_layout_edge_sizes(numels, world):
    layout = flat_layout(numels, world)
    assert layout.padded_numel >= layout.numel and layout.padded_numel % world == 0
    assert layout.shard_numel >= 1


@pytest.mark.parametrize("numels, world", [([], 2), ([3], 0), ([-1], 2)])
def test_layout_rejects_bad_input(numels, world):
    with pytest.raises(ValueError, match=r"expected|at least 1"):
        flat_layout(numels, world)


def test_owning_unit_is_the_wrapped_module_or_the_root():
    paths = ["blocks.0", "blocks.1"]
    assert owning_unit(["blocks.0.fc.weight"], paths) == "blocks.0"
    assert owning_unit(["blocks.10.fc.weight"], paths) == ROOT  # a prefix must end at a dot
    assert owning_unit(["blocks.0.w", "blocks.1.w"], paths) == ROOT  # tied across units
    assert owning_unit(["head.weight"], paths) == ROOT


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.fc = nn.Linear(2, 2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(2, 2)
        self.layers = nn.ModuleList([_Outer(), _Outer()])
        self.head = nn.Linear(2, 2)
        self.head.weight = self.layers[1].fc.weight


def test_wrap_units_outermost_modules_tied_weight_to_root():
    net = _Net()
    assert [p for p, _ in wrapped_modules(net, [_Outer, _Inner])] == ["layers.0", "layers.1"]
    units = wrap_units(net, collect_params(net), [_Outer])
    names = {u.name: [s.names for s in u.params] for u in units}
    assert list(names) == ["root", "layers.0", "layers.1"]
    assert ["layers.1.fc.weight", "head.weight"] in names["root"]
    assert ["layers.1.fc.bias"] in names["layers.1"]
