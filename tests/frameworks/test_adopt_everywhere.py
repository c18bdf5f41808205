"""LOCKSTEP_ENGINE reaches every process of the environment: `lockstep-engine.pth`.

A throwaway environment stands for one where lockstep is installed: its
site-packages holds the `.pth` file the package build puts there (checked first),
and reaches this interpreter's packages. In it, processes that never import lockstep
and never ran `python -m lockstep.adopt` build lockstep's engine when the variable
says so: ranks of torch's `mp.spawn` (what Lightning's ddp_spawn uses), and rank 1
of a plain Lightning `strategy="ddp"` script, which Lightning starts again without
the adoption wrapper. Without the variable the line imports nothing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
HERE = Path(__file__).resolve().parent
PTH = "lockstep-engine.pth"
TIMEOUT_S = 240
# each test starts Python processes that import torch (and Lightning) themselves: the
# subprocesses' own bound, not pytest's default of 120 s, ends a stuck one
# (slow: frameworks' imports and ranks are for make test, not the inner loop)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]


def test_the_build_puts_the_pth_file_at_the_top_of_site_packages(tmp_path):
    """What setup.py adds to setuptools' build_py (a wheel is this folder, zipped)."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run(["cp", "-r", str(SRC), str(tmp_path / "src")], check=True)
    built = tmp_path / "built"
    argv = [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(built)]
    subprocess.run(argv, cwd=tmp_path, check=True, capture_output=True, timeout=TIMEOUT_S)
    assert (built / PTH).read_text() == (SRC / PTH).read_text()
    assert (built / "_lockstep_adopt.py").is_file()


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> Path:
    """An environment with lockstep's `.pth` installed, reaching this one's packages."""
    where = tmp_path_factory.mktemp("env") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True)
    purelib = sysconfig.get_paths(vars={"base": str(where)})["purelib"]
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib, "_parent.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    Path(purelib, PTH).write_text((SRC / PTH).read_text())
    return where / "bin" / "python"


def _run(python: Path, argv: list[str], cwd: Path, **env: str) -> str:
    proc = subprocess.run(
        [str(python), *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_without_the_variable_the_line_imports_nothing(python, tmp_path):
    env = {"LOCKSTEP_ENGINE": ""}
    code = "import sys; print(sorted({'torch', '_lockstep_adopt', 'lockstep'} & set(sys.modules)))"
    assert _run(python, ["-c", code], tmp_path, **env).strip() == "[]"
    armed = _run(python, ["-c", code], tmp_path, LOCKSTEP_ENGINE="lockstep")
    assert armed.strip() == "['_lockstep_adopt']", armed  # armed, torch still not imported


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.soak  # three interpreters importing torch: make soak
def test_ranks_of_mp_spawn_build_lockstep_engine_from_the_variable_alone(python, tmp_path):
    argv = [str(HERE / "spawn_ranks.py"), str(_free_port())]
    out = _run(python, argv, tmp_path, LOCKSTEP_ENGINE="lockstep")
    assert "rank 0: wrapper TorchFacedDDP" in out and "rank 1: wrapper TorchFacedDDP" in out, out
    assert out.count("built lockstep's engine on all 2 ranks") == 1, out


@pytest.mark.soak
@pytest.mark.slow
def test_lightning_relaunch_builds_lockstep_engine_on_every_rank(python, tmp_path):
    """`python -m lockstep.adopt` on a plain Lightning script: rank 1 is Lightning's."""
    argv = ["-m", "lockstep.adopt", str(HERE / "plain_lightning.py")]
    out = _run(python, argv, tmp_path, LOCKSTEP_ENGINE="")
    assert "rank 0: wrapper TorchFacedDDP" in out and "rank 1: wrapper TorchFacedDDP" in out, out
    assert out.count("built lockstep's engine on all 2 ranks") == 1, out
