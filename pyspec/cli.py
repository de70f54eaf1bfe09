"""`pyspec-cli`: generate text from a prompt or chat interactively, with llama-cli's flags.

Generated text goes to stdout as it decodes (after the prompt, unless --no-display-prompt); logs
and llama.cpp-style perf lines go to stderr. Ctrl-C stops a generation cleanly: in conversation
mode it ends the reply and returns to the input prompt, elsewhere it ends the program (code 130).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from . import __version__
from .chat import ChatTemplate, ChatTemplateError, InvalidMessagesError
from .cli_common import WARMUP_PROMPT, WARMUP_TOKENS, UserError, read_user_file
from .sampling import SamplingParams

_D = SamplingParams()
EXIT_INTERRUPTED = 130


class CliError(UserError):
    """A user-facing problem: printed as one `error:` line on stderr, exit code 1."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pyspec-cli", allow_abbrev=False,
        description="Generate text with a GGUF model (flags follow llama.cpp's llama-cli).")
    p.add_argument("-m", "--model", metavar="FNAME",
                   help="GGUF model path (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("-p", "--prompt", metavar="PROMPT",
                   help="prompt to start generation with; in conversation mode the first user "
                        "message (use -sys for a system message)")
    p.add_argument("-f", "--file", metavar="FNAME", help="a text file holding the prompt")
    p.add_argument("-n", "--n-predict", type=int, default=-1, metavar="N",
                   help="number of tokens to predict (default: -1 = until end of generation, "
                        "capped by the context)")
    p.add_argument("--temp", type=float, default=_D.temperature, metavar="N",
                   help=f"temperature; <= 0 is greedy (default: {_D.temperature})")
    p.add_argument("--top-k", type=int, default=_D.top_k, metavar="N",
                   help=f"top-k sampling, 0 = off (default: {_D.top_k})")
    p.add_argument("--top-p", type=float, default=_D.top_p, metavar="N",
                   help=f"top-p sampling, 1.0 = off (default: {_D.top_p})")
    p.add_argument("--min-p", type=float, default=_D.min_p, metavar="N",
                   help=f"min-p sampling, 0.0 = off (default: {_D.min_p})")
    p.add_argument("-s", "--seed", type=int, default=-1, metavar="SEED",
                   help="random seed (default: -1 = a random seed, printed on stderr)")
    p.add_argument("-t", "--threads", type=int, default=-1, metavar="N",
                   help="number of threads (default: -1 = all available cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, metavar="N",
                   help="context size in tokens, 0 = the model's training context (default: 4096)")
    p.add_argument("-b", "--batch-size", type=int, default=512, metavar="N",
                   help="tokens per decode call while reading the prompt (default: 512)")
    p.add_argument("-cnv", "--conversation", "--chat", dest="conversation", action="store_true",
                   help="interactive chat with the model's chat template (/exit or EOF ends it); "
                        "the default when no prompt is given")
    p.add_argument("-sys", "--system-prompt", metavar="PROMPT",
                   help="system message for conversation mode")
    p.add_argument("--chat-template", metavar="JINJA_TEMPLATE",
                   help="chat template: Jinja source or a built-in name (chatml); "
                        "default: the model's own, else chatml")
    p.add_argument("--chat-template-file", metavar="JINJA_TEMPLATE_FILE",
                   help="read the chat template from a file")
    p.add_argument("--no-display-prompt", dest="display_prompt", action="store_false",
                   help="don't print the prompt before the generated text")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-generation tokens")
    p.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft",
                   metavar="FNAME", help="DFlash/DSpark drafter GGUF for speculative decoding")
    p.add_argument("--spec-type", choices=("none", "draft-dflash", "draft-dspark"), default=None,
                   help="speculative decoding type (default: from the drafter file); none: no "
                        "speculative decoding (also not with the default model's embedded "
                        "drafter)")
    p.add_argument("--draft-max", "--spec-draft-n-max", "--draft-n", dest="draft_max", type=int,
                   default=None, metavar="N",
                   help="drafted tokens per round, clamped to the drafter's block "
                        "(default: the drafter's maximum; 2 with the embedded drafter)")
    p.add_argument("--draft-p-min", "--spec-draft-p-min", dest="draft_p_min", type=float,
                   default=0.0, metavar="P",
                   help="stop a draft at the first position whose confidence (DSpark: the "
                        "confidence head; DFlash: the top-1 probability) is below P (default: 0, "
                        "off)")
    p.add_argument("--draft-p-min-mode", "--spec-draft-p-min-mode", dest="draft_p_min_mode",
                   choices=("first", "cumulative"), default="first",
                   help="first: per-position threshold (llama.cpp); cumulative: stop when the "
                        "product of confidences falls below P")
    p.add_argument("--draft-min", "--spec-draft-n-min", "--draft-n-min", dest="draft_min",
                   type=int, default=0, metavar="N",
                   help="drop a draft shorter than N tokens (default: 0)")
    p.add_argument("--spec-verify", choices=("greedy", "rejection", "block"), default=None,
                   help="verification rule (default: greedy at temp 0, rejection otherwise)")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", default=None,
                   metavar="N",
                   help="layers on the GPU: 0 = CPU, 'all' or N >= the model's layers = all on "
                        "the GPU (CUDA), 'auto' = the GPU when available, else the CPU; partial "
                        "offload is not supported yet (default: 0, the CPU)")
    p.add_argument("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl",
                   dest="n_gpu_layers_draft", default=None, metavar="N",
                   help="drafter layers on the GPU, as -ngl (default: as the target)")
    p.add_argument("--warmup", dest="warmup", action="store_true", default=True,
                   help="a throwaway generation before the prompt's, so its timings leave out "
                        "what happens once (packing or uploading the weights, graphs) "
                        "(default: on)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="no warmup run")
    p.add_argument("--version", action="version", version=f"pyspec {__version__}")
    return p


@dataclass
class _Perf:
    """Totals over every generation of the run, for the perf lines at exit."""

    load_seconds: float = 0.0
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    n_decoded: int = 0
    n_decode_tokens: int = 0
    decode_seconds: float = 0.0
    n_sampled: int = 0
    sample_seconds: float = 0.0
    n_rounds: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0

    def add(self, stats) -> None:
        if stats is None:
            return
        if stats.spec is not None:
            self.n_rounds += stats.spec.n_rounds
            self.draft_n += stats.spec.draft_n
            self.draft_n_accepted += stats.spec.draft_n_accepted
        self.n_prompt += stats.n_prompt if stats.prompt_seconds > 0 else 0
        self.prompt_seconds += stats.prompt_seconds
        self.n_decoded += stats.n_decoded
        self.n_decode_tokens += stats.n_decode_tokens
        self.decode_seconds += stats.decode_seconds
        self.n_sampled += stats.n_generated
        self.sample_seconds += stats.sample_seconds

    def report(self, total_seconds: float) -> None:
        sampling = _rate(self.sample_seconds, self.n_sampled, "runs  ")
        prompt = _rate(self.prompt_seconds, self.n_prompt, "tokens")
        # llama.cpp's line counts single-token runs, one token each. A speculative round yields
        # several tokens, so there the line counts tokens, and its rates are per token; the
        # acceptance line below gives the rounds.
        if self.n_rounds:
            decode = _rate(self.decode_seconds, self.n_decode_tokens, "tokens")
        else:
            decode = _rate(self.decode_seconds, self.n_decoded, "runs  ")
        _log(f"pyspec_perf:    sampling time = {sampling}")
        _log(f"pyspec_perf:        load time = {self.load_seconds * 1e3:10.2f} ms")
        _log(f"pyspec_perf: prompt eval time = {prompt}")
        _log(f"pyspec_perf:        eval time = {decode}")
        if self.n_rounds:
            rate = self.draft_n_accepted / self.draft_n if self.draft_n else 0.0
            _log(f"pyspec_perf: draft acceptance = {rate:.5f} ({self.draft_n_accepted} accepted / "
                 f"{self.draft_n} generated), mean len = "
                 f"{1 + self.draft_n_accepted / self.n_rounds:.3f} over {self.n_rounds} rounds")
        _log(f"pyspec_perf:       total time = {total_seconds * 1e3:10.2f} ms / "
             f"{self.n_prompt + self.n_decode_tokens:6d} tokens")


def _rate(seconds: float, n: int, unit: str) -> str:
    ms = seconds * 1e3
    per_token = ms / n if n else 0.0
    per_second = n / seconds if seconds > 0 else 0.0
    return (f"{ms:10.2f} ms / {n:6d} {unit} ({per_token:8.2f} ms per token, "
            f"{per_second:8.2f} tokens per second)")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _emit(text: str) -> None:
    """Writes generated text as UTF-8 whatever the locale says, and shows it at once."""
    if not text:
        return
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is not None:
        sys.stdout.flush()
        buffer.write(text.encode("utf-8", errors="replace"))
        buffer.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def _speculation_flags(args) -> Tuple[bool, bool]:
    """(--spec-type, --draft-max or --spec-verify given; --draft-p-min, --draft-p-min-mode or
    --draft-min given)."""
    return (args.spec_type is not None or args.draft_max is not None or args.spec_verify is not None,
            bool(args.draft_p_min) or bool(args.draft_min) or args.draft_p_min_mode != "first")


def _resolve_drafter(args) -> None:
    """The default model (no -m) speculates with its embedded drafter unless -md names another
    drafter or --spec-type none turns speculation off; args.embedded_drafter says which
    happened."""
    from .model import DEFAULT_DRAFTER_N_MAX, default_drafter_path

    args.embedded_drafter = False
    # Any speculation flag asks for it (the embedded drafter then drafts on every backend).
    args.speculation_asked = any(_speculation_flags(args)) or args.n_gpu_layers_draft is not None
    if args.spec_type == "none":
        if args.model_draft is not None:
            _log("main: --spec-type none: the draft model is not used")
        args.model_draft, args.spec_type = None, None
        return
    if args.model is None and args.model_draft is None:
        path = default_drafter_path()
        args.model_draft = path
        args.embedded_drafter = path is not None
        if args.embedded_drafter and args.draft_max is None:
            args.draft_max = DEFAULT_DRAFTER_N_MAX


def _check_args(args) -> None:
    if args.n_predict < -1:
        raise CliError(f"--n-predict must be -1 (until end of generation) or >= 0, "
                       f"got {args.n_predict}")
    if args.ctx_size < 0:
        raise CliError(f"--ctx-size must be >= 0, got {args.ctx_size}")
    if args.batch_size < 1:
        raise CliError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.seed < -1 or args.seed >= 2 ** 32:
        raise CliError(f"--seed must be -1 or in [0, 2^32), got {args.seed}")
    if args.prompt is not None and args.file is not None:
        raise CliError("give the prompt with -p or -f, not both")
    if args.chat_template is not None and args.chat_template_file is not None:
        raise CliError("give --chat-template or --chat-template-file, not both")
    drafting, pruning = _speculation_flags(args)
    if args.model_draft is None and drafting:
        raise CliError("--spec-type, --draft-max and --spec-verify need a draft model (-md)")
    if args.model_draft is None and pruning:
        raise CliError("--draft-p-min, --draft-p-min-mode and --draft-min need a draft model (-md)")
    for flag, value in (("-ngl", args.n_gpu_layers), ("-ngld", args.n_gpu_layers_draft)):
        if value is not None and value not in ("auto", "all"):
            try:
                int(value)
            except ValueError:
                raise CliError(f"{flag} must be a number of layers, 'auto' or 'all', "
                               f"got '{value}'") from None
    if args.model_draft is None and args.n_gpu_layers_draft is not None:
        raise CliError("-ngld needs a draft model (-md)")
    if not 0.0 <= args.draft_p_min <= 1.0:
        raise CliError(f"--draft-p-min must be in [0, 1], got {args.draft_p_min}")
    if args.draft_min < 0:
        raise CliError(f"--draft-min must be >= 0, got {args.draft_min}")
    if args.draft_max is not None and args.draft_max < 0:
        raise CliError(f"--draft-max must be >= 0, got {args.draft_max}")
    if args.spec_verify == "greedy" and args.temp > 0:
        raise CliError("--spec-verify greedy needs --temp 0 (use rejection or block)")
    if args.model_draft is not None and not os.path.isfile(args.model_draft):
        what = "is a directory" if os.path.isdir(args.model_draft) else "not found"
        raise CliError(f"draft model file '{args.model_draft}' {what}")
    try:
        SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, None)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _load(args):
    """The LLM with the chosen chat template, or a CliError that says what is wrong."""
    from .llm import LLM
    from .model import Model, embedded_drafter_by_default, embedded_drafter_held_back_note

    if args.model is not None and not os.path.isfile(args.model):
        what = "is a directory" if os.path.isdir(args.model) else "not found"
        raise CliError(f"model file '{args.model}' {what}")
    n_threads = args.threads if args.threads > 0 else None
    try:
        model, n_gpu_layers = args.model, args.n_gpu_layers
        if args.embedded_drafter and not args.speculation_asked:
            # The embedded drafter only where it pays (pyspec.model.embedded_drafter_by_default):
            # load the model first to know its backend.
            model, n_gpu_layers = Model(None, n_threads=n_threads, n_gpu_layers=args.n_gpu_layers), None
            if not embedded_drafter_by_default(model.backend):
                args.model_draft, args.draft_max, args.embedded_drafter = None, None, False
                _log("main: " + embedded_drafter_held_back_note(model.backend))
        llm = LLM(model, n_ctx=args.ctx_size, n_threads=n_threads,
                  n_batch=args.batch_size, draft_model=args.model_draft,
                  spec_type=args.spec_type, draft_n_max=args.draft_max,
                  verify=args.spec_verify, draft_p_min=args.draft_p_min,
                  draft_n_min=args.draft_min, draft_p_min_mode=args.draft_p_min_mode,
                  n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=args.n_gpu_layers_draft)
    except (OSError, ValueError, RuntimeError) as exc:
        name = args.model if args.model is not None else "the default model"
        raise CliError(f"failed to load model '{name}': {exc}") from None
    try:
        if args.chat_template_file is not None:
            llm.chat_template = ChatTemplate.from_tokenizer(
                llm.tokenizer, override_file=args.chat_template_file)
        elif args.chat_template is not None:
            llm.chat_template = ChatTemplate.from_tokenizer(llm.tokenizer,
                                                            override=args.chat_template)
    except ChatTemplateError as exc:
        raise CliError(str(exc)) from None
    return llm


