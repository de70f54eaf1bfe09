"""`pyspec-server`: parse llama-server's flags, start listening at once (every route answers 503
"Loading model" until the model is ready, as llama-server does), load the model (and drafter) on
a thread, then serve through the engine thread (scheduler.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import List, Optional, Sequence

from .args import ArgError, ServerConfig, parse_args

log = logging.getLogger("pyspec.server")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def resolve_paths(cfg: ServerConfig):
    """(target path, draft path or None, whether the draft is the embedded one): -m / -hf / the
    embedded default; -md / -hfd, or with the default model its embedded drafter (issue 9);
    --spec-type none: no drafter."""
    from ..hub import download_gguf
    from ..model import default_drafter_path, default_model_path

    if cfg.model:
        model = cfg.model
    elif cfg.hf_repo:
        model = download_gguf(cfg.hf_repo, cfg.hf_file, cfg.hf_token, cfg.offline)
    else:
        model = default_model_path()
    draft = cfg.model_draft
    if draft is None and cfg.hf_repo_draft:
        draft = download_gguf(cfg.hf_repo_draft, None, cfg.hf_token, cfg.offline)
    embedded = False
    if draft is None and not cfg.model and not cfg.hf_repo and cfg.spec_type != "none":
        draft = default_drafter_path()
        embedded = draft is not None
    if cfg.spec_type == "none":
        draft = None
    return model, draft, embedded


def default_n_max(cfg: ServerConfig, embedded: bool) -> int:
    """--spec-draft-n-max, or when not given llama-server's 3 (the embedded drafter: its tuned
    pyspec.model.DEFAULT_DRAFTER_N_MAX)."""
    from ..model import DEFAULT_DRAFTER_N_MAX

    if cfg.spec_draft_n_max is not None:
        return cfg.spec_draft_n_max
    return DEFAULT_DRAFTER_N_MAX if embedded else 3


class Loaded:
    """Everything the model load produced."""

    def __init__(self, cfg: ServerConfig):
        from .. import _core
        from ..chat import ChatTemplate
        from ..model import Model, embedded_drafter_by_default
        from ..speculative import detect_spec_type, drafter_backend, engine_backend
        from ..tokenizer import Tokenizer
        from .params import generation_settings
        from .scheduler import Scheduler, SchedulerConfig

        self.model_path, draft_path, self.embedded_drafter = resolve_paths(cfg)
        n_threads = cfg.threads if cfg.threads > 0 else None
        # -ngl: not given = the CPU; "auto" = the GPU when CUDA can be used (a log line says
        # which); "all" / N >= n_layer = the GPU or an error with the reason; partial offload is
        # refused (pyspec.model.resolve_gpu_layers).
        self.model = Model(self.model_path, n_threads=n_threads, n_gpu_layers=cfg.n_gpu_layers)
        m = self.model
        # The embedded drafter only where it pays unless speculation was asked for.
        self.embedded_drafter_held_back = False
        if self.embedded_drafter and not embedded_drafter_by_default(m.backend) and \
                cfg.spec_type is None and cfg.spec_draft_n_max is None and cfg.n_gpu_layers_draft is None:
            draft_path, self.embedded_drafter, self.embedded_drafter_held_back = None, False, True
        self.tokenizer = Tokenizer.from_gguf(self.model_path)
        n_slots, n_ctx_slot, unified = cfg.slot_layout(m.n_ctx_train)
        self.n_slots, self.n_ctx_slot, self.unified = n_slots, n_ctx_slot, unified
        self.drafter = None
        self.spec_type = None
        if draft_path is not None:
            try:
                self.drafter = _core.DraftModel(str(draft_path), m._model)
            except (ValueError, RuntimeError) as exc:
                raise ValueError(f"cannot use draft model '{draft_path}' with target "
                                 f"'{self.model_path}': {exc}") from None
            self.spec_type = detect_spec_type(self.drafter)
            if cfg.spec_type not in (None, self.spec_type):
                raise ValueError(f"--spec-type {cfg.spec_type} does not match the draft model "
                                 f"'{draft_path}', which is a {self.spec_type} drafter")
        self.draft_path = draft_path
        # -ngld (not given: as the target); the engine runs both on one backend.
        self.draft_backend = (drafter_backend(cfg.n_gpu_layers_draft, self.drafter, m.backend)
                              if self.drafter is not None else None)
        self.backend = engine_backend(m.backend, self.draft_backend)
        source = cfg.chat_template_file and open(cfg.chat_template_file, encoding="utf-8").read()
        self.chat_template = ChatTemplate.from_tokenizer(
            self.tokenizer, override=source or cfg.chat_template or None)
        sc = SchedulerConfig(
            n_slots=n_slots, n_ctx_slot=n_ctx_slot, n_batch=min(cfg.batch_size, cfg.ubatch_size),
            n_threads=m.n_threads, kv_type=cfg.cache_type_k,
            draft_n_max=default_n_max(cfg, self.embedded_drafter), draft_n_min=cfg.spec_draft_n_min,
            draft_p_min=cfg.spec_draft_p_min, verify=cfg.spec_verify,
            slot_prompt_similarity=cfg.slot_prompt_similarity, backend=self.backend,
            ngram_n=cfg.spec_ngram_size_n if cfg.spec_ngram else 0, ngram_m=cfg.spec_ngram_size_m)
        self.spec_ngram = cfg.spec_ngram
        eog = sorted(self.tokenizer.eog_ids)
        types = ([self.spec_type] if self.spec_type else []) + (["ngram-simple"] if cfg.spec_ngram else [])
        self.scheduler = Scheduler(
            m._model, self.tokenizer, self.drafter, sc,
            settings_json=lambda req: generation_settings(req, eog, speculative_types=types))
        self.file_bytes = os.path.getsize(self.model_path)
        self.draft_file_bytes = os.path.getsize(draft_path) if draft_path else 0

    def warm_up(self) -> None:
        """llama-server's warmup run (--no-warmup skips it): a short greedy request through the
        target and the drafter before the first client's."""
        from ..cli_common import WARMUP_PROMPT, WARMUP_TOKENS

        ids, n = self.tokenizer.encode(WARMUP_PROMPT, add_special=True) or [0], WARMUP_TOKENS
        seconds = self.scheduler.warmup(ids, max_tokens=n)
        log.info("warmup: %.2f s (a %d-token prompt and %d tokens; the weights %s, graphs "
                 "planned; --no-warmup skips it)", seconds, len(ids), n,
                 "uploaded to the GPU" if self.backend == "cuda" else "read and packed")

    def log_summary(self) -> None:
        from .. import _core
        from ..model import embedded_drafter_held_back_note

        m, eng = self.model, self.scheduler.engine
        log.info("model: %s (%s, %d layers, n_embd %d, n_vocab %d, n_ctx_train %d), %d threads",
                 self.model_path, m.arch, m.n_layer, m.n_embd, m.n_vocab, m.n_ctx_train,
                 m.n_threads)
        if self.drafter is not None:
            log.info("drafter: %s (%s, block %d, up to %d drafts per round)%s", self.draft_path,
                     self.spec_type, int(self.drafter.block_size), self.scheduler.draft_n_max,
                     "; the default model's embedded drafter (--spec-type none: off)"
                     if self.embedded_drafter else "")
        elif self.embedded_drafter_held_back:
            log.info("%s", embedded_drafter_held_back_note(self.model.backend))
        elif not self.spec_ngram:
            log.info("speculative decoding: off (no drafter; -md FILE turns it on)")
        if self.spec_ngram:
            c = self.scheduler.config
            log.info("ngram-simple: drafts of up to %d tokens that followed an earlier occurrence of "
                     "the last %d tokens%s", c.ngram_m, c.ngram_n,
                     ", ahead of the drafter" if self.drafter is not None else "")
        log.info("backend: %s", "CUDA (all layers on the GPU; weights uploaded on first use)"
                 if self.backend == "cuda" else "CPU")
        kv = eng.kv_cache_bytes
        log.info("slots: %d x %d tokens%s", self.n_slots, self.n_ctx_slot,
                 " (unified: each slot may use the whole context; KV pages are committed as "
                 "they are written)" if self.unified else "")
        on_gpu = self.backend == "cuda"
        parts = [f"weights {_mib(self.file_bytes)} (memory-mapped"
                 + ("; a copy on the GPU)" if on_gpu else ")"),
                 f"target KV cache {_mib(kv)} reserved" + (" on the GPU" if on_gpu else "")]
        if self.drafter is not None:
            parts.append(f"drafter weights {_mib(self.draft_file_bytes)}")
            parts.append(f"drafter KV cache {_mib(eng.draft_kv_cache_bytes)}")
        # The CPU's packed copies of quantized weights, made on first use (by the warmup run).
        packed = 0 if on_gpu else int(_core.kernels.packed_copy_stats()["bytes"])
        if packed:
            parts.append(f"packed weight copies {_mib(packed)}")
        log.info("memory: %s", ", ".join(parts))

    def model_meta(self) -> dict:
        m = self.model
        return {"vocab_type": 2 if self.tokenizer.model == "gpt2" else 1, "n_vocab": m.n_vocab,
                "n_ctx": self.n_ctx_slot, "n_ctx_train": m.n_ctx_train, "n_embd": m.n_embd,
                "n_params": 0, "size": self.file_bytes, "ftype": ""}


