"""No module reaches into another object's private members: each object has public calls.

A private member (`_name`) is the business of the class that defines it. Every
`x._name` in src/ whose `x` is not `self` or `cls`, and whose `_name` is one that a
lockstep class defines (assigned on `self`, or a method or class attribute), is a
reach: the other object should offer a public call instead. torch's own private
members (its agent's, its process groups') are not counted here: lockstep reads them
in one named place each (`launch/supervise/agent.py`'s adapters), tied to the torch
version tested.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lockstep

ROOT = Path(lockstep.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_privates(files: list[Path]) -> set[str]:
    """Private names lockstep's classes define: `self._x = ...`, `def _x`, `_x = ...`."""
    names: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(item.name)
                    targets = item.targets if isinstance(item, ast.Assign) else []
                    if isinstance(item, ast.AnnAssign):
                        targets = [item.target]
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if stored and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _own(value: ast.expr) -> bool:
    """`self`, `cls` or `super()`: an object's own members."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def reaches(files: list[Path], privates: set[str]) -> list[str]:
    """'file:line: x._name' for each reach into a lockstep private member."""
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in privates and not _own(node.value):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_objects_private_members():
    files = sorted(ROOT.rglob("*.py"))
    found = reaches(files, defined_privates(files))
    assert not found, "\n".join(found)


def test_the_check_sees_a_reach(tmp_path):
    source = tmp_path / "a.py"
    source.write_text(
        "class A:\n    def __init__(self):\n        self._secret = 1\n\n"
        "def peek(a):\n    return a._secret + a.public + super()._secret\n"
    )
    assert defined_privates([source]) == {"_secret"}
    assert reaches([source], {"_secret"}) == ["a.py:6: a._secret"]
