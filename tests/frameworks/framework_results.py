"""Comparing one case's results from torch's engine and lockstep's: bitwise, key by key."""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path
from typing import Any

import torch

ENGINES = ("torch", "lockstep")


def case_names(module: str) -> list[str]:
    """The cases of `module` (its `case_*` functions, in order), read from its source:
    collecting the tests does not import the framework (seconds per pytest worker)."""
    tree = ast.parse(Path(__file__).with_name(f"{module}.py").read_text())
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    return [name.removeprefix("case_") for name in functions if name.startswith("case_")]


def assert_same(ours: Any, theirs: Any, where: str) -> None:
    """Equal structure and bitwise-equal tensors; `where` names the first difference."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict), f"{where}: {type(theirs).__name__} is not a dict"
        assert ours.keys() == theirs.keys(), f"{where}: keys {list(ours)} != {list(theirs)}"
        for key in ours:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), f"{where}: {len(ours)} items != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs), f"{where}: tensors differ\n{ours}\n{theirs}"
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def check_case(per_rank: list[dict], name: str, engines: tuple[str, str]) -> None:
    """Every rank ran `name` with both engines without error, and the results agree."""
    ours_name, theirs_name = engines
    for rank, results in enumerate(per_rank):
        ours, theirs = results[(name, ours_name)], results[(name, theirs_name)]
        assert "error" not in theirs, f"rank {rank} ({theirs_name}): {theirs['error']}"
        assert "error" not in ours, f"rank {rank} ({ours_name}): {ours['error']}"
        drop = ("wrapper",)  # the class name: torch's, or lockstep's under it
        ours = {k: v for k, v in ours.items() if k not in drop}
        theirs = {k: v for k, v in theirs.items() if k not in drop}
        assert_same(ours, theirs, f"{name}@rank{rank}")


def run_all(ctx: Any, tmp: str, cases: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """Each (module, case) with both engines in this rank; an exception is kept as text."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[tuple[str, str], Any] = {}
    for module, name in cases:
        case = importlib.import_module(module).CASES[name]
        for engine in ENGINES:
            try:
                results[(name, engine)] = case(engine, ctx.rank, Path(tmp) / name)
            except Exception as exc:  # reported by the test, per case
                results[(name, engine)] = {"error": f"{type(exc).__name__}: {exc}"}
    return results