# PYSPEC_SERVER_LOOP / PYSPEC_SERVER_HTTP: uvicorn's event loop and HTTP parser (default "auto":
# uvloop and httptools where installed), for bench/bench_server_decode.py's A/B.
_SERVER_CHOICES = {"PYSPEC_SERVER_LOOP": ("auto", "asyncio", "uvloop"),
                   "PYSPEC_SERVER_HTTP": ("auto", "h11", "httptools")}


def _server_choice(var: str) -> str:
    value = os.environ.get(var, "auto")
    if value not in _SERVER_CHOICES[var]:
        raise ArgError(f"{var}={value!r}: expected one of {', '.join(_SERVER_CHOICES[var])}")
    return value


def run(cfg: ServerConfig, loop: str = "auto", http: str = "auto") -> int:
    import uvicorn

    from .app import AppSettings, create_app
    from .params import RequestDefaults

    for w in cfg.warnings:
        log.warning("%s", w)
    settings = AppSettings(
        model_name=cfg.model_name(), model_path=cfg.model or "",
        defaults=RequestDefaults(
            n_predict=cfg.n_predict, temperature=cfg.temp, top_k=cfg.top_k, top_p=cfg.top_p,
            min_p=cfg.min_p, seed=cfg.seed, repeat_last_n=cfg.repeat_last_n,
            repeat_penalty=cfg.repeat_penalty, presence_penalty=cfg.presence_penalty,
            frequency_penalty=cfg.frequency_penalty, cache_prompt=cfg.cache_prompt),
        api_keys=list(cfg.api_keys), cors_origins=cfg.cors_origins,
        enable_metrics=cfg.metrics, enable_slots=cfg.slots, enable_props=cfg.props,
        jinja=cfg.jinja, aliases=list(cfg.alias), tags=list(cfg.tags),
        n_batch=cfg.batch_size, spm_infill=cfg.spm_infill)
    state = {"scheduler": None}
    app = create_app(settings, lambda: state["scheduler"])
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           loop=loop, http=http, server_header=False,
                                           timeout_keep_alive=min(cfg.timeout, 3600)))
    failed: List[str] = []

    def load() -> None:
        try:
            loaded = Loaded(cfg)
            settings.model_path = loaded.model_path
            settings.tokenizer = loaded.tokenizer
            settings.chat_template = loaded.chat_template
            settings.model_meta = loaded.model_meta()
            if not cfg.model and not cfg.alias and not cfg.hf_repo:
                settings.model_name = os.path.basename(loaded.model_path)
            if cfg.warmup:
                loaded.warm_up()
            loaded.log_summary()
            loaded.scheduler.start()
        except Exception as exc:  # a bad file or flag (or a bug): say so and stop serving
            failed.append(str(exc))
            log.error("failed to load the model: %s", exc)
            server.should_exit = True
            return
        state["loaded"] = loaded
        state["scheduler"] = loaded.scheduler
        log.info("server is listening on http://%s:%d - all slots are idle", cfg.host,
                 server.config.port)

    log.info("starting the HTTP server on %s:%d; loading the model", cfg.host, cfg.port)
    threading.Thread(target=load, name="pyspec-load", daemon=True).start()
    try:
        server.run()
    finally:
        sched = state.get("scheduler")
        if sched is not None:
            sched.stop()
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_args(argv)
        loop, http = _server_choice("PYSPEC_SERVER_LOOP"), _server_choice("PYSPEC_SERVER_HTTP")
    except ArgError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.DEBUG if cfg.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(cfg, loop, http)


if __name__ == "__main__":
    sys.exit(main())
