"""`lockstep plan` as users type it: units, forms, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest

from lockstep.cli import main
from lockstep.plan.units import parse_bytes, parse_count, parse_rate


def test_units_parse_decimal_binary_bits_and_counts():
    assert parse_bytes("80GB", "--x") == 80 * 10**9
    assert parse_bytes("80 GiB", "--x") == 80 * 2**30
    assert parse_bytes("4KB", "--x") == 4000
    assert parse_bytes("4096", "--x", unit_required=False) == 4096
    assert parse_rate("25Gbit/s", "--x") == 25e9 / 8
    assert parse_rate("25Gbps", "--x") == 25e9 / 8
    assert parse_rate("100GB/s", "--x") == 100e9
    assert parse_rate("1GiB/s", "--x") == 2**30
    assert parse_count("7B", "--x") == 7 * 10**9
    assert parse_count("7.5B", "--x") == 7_500_000_000
    assert parse_count("125M", "--x") == 125 * 10**6
    assert parse_count("7e9", "--x") == 7 * 10**9


def _error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["plan", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    return err.splitlines()[-1] if "usage:" in err else err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "7B", "--gpu-memory", "80"], r"--gpu-memory expects .*80GB .*found '80'"),
        (["--model", "7B", "--gpu-memory=-80GB"], r"--gpu-memory must be at least 1 byte"),
        (["--model", "7B", "--gpu-memory", "-80GB"], r"argument --gpu-memory: expected one"),
        (["--model", "7B", "--gpu-memory", "0GB"], r"--gpu-memory must be at least 1 byte"),
        (["--model", "0"], r"--model must be at least 1"),
        (["--model=-7B"], r"--model must be at least 1; found '-7B'. Expected a count: 7B"),
        (["--model", "llama-9"], r"--model: unknown preset 'llama-9'; expected one of .*7B"),
        (["--model", "no_such_pkg.models:build"], r"--model: cannot import 'no_such_pkg.models'"),
        (["--model", "7B", "--gpus", "0"], r"--gpus must be positive; found 0"),
        (["--model", "7B", "--gpus", "-4"], r"--gpus must be positive; found -4"),
        (["--model", "7B", "--gpus", "6", "--nodes", "4"], r"--gpus must be a multiple of"),
        (["--model", "7B", "--link", "carrier-pigeon"], r"--link: unknown link .*nvlink"),
        (["--model", "7B", "--link", "0GB/s"], r"--link must be positive"),
        (["--model", "7B", "--weights-dtype", "fp7"], r"--weights-dtype expects one of fp32"),
        (
            ["--model", "7B", "--optimizer", "lion"],
            r"--optimizer expects one of adam, momentum, sgd",
        ),
        (["--model", "7B", "--lora-rank", "8"], r"--lora-rank needs the model's layer shapes"),
        (["--model", "gpt2", "--lora-rank", "0"], r"--lora-rank must be a positive integer"),
        (["--model", "7B", "--trainable", "0%"], r"--trainable share must be in"),
        (["--model", "7B", "--batch-size", "0"], r"--batch-size must be positive"),
        (["--model", "7B", "--gpus", "x"], r"argument --gpus: invalid int value"),
        (["--model", "7B", "--bandwidth-from", "/nonexistent.json"], r"--bandwidth-from: cannot"),
    ],
)
def test_bad_input_is_one_line_naming_the_argument_with_exit_2(capsys, args, expected):
    line = _error(capsys, *args)
    assert "\n" not in line
    assert re.search(expected, line), line


def test_module_path_is_counted_from_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def build():
                return nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["plan", "--model", "mymodels:build", "--gpus", "2", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["total_params"] == 1000 * 1000 + 1000 + 1000 * 10 + 10
    assert doc["payload_bytes"] == doc["model"]["total_params"] * 2


def test_json_file_and_table_together(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--model", "gpt2", "--gpus", "16", "--nodes", "2", "--json", str(out)]) == 0
    )
    table = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["gpus_per_node"] == 8 and doc["nodes"] == 2
    methods = {row["method"] for row in doc["allreduce"]}
    assert methods == {"two-phase", "flat ring"}
    assert "2-phase  each node sends 2(M-1)/M x payload" in table
    assert "nvlink + infiniband" in table
