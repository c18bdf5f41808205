"""`python -m lockstep.adopt script.py [args]`: a torch DDP script, run on lockstep's engine.

The worker command for launchers that start plain Python processes:
`torchrun --nproc-per-node 2 -m lockstep.adopt train.py` or
`accelerate launch -m lockstep.adopt train.py`. It sets LOCKSTEP_ENGINE=lockstep
(unless already set), installs the adoption, then runs the target as `__main__`.
The processes the target starts itself (Lightning's relaunch, `mp.spawn`) inherit
the variable; lockstep's `.pth` file (`src/_lockstep_adopt.py`) adopts them.
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
    # Unset or empty: lockstep's. The processes the target starts inherit the variable.
    if not os.environ.get(ENGINE_VARIABLE, "").strip():
        os.environ[ENGINE_VARIABLE] = "lockstep"
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
