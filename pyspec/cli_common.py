"""Pieces shared by the console scripts (pyspec-cli, pyspec-tokenize, pyspec-perplexity)."""

from __future__ import annotations

import argparse
from typing import Type, Union

# The warmup request of pyspec-cli and pyspec-server (llama.cpp's warmup run): a short greedy
# generation that does the one-time work (packing or uploading weights, graphs) before the first
# real one.
WARMUP_PROMPT = "Hello"
WARMUP_TOKENS = 3


class UserError(Exception):
    """A user-facing problem (bad flag value, unreadable file, ...): printed as one line, exit
    code 1. Each script raises its own subclass."""


class UserArgumentParser(argparse.ArgumentParser):
    """Bad flags are user errors like any other: one line and exit code 1 (argparse uses 2)."""

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message}\n")

    def add_model_argument(self) -> None:
        """-m/--model, the GGUF file to use (None: the embedded default model)."""
        self.add_argument("-m", "--model", default=None,
                          help="GGUF model path (default: the embedded SmolLM2-135M-Instruct Q4_1)")


def read_user_file(path: str, what: str, binary: bool = False,
                   error: Type[UserError] = UserError) -> Union[str, bytes]:
    """The contents of a file the user named, as bytes when `binary`, else as UTF-8 text (with
    universal newlines). A missing, unreadable or (text only) non-UTF-8 file raises `error` with
    one clear line that names it as `what` (e.g. "prompt file")."""
    try:
        if binary:
            with open(path, "rb") as f:
                return f.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise error(f"{what} '{path}' not found") from None
    except IsADirectoryError:
        raise error(f"{what} '{path}' is a directory") from None
    except OSError as exc:
        raise error(f"cannot read {what} '{path}': {exc.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{what} '{path}' is not UTF-8 text") from None
