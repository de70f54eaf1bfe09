#!/usr/bin/env python3
"""Hugging Face -> GGUF for pyspec and llama.cpp; the same as the `pyspec-convert` console script.
The implementation lives in the pyspec package (pyspec/convert/) so the installed script has it.

    python tools/convert_hf_to_gguf.py MODEL_DIR --outfile OUT.gguf --outtype q8_0
    python tools/convert_hf_to_gguf.py DRAFTER_DIR --target-model-dir TARGET --outfile draft.gguf
"""

import sys
from pathlib import Path

try:
    from pyspec.convert import main
except ImportError:
    # A source checkout with an in-place build and no install: the package is one directory up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pyspec.convert import main

if __name__ == "__main__":
    sys.exit(main())
