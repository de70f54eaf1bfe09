#!/usr/bin/env python3
"""Train a DSpark drafter for a GGUF target; the same as the `pyspec-train-drafter` console
script. The implementation lives in the pyspec package (pyspec/train/) so the installed script
has it. Needs PyTorch.

    python tools/train_drafter.py --smoke --out /tmp/smoke
    python tools/train_drafter.py --target T.gguf --out DIR --device cuda --steps 3000
"""

import sys
from pathlib import Path

try:
    from pyspec.train import main
except ImportError:
    # A source checkout with an in-place build (or an older install without pyspec.train): the
    # package is one directory up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    for name in [m for m in sys.modules if m == "pyspec" or m.startswith("pyspec.")]:
        del sys.modules[name]
    from pyspec.train import main

if __name__ == "__main__":
    sys.exit(main())
