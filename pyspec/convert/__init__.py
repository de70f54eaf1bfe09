"""pyspec-convert: Hugging Face checkpoints (config.json + safetensors) to GGUF files that both
pyspec and llama.cpp load.

    pyspec-convert MODEL_DIR --outfile OUT.gguf --outtype q8_0
    pyspec-convert DRAFTER_DIR --target-model-dir TARGET_DIR_OR_GGUF --outfile draft.gguf

Targets: LlamaForCausalLM (GGUF arch llama), Qwen3ForCausalLM (qwen3). Drafters: DFlashDraftModel
and the DSpark family (DSparkDraftModel, Qwen3DSparkModel, DSparkSpeculator), written as arch
dflash with the target's tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import List, Optional, Union

from .checkpoint import architecture_of, read_config
from .drafters import DRAFTER_ARCHS, plan_drafter
from .errors import ConversionError
from .gguf_out import OUTTYPES, Summary, write
from .targets import TARGET_ARCHS, plan_target

__all__ = ["convert", "main", "ConversionError", "Summary", "OUTTYPES", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = tuple(TARGET_ARCHS) + DRAFTER_ARCHS

PathLike = Union[str, Path]


def convert(model_dir: PathLike, outfile: Optional[PathLike] = None, outtype: str = "f16",
            target_model_dir: Optional[PathLike] = None, progress: bool = True) -> Summary:
    """Convert the Hugging Face model in `model_dir` to GGUF and return a summary of what was
    written. Raises ConversionError with a message for anything the user can fix.

    outfile defaults to MODEL_DIR/<dir name>-<outtype>.gguf; outtype is one of f32, f16, bf16,
    q8_0, q4_0, q4_1; target_model_dir (required for drafters) is the target's Hugging Face
    directory or its GGUF file."""
    model_dir = Path(model_dir)
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype '{outtype}' (choose from {', '.join(OUTTYPES)})")
    if not model_dir.is_dir():
        raise ConversionError(f"{model_dir} is not a directory")
    config = read_config(model_dir)
    hf_arch = architecture_of(config, model_dir)
    name = model_dir.resolve().name
    if hf_arch in TARGET_ARCHS:
        if target_model_dir is not None:
            raise ConversionError(f"--target-model-dir is only for drafters, and {hf_arch} is a "
                                  "target model")
        plan = plan_target(model_dir, config, hf_arch, name)
    elif hf_arch in DRAFTER_ARCHS:
        plan = plan_drafter(model_dir, config, hf_arch, name,
                            Path(target_model_dir) if target_model_dir is not None else None)
    else:
        raise ConversionError(f"unknown architecture '{hf_arch}' in {model_dir / 'config.json'} "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    out = Path(outfile) if outfile is not None else model_dir / f"{name}-{outtype}.gguf"
    return write(plan, out, outtype, progress=progress)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        return msg if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {msg}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pyspec-convert",
        description="Convert a Hugging Face model (target or DFlash/DSpark drafter) to GGUF.")
    parser.add_argument("model_dir", type=Path, help="Hugging Face model directory")
    parser.add_argument("--outfile", type=Path, default=None,
                        help="output GGUF path (default: MODEL_DIR/<name>-<outtype>.gguf)")
    parser.add_argument("--outtype", choices=list(OUTTYPES), default="f16",
                        help="type of the weight matrices (norms and vectors stay f32; default f16)")
    parser.add_argument("--target-model-dir", type=Path, default=None,
                        help="for drafters: the target's Hugging Face directory or GGUF file "
                             "(its tokenizer is copied into the drafter)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    log = logging.getLogger("pyspec.convert")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        summary = convert(args.model_dir, args.outfile, args.outtype, args.target_model_dir,
                          progress=not args.no_progress)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        log.removeHandler(handler)
        log.propagate = True
    print(summary.format())
    return 0
