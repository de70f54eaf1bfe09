"""Shared test helpers."""

import os
from pathlib import Path

import pyspec

# The directory holding the pyspec package these tests imported: the source tree after an
# in-place developer build, site-packages after `pip install .`. Subprocesses must import the
# same one, so they get it on PYTHONPATH and run from a neutral working directory (`python -m`
# puts the working directory first on sys.path, and a source checkout without an in-place build
# has no compiled core).
PYSPEC_PARENT = Path(pyspec.__file__).resolve().parents[1]


def subprocess_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(PYSPEC_PARENT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
