"""The worker's first frame: run the user's script and record a failure where the launcher reads it.

`lockstep run` starts each worker as `python -m lockstep.launch.supervise.bootstrap
--parent PID (script.py | -m module) [args]`. The script runs as `__main__`,
exactly as under plain `python`. If it raises, the exception and its traceback go
to the error file that torch.distributed.elastic gives every worker
(TORCHELASTIC_ERROR_FILE), so the launcher can print the real cause: no decorator
for the user to add. The worker asks the kernel to kill it if the launcher (PID)
dies, so a launcher killed with SIGKILL leaves no worker behind. A worker killed
by a fatal signal from native code prints the Python stack of every thread first;
on SIGUSR2 it writes that stack for the launcher's stall and exit watches
(`launch/watches/stall.py`, `launch/watches/exits.py`).
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from lockstep.env import read_variable

ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
PROGRESS_DIR_VARIABLE = "LOCKSTEP_PROGRESS_DIR"  # runtime.progress reads it too
EXIT_DIR_VARIABLE = "LOCKSTEP_EXIT_DIR"  # launch.exitwatch reads it too
_PR_SET_PDEATHSIG = 1


def _target(argv: list[str]) -> Callable[[], Any]:
    """The call that runs the script or module, with sys.argv and sys.path as python sets them."""
    if argv[0] == "-m":
        module = argv[1]
        sys.argv = [module, *argv[2:]]
        sys.path.insert(0, os.getcwd())
        return lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)
    script = argv[0]
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    return lambda: runpy.run_path(script, run_name="__main__")


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the frames of this module and of runpy, so the traceback starts in user code."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy>")
    ):
        tb = tb.tb_next
    return tb


def record(exc: BaseException) -> str:
    """Write the exception where the elastic agent reads it (its JSON layout); return the text."""
    text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
    path = read_variable(ERROR_FILE_VARIABLE)
    if path:
        data = {
            "message": {
                "message": f"{type(exc).__name__}: {exc}",
                "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
            }
        }
        with open(path, "w") as fp:
            json.dump(data, fp)
    return text


def die_with(parent: int) -> None:
    """SIGKILL this process when `parent` exits (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still runs
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--parent"]:
        die_with(int(argv[1]))
        argv = argv[2:]
    # A crash in native code (SIGABRT, SIGSEGV) raises nothing to record: print every
    # thread's Python stack to stderr instead, so the launcher's log shows where it was.
    faulthandler.enable(all_threads=True)
    _arm_stack_dump()
    _pin_groups()
    target = _target(argv)
    try:
        target()
    except SystemExit as exit_:
        if exit_.code in (None, 0):
            _leave_groups()
            raise
        record(exit_)
        _exit_now(exit_.code if isinstance(exit_.code, int) else 1)
    except BaseException as exc:
        text = record(exc)
        rank = read_variable("RANK") or "?"
        sys.stderr.write("".join(f"[rank{rank}]: {line}\n" for line in text.splitlines()))
        _exit_now(1)
    _leave_groups()


_stack_file: Any = None  # kept open for faulthandler for the life of the process


def _arm_stack_dump() -> None:
    """On SIGUSR2, write every thread's Python stack where the launcher's stall watch reads it."""
    global _stack_file
    directory = read_variable(PROGRESS_DIR_VARIABLE) or read_variable(EXIT_DIR_VARIABLE)
    if not directory:
        return
    path = os.path.join(directory, f"{read_variable('LOCAL_RANK') or '0'}.stack")
    _stack_file = open(path, "w")  # noqa: SIM115 (faulthandler writes to it until exit)
    faulthandler.register(signal.SIGUSR2, file=_stack_file, all_threads=True)


def _pin_groups() -> None:
    """Pin the process groups the script will make, so they end after it (`lockstep.teardown`)."""
    from lockstep.teardown import install

    install()


def _leave_groups() -> None:
    """The script succeeded: say so to the launcher, then end its process groups.

    A group alive during interpreter shutdown still runs its backend's threads,
    which can abort the process after training succeeded; a group freed by a C++
    object with the GIL held can hang it (`lockstep.teardown`). The launcher bounds
    what follows (`lockstep.launch.watches.exits`): the result is known from here on.
    """
    from lockstep.launch.watches.exits import note_script_ended
    from lockstep.teardown import release

    note_script_ended()
    _tell_live_launchers()
    release()


def _tell_live_launchers() -> None:
    """Under `--live-recovery`, post that this rank's script ended: a peer lost after
    this is not replaced (`lockstep.launch.recovery.finished`). Only where the script
    imported lockstep: a script without it is not recoverable live anyway."""
    registry = sys.modules.get("lockstep.live.registry")
    if registry is not None:
        registry.post_ended()


def _exit_now(code: int) -> None:
    """Leave at once after a failure, skipping interpreter teardown.

    A failed worker usually still holds a process group whose peer has gone, or a
    collective in flight; tearing that down during interpreter shutdown can abort
    the process ("terminate called without an active exception"), which would
    replace the real exit code with SIGABRT. The error is already recorded.
    """
    trace = sys.modules.get("lockstep.observe.envtrace")
    if trace is not None:  # LOCKSTEP_TRACE: the steps since the last background write
        trace.flush_traces()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
