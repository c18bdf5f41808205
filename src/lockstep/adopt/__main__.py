"""`python -m lockstep.adopt script.py [args]`: a torch DDP script, run on lockstep's engine.

The worker command for launchers that start plain Python processes:
`torchrun --nproc-per-node 2 -m lockstep.adopt train.py` or
`accelerate launch -m lockstep.adopt train.py`. It sets LOCKSTEP_ENGINE=lockstep
(unless already set), installs the adoption, then runs the target as `__main__`.
"""

from __future__ import annotations

import os
import runpy
import sys

from lockstep.adopt import ENGINE_VARIABLE, install_from_env


def main(argv: list[str]) -> None:
    """Run the target adopted; argv as after `python -m lockstep.adopt`."""
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m lockstep.adopt (script.py | -m module) [args]")
    os.environ.setdefault(ENGINE_VARIABLE, "lockstep")
    install_from_env()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
