"""`pyspec-tokenize`: print the tokens of a text, as llama-tokenize does.

    pyspec-tokenize -m MODEL (-p TEXT | -f FILE | --stdin) [--ids] [--no-bos] [--parse-special]

With --ids the ids are printed as one list, `[504, 3575, 282]`; otherwise one line per token,
`   504 -> 'The'`, the piece written as its raw bytes. As in llama-tokenize, escape sequences
(\\n, \\t, \\xNN, ...) in the text are processed unless --no-escape, and a BOS token is added when
the vocabulary asks for one unless --no-bos. Unlike llama-tokenize, special-token text such as
"<|im_start|>" is tokenized as plain text unless --parse-special is given.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .cli_common import UserArgumentParser, UserError, read_user_file

_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'",
            ord('"'): b'"', ord("\\"): b"\\"}
_HEX = b"0123456789abcdefABCDEF"


class TokenizeError(UserError):
    """A user-facing problem: printed as one line, exit code 1."""


def process_escapes(data: bytes) -> bytes:
    """llama.cpp's string_process_escapes: \\n \\r \\t \\' \\" \\\\ and \\xNN become the bytes they
    name; any other backslash pair is kept as written."""
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        c = data[i]
        if c != 0x5C or i + 1 >= n:  # not a backslash, or a backslash that ends the text
            out.append(c)
            i += 1
            continue
        e = data[i + 1]
        if e in _ESCAPES:
            out += _ESCAPES[e]
            i += 2
        elif e == ord("x") and i + 3 < n and data[i + 2] in _HEX and data[i + 3] in _HEX:
            out.append(int(data[i + 2:i + 4], 16))
            i += 4
        else:
            out += data[i:i + 2]
            i += 2
    return bytes(out)


def _parser() -> argparse.ArgumentParser:
    p = UserArgumentParser(
        prog="pyspec-tokenize",
        description="Tokenize a text with a GGUF model's tokenizer and print the tokens "
                    "(llama-tokenize's output format).")
    p.add_model_argument()
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="the text to tokenize")
    src.add_argument("-f", "--file", default=None, help="a file holding the text to tokenize")
    src.add_argument("--stdin", action="store_true", help="read the text from standard input")
    p.add_argument("--ids", action="store_true", help="print only the ids, as [1, 2, 3]")
    p.add_argument("--no-bos", action="store_true",
                   help="do not add the BOS token even if the vocabulary asks for it")
    special = p.add_mutually_exclusive_group()
    special.add_argument("--parse-special", dest="parse_special", action="store_true",
                         help="turn special-token text (e.g. <|im_start|>) into those tokens")
    special.add_argument("--no-parse-special", dest="parse_special", action="store_false",
                         help="tokenize special-token text as plain text (the default)")
    p.add_argument("--no-escape", action="store_true",
                   help="do not process escape sequences (\\n, \\t, \\xNN, ...) in the text")
    p.add_argument("--show-count", action="store_true", help="print the number of tokens")
    p.add_argument("--log-disable", action="store_true",
                   help="accepted for llama-tokenize compatibility (pyspec logs nothing here)")
    return p


def _read_text(args) -> bytes:
    if args.prompt is not None:
        # Command-line arguments are str; surrogateescape gives back the bytes the shell passed.
        return args.prompt.encode("utf-8", errors="surrogateescape")
    if args.file is not None:
        return read_user_file(args.file, "text file", binary=True, error=TokenizeError)
    if args.stdin:
        return sys.stdin.buffer.read()
    raise TokenizeError("no text: give one of -p TEXT, -f FILE or --stdin")


def _run(args) -> int:
    data = _read_text(args)
    if not args.no_escape:
        data = process_escapes(data)
    text = data.decode("utf-8", errors="replace")

    from .model import default_model_path
    from .tokenizer import Tokenizer

    try:
        path = args.model if args.model is not None else default_model_path()
        tok = Tokenizer.from_gguf(path)
    except (ValueError, RuntimeError, OSError) as exc:
        raise TokenizeError(f"cannot load the tokenizer: {exc}") from None

    # llama-tokenize passes "add BOS" as add_special, so --no-bos also drops an added EOS.
    ids = tok.encode(text, add_special=tok.add_bos and not args.no_bos,
                     parse_special=args.parse_special)

    out = sys.stdout.buffer
    if args.ids:
        out.write(("[" + ", ".join(str(t) for t in ids) + "]\n").encode())
    else:
        for t in ids:
            out.write(f"{t:6d} -> '".encode() + tok.token_to_piece(t) + b"'\n")
    if args.show_count:
        out.write(f"Total number of tokens: {len(ids)}\n".encode())
    out.flush()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (TokenizeError, ValueError, RuntimeError) as exc:
        print(f"pyspec-tokenize: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
