"""The one build step pyproject.toml cannot say: `lockstep-engine.pth` beside the package.

Everything else is in pyproject.toml. Python reads `.pth` files only at the top of
site-packages, so the file goes there, in a wheel and in an editable install alike;
`src/_lockstep_adopt.py` says what its one line does (nothing unless LOCKSTEP_ENGINE
is set).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path(__file__).resolve().parent / "src" / "lockstep-engine.pth"


class BuildPyWithPth(build_py):
    """build_py, plus the `.pth` file at the top of what becomes site-packages."""

    def run(self) -> None:
        super().run()
        target = self.build_lib
        if getattr(self, "editable_mode", False):  # an editable wheel is the install folder
            target = self.get_finalized_command("install").install_lib
        self.copy_file(str(PTH), str(Path(target) / PTH.name))


setup(cmdclass={"build_py": BuildPyWithPth})