def _backend_line(backend: str, ngl) -> str:
    """Which backend runs, and for -ngl auto on the CPU, why not the GPU."""
    line = "CUDA (all layers on the GPU)" if backend == "cuda" else "CPU"
    if backend != "cuda" and ngl is not None and str(ngl) in ("auto", "-1"):
        from .model import cuda_available

        line += f" (-ngl auto: {cuda_available()[1]})"
    return line


def _sampling_kwargs(args, seed: int) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                seed=seed)


def _stream(llm, pieces, collected: List[str]) -> bool:
    """Prints generated pieces as they come; False when Ctrl-C stopped the generation."""
    try:
        for text in pieces:
            collected.append(text)
            _emit(text)
        return True
    except KeyboardInterrupt:
        # Ctrl-C may land outside the generator (while printing), so close it here and say why.
        pieces.close()
        if llm.last_stats is not None:
            llm.last_stats.stop_reason = "interrupted"
        return False


def _complete(llm, args, prompt: str, seed: int, perf: _Perf) -> int:
    max_tokens = None if args.n_predict == -1 else args.n_predict
    try:
        pieces = llm.generate(prompt, max_tokens=max_tokens, stream=True,
                              ignore_eos=args.ignore_eos, **_sampling_kwargs(args, seed))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.display_prompt:
        _emit(prompt)
    rc = 0 if _stream(llm, pieces, []) else EXIT_INTERRUPTED
    _emit("\n")
    perf.add(llm.last_stats)
    _log_end(llm.last_stats)
    return rc


