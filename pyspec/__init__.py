"""pyspec: a speculative-decoding inference engine for GGUF models."""

from . import _core
from .model import Context, DecodeResult, Model, default_model_path, generate
from .llm import LLM

__all__ = ["Context", "DecodeResult", "LLM", "Model", "default_model_path", "generate", "_core"]
__version__ = "0.1.0"
