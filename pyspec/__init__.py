"""pyspec: a speculative-decoding inference engine for GGUF models."""

from . import _core
from .model import Context, DecodeResult, Model, default_model_path, generate

__all__ = ["Context", "DecodeResult", "Model", "default_model_path", "generate", "_core"]
__version__ = "0.1.0"
