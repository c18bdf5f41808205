"""Each module holds the one concept its first docstring line names, in at most 400 lines.

Split by concept, never by count: a file may grow to 400 lines while it holds one
idea, and is split when it holds two. A statement is never kept from the formatter (a
"fmt: skip" comment) to pass it: the code reads as `ruff format` writes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lockstep

ROOT = Path(lockstep.__file__).parent
REPO = ROOT.parents[1]
MAX_LINES = 400


def test_every_module_opens_with_its_concept_and_stays_under_the_bound():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text))
        if lines > MAX_LINES:
            wrong.append(f"{path.relative_to(REPO)}: {lines} lines (at most {MAX_LINES})")
        if not (doc or "").strip():
            wrong.append(f"{path.relative_to(REPO)}: no docstring naming its concept")
    assert not wrong, "\n".join(wrong)


def test_no_statement_is_kept_from_the_formatter():
    marker = "# fmt: " + "skip"  # spelled apart, so this file is not a hit itself
    hits = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in ("src", "tests", "benchmarks", "examples")
        for path in sorted((REPO / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if marker in line
    ]
    assert not hits, hits
