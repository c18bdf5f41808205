"""HSDP in `lockstep plan`: bytes per link and memory per GPU beside DDP and ZeRO.

The formulas (`plan/hybrid.py`) are also checked against bytes measured on the
wire: per GPU in `tests/dist/test_sharded_wire.py` (wchar of four gloo ranks as
2 x 2) and across nodes in `tests/launch/test_hsdp_nodes.py` (a veth's counter).
Here: their values for known layouts, and the table and JSON that print them.
"""

from __future__ import annotations

import json

import pytest

from lockstep.cli import main
from lockstep.plan.hybrid import link_bytes

P = 1000.0


def _rows(g: int, m: int, p: float = P, w: float = P, every: float = P) -> dict:
    return {row.label: row for row in link_bytes(g, m, p, w, every)}


def test_two_nodes_of_two_hsdp_sends_the_shards_share_across():
    rows = _rows(2, 2)
    assert rows["HSDP-3"].across_per_node == P  # 2 GPUs x shard P/2, 2(M-1)/M = 1
    assert rows["ZeRO-3"].across_per_node == 0.75 * 3 * P  # a ring through the link
    assert rows["DDP, two-phase"].across_per_node == P
    assert rows["HSDP-3"].per_gpu == 0.5 * 3 * P + 0.5 * P
    assert rows["HSDP-2"].per_gpu == rows["ZeRO-2"].per_gpu == 1.5 * P  # at 2 x 2 only


def test_eight_nodes_of_eight():
    rows = _rows(8, 8, p=2.0, w=2.0, every=2.0)
    assert rows["HSDP-3"].across_per_node == pytest.approx(2 * 7 / 8 * 2.0)
    assert rows["ZeRO-3"].across_per_node == pytest.approx(63 / 64 * 6.0)
    assert rows["HSDP-2"].per_gpu == pytest.approx(7 / 8 * 4.0 + 2 * 7 / 8 * 2.0 / 8)


def _json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json", "-"]) in (0, None)
    return json.loads(capsys.readouterr().out)


def test_plan_prints_hsdp_beside_ddp_and_zero(capsys):
    main(["plan", "--model", "7.5B", "--gpus", "64", "--nodes", "8"])
    out = capsys.readouterr().out
    assert "HSDP: shard within a node (G = 8), replicate across nodes (M = 8)" in out
    for label in ("HSDP-2", "HSDP-3", "DDP, two-phase", "ZeRO-2", "ZeRO-3"):
        assert f"  {label} " in out, label
    doc = _json(capsys, "--model", "7.5B", "--gpus", "64", "--nodes", "8")
    hsdp3, zero3 = doc["hsdp"]["memory"]["hsdp3"], doc["memory"]["zero3"]
    assert hsdp3["total_bytes"] == pytest.approx(8 * zero3["total_bytes"])  # 1/G, not 1/N
    across = {row["label"]: row["across_per_node_bytes"] for row in doc["hsdp"]["link_bytes"]}
    assert across["HSDP-3"] == pytest.approx(2 * 7 / 8 * doc["payload_bytes"])


def test_one_node_has_no_hsdp_section(capsys):
    main(["plan", "--model", "7B", "--gpus", "8"])
    assert "HSDP" not in capsys.readouterr().out
    assert "hsdp" not in _json(capsys, "--model", "7B", "--gpus", "8")