def _log_end(stats) -> None:
    if stats is None:
        return
    reasons = {"eog": "end of generation token", "length": "token limit (-n)",
               "context": "context full (-c)", "interrupted": "interrupted", "stop": "stop string",
               "closed": "closed"}
    _log(f"generate: {stats.n_generated} tokens, stopped by {reasons.get(stats.stop_reason, '?')}")


def _converse(llm, args, seed: int, perf: _Perf) -> int:
    try:
        template = llm.chat_template
    except ChatTemplateError as exc:
        raise CliError(str(exc)) from None
    _log(f"chat: template '{template.name}'; type /exit or send EOF to quit, "
         "Ctrl-C to stop a reply")
    messages = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    pending = _prompt_text(args)
    max_tokens = None if args.n_predict == -1 else args.n_predict
    turn = 0
    while True:
        if pending is not None:
            user, pending = pending, None
            if args.display_prompt:
                _emit(f"> {user}\n")
        else:
            _emit("\n> ")
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:
                _emit("\n")
                return EXIT_INTERRUPTED
            if not line:
                _emit("\n")
                return 0
            user = line.rstrip("\r\n")
            if user.strip() == "/exit":
                return 0
            if not user.strip():
                continue
        messages.append({"role": "user", "content": user})
        try:
            pieces = llm.chat(messages, max_tokens=max_tokens, stream=True,
                              **_sampling_kwargs(args, (seed + turn) % 2 ** 32))
        except (ChatTemplateError, InvalidMessagesError) as exc:
            raise CliError(str(exc)) from None
        except ValueError as exc:
            raise CliError(f"the conversation no longer fits: {exc}") from None
        reply: List[str] = []
        if not _stream(llm, pieces, reply):
            _log("(reply interrupted)")
        _emit("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        perf.add(llm.last_stats)
        turn += 1


def _prompt_text(args) -> Optional[str]:
    if args.file is not None:
        text = read_user_file(args.file, "prompt file", error=CliError)
        # As llama-cli does: a file's final newline ends the file, it is not part of the prompt.
        return text[:-1] if text.endswith("\n") else text
    return args.prompt


def _run(args) -> int:
    start = time.perf_counter()
    _resolve_drafter(args)
    _check_args(args)
    prompt = _prompt_text(args)
    conversation = args.conversation or prompt is None
    if not args.conversation and prompt is None:
        _log("main: no prompt given (-p/-f): starting conversation mode")
    if not conversation and prompt == "":
        raise CliError("the prompt is empty")

    llm = _load(args)
    perf = _Perf(load_seconds=time.perf_counter() - start)
    m = llm.model
    _log(f"load: '{m.path}': {m.arch}, {m.n_layer} layers, n_embd {m.n_embd}, "
         f"vocab {m.n_vocab}, loaded in {perf.load_seconds * 1e3:.0f} ms")
    _log(f"load: backend {_backend_line(m.backend, args.n_gpu_layers)}")
    if args.embedded_drafter and llm.speculative is not None:
        n_max = llm.speculative.draft_n_max
        clamped = (f" (--draft-max {args.draft_max} clamped to the drafter's block)"
                   if args.draft_max is not None and args.draft_max > n_max else "")
        _log(f"load: speculative decoding with the default model's embedded drafter "
             f"'{args.model_draft}', up to {n_max} drafts per round{clamped} (--spec-type none "
             f"turns it off)")
    if llm.speculative is not None:
        _log(f"load: drafter backend "
             f"{_backend_line(llm.speculative.drafter.backend, args.n_gpu_layers_draft)}")
    if args.warmup:
        # As llama-cli's warmup: each LLM call starts from an empty cache, so nothing of it stays.
        t0 = time.perf_counter()
        llm.generate(WARMUP_PROMPT, max_tokens=WARMUP_TOKENS, temperature=0.0)
        _log(f"main: warmup {time.perf_counter() - t0:.2f} s (--no-warmup skips it)")
    seed = args.seed if args.seed != -1 else secrets.randbits(32)
    _log(f"main: n_ctx = {llm.n_ctx}, n_batch = {llm.context.n_batch}, "
         f"n_predict = {args.n_predict}, n_threads = {m.n_threads}")
    _log(f"sampler seed: {seed}")
    _log(f"sampler params: top_k = {args.top_k}, top_p = {args.top_p:.3f}, "
         f"min_p = {args.min_p:.3f}, temp = {args.temp:.3f}")

    rc = 0
    try:
        if conversation:
            rc = _converse(llm, args, seed, perf)
        else:
            rc = _complete(llm, args, prompt, seed, perf)
    finally:
        perf.report(time.perf_counter() - start)
    return rc


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except CliError as exc:
        _log(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        _log("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, and keep Python from complaining
        # about the unflushable stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
