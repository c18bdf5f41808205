"""The package's import graph: no cycle between modules, and no import up the layers.

Every `import lockstep...` in src/ is read with `ast` (inside functions and under
TYPE_CHECKING too, since a cycle there is still two modules that need each
other's insides). A package may import only packages of a lower layer; packages
of one layer (the two engines, the data tools) never import each other.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "lockstep"  # read, never imported

LAYERS = [
    {"errors"},
    {"env", "teardown", "seal"},
    {"arrivals"},
    {"context"},
    {"collectives"},
    {"runtime"},
    {"engine", "sharded", "data"},
    {"observe", "checkpoint", "testing", "adopt"},
    {"live"},  # live recovery, one wing: installed by the package's __init__, no host imports it
    {"plan", "launch"},
    {"bench"},
    {"cli"},
    {"__init__"},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(modules: set[str]) -> dict[str, set[str]]:
    """Module -> the lockstep modules it imports (a package's __init__ counts as the package)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found |= {n for n in names if n in modules}
        me = module_name(path)
        # "from lockstep.x import y" names both lockstep.x and lockstep.x.y: keep the deepest.
        graph[me] = {n for n in found if not any(o.startswith(n + ".") for o in found)} - {me}
    return graph


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@cache
def graph() -> dict[str, set[str]]:
    return imports({module_name(p) for p in ROOT.rglob("*.py")})


def test_every_package_has_a_layer():
    packages = {top(m) for m in graph()}
    assert packages <= set().union(*LAYERS), packages - set().union(*LAYERS)


def test_no_import_cycle():
    assert find_cycle(graph()) is None, f"import cycle: {' -> '.join(find_cycle(graph()) or [])}"


def test_no_import_up_or_across_the_layers():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            mine, theirs = top(module), top(target)
            if mine != theirs and layer_of(theirs) >= layer_of(mine):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_checker_sees_a_cycle_and_an_upward_import():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert layer_of("observe") > layer_of("engine")


HOSTS = {"runtime", "engine", "sharded", "data", "checkpoint", "observe", "context", "collectives"}


def test_no_host_imports_the_live_wing():
    """Live recovery plugs in at the runtime's seams (`lockstep/live/__init__.py`): the
    package's `__init__` installs it, and no host module names it."""
    wrong = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        for target in targets
        if top(module) in HOSTS and top(target) == "live"
    ]
    assert not wrong, "\n".join(sorted(wrong))
    installers = {m for m, targets in graph().items() if "lockstep.live" in targets}
    assert installers <= {"lockstep", "lockstep.launch.recovery.standby"}, installers
