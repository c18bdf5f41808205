"""Run torch's own DDP tests (`DistributedTest._DistTestBase`) with one DDP class.

    python tests/compat/torch_suite.py --ddp lockstep --json out.json [--select ddp]

Each test is torch's multi-process test: two gloo ranks on CPU (world size 2),
one fresh pair per test. With `--ddp lockstep`, every rank swaps
`lockstep.DistributedDataParallel` into `torch.nn.parallel` (and into the name
the test module imported) before the test body runs; the parent process never
swaps, so nothing leaks. Results go to a JSON file: per test, its outcome, the
one-line reason of a failure, and its seconds. `compare.py` runs this twice.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import time
import unittest
from pathlib import Path

# torch's test module reads these at import time; only this process sees them.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")

import torch
import torch.testing._internal.common_distributed as common_distributed
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP
from torch.testing._internal.distributed import distributed_test

# Imported here, before the ranks fork, so that no rank pays for the import.
from lockstep import DistributedDataParallel as LockstepDDP

CLASSES = ("torch", "lockstep")
_BASE = distributed_test.DistributedTest._DistTestBase
_HELPER_CALL = re.compile(r"self\.(_\w+)\(")


def ddp_class(name: str) -> type:
    """The class a test run uses: torch's own, or lockstep's."""
    return TorchDDP if name == "torch" else LockstepDDP


def swap_in(cls: type) -> None:
    """Make `cls` the DDP class every spelling in torch's test module resolves to."""
    torch.nn.parallel.DistributedDataParallel = cls
    distributed_test.DistributedDataParallel = cls


class TorchDDPSuite(distributed_test.TestDistBackend, _BASE):
    """torch's DDP test class on gloo; ranks fork from this process (torch already loaded)."""

    ddp = "torch"

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: object, **kwargs: object):
        swap_in(ddp_class(cls.ddp))
        super()._run(rank, test_name, file_name, pipe, **kwargs)


class LockstepDDPSuite(TorchDDPSuite):
    """The same tests with lockstep's class swapped in on every rank."""

    ddp = "lockstep"


def _source(name: str) -> str:
    try:
        return inspect.getsource(getattr(_BASE, name))
    except (OSError, TypeError):
        return ""


def uses_ddp(name: str) -> bool:
    """Whether a test, or a `self._helper` it calls (transitively), builds a DDP wrapper."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or not hasattr(_BASE, current):
            continue
        seen.add(current)
        source = _source(current)
        if "DistributedDataParallel" in source:
            return True
        todo.extend(_HELPER_CALL.findall(source))
    return False


def all_tests() -> list[str]:
    """Every test of `_DistTestBase`, sorted by name."""
    return sorted(n for n in dir(_BASE) if n.startswith("test_"))


def ddp_tests() -> list[str]:
    """The tests of `_DistTestBase` that build a DDP wrapper, sorted by name."""
    return sorted(n for n in dir(_BASE) if n.startswith("test_") and uses_ddp(n))


def one_line(err_text: str) -> str:
    """The first rank's exception, as `Type: message` on one line."""
    lines = [line for line in err_text.splitlines() if line.strip()]
    marks = [i for i, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    if not marks:
        return lines[-1][:300] if lines else ""
    # The first rank's traceback ends where the next rank's report begins.
    first = next((i for i in marks if i > 0), marks[0])
    reports = [i for i, line in enumerate(lines) if line.startswith("Process ")]
    if len(reports) > 1:
        inside = [i for i in marks if reports[0] < i < reports[1]]
        first = inside[-1] if inside else first
    else:
        first = marks[-1]
    return lines[first].strip()[:300]


class _Recorder(unittest.TextTestResult):
    """Keeps outcome, reason and seconds per test, for the JSON file."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.records: dict[str, dict[str, object]] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.perf_counter()
        super().startTest(test)

    def _keep(self, test: unittest.TestCase, outcome: str, reason: str = "") -> None:
        name = test.id().split(".")[-1]
        seconds = round(time.perf_counter() - self._started, 2)
        self.records[name] = {"outcome": outcome, "reason": reason, "seconds": seconds}

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._keep(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: object) -> None:
        super().addFailure(test, err)
        self._keep(test, "failed", one_line(self._exc_info_to_string(err, test)))

    def addError(self, test: unittest.TestCase, err: object) -> None:
        super().addError(test, err)
        self._keep(test, "failed", one_line(self._exc_info_to_string(err, test)))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._keep(test, "skipped", reason.splitlines()[0] if reason else "")

    def addExpectedFailure(self, test: unittest.TestCase, err: object) -> None:
        super().addExpectedFailure(test, err)
        self._keep(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._keep(test, "failed", "unexpected success")


def run(ddp: str, names: list[str], timeout_s: int) -> dict[str, dict[str, object]]:
    """Run `names` with the `ddp` class; return the per-test records."""
    common_distributed.TIMEOUT_DEFAULT = timeout_s
    for key in list(common_distributed.TIMEOUT_OVERRIDE):
        common_distributed.TIMEOUT_OVERRIDE[key] = min(timeout_s * 2, 600)
    suite_cls = LockstepDDPSuite if ddp == "lockstep" else TorchDDPSuite
    suite = unittest.TestSuite(suite_cls(name) for name in names)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Recorder)
    result = runner.run(suite)
    return result.records  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", choices=CLASSES, required=True)
    parser.add_argument("--json", type=Path, required=True, help="where to write the records")
    parser.add_argument("--only", nargs="*", help="these tests (default: --select)")
    parser.add_argument(
        "--select", choices=("all", "ddp"), default="all", help="every test, or those building DDP"
    )
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    args = parser.parse_args()
    names = args.only or (all_tests() if args.select == "all" else ddp_tests())
    records = run(args.ddp, names, args.timeout)
    args.json.write_text(json.dumps(records, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
