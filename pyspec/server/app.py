"""The FastAPI application: llama-server's routes, the loading gate, API key, CORS and errors
(reference §1.0-1.10).

Generation never blocks the event loop: Scheduler.submit only queues, and results are awaited
through the RequestHandle's async iterator. A client that goes away cancels its handles (a task
watching the ASGI `http.disconnect` message), so the engine frees the slot at its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .infill import check_infill_support, infill_fields, infill_tokens
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, MetricsExporter
from .params import (CompletionParams, RequestDefaults, generation_settings, parse_chat,
                     parse_completion, render_chat, tokenize_mixed)
from .responses import (SSE_DONE, ResponseContext, chat_completion, chat_content_chunk,
                        chat_finish_chunk, chat_role_chunk, chat_usage_chunk, dumps,
                        native_final, native_partial, oai_completion, oai_completion_chunk,
                        oai_completion_final_chunk, sse)
from .types import Chunk, Final, ServerError

log = logging.getLogger("pyspec.server")

JSON_CONTENT_TYPE = "application/json; charset=utf-8"
PUBLIC_PATHS = ("/health", "/v1/health")  # no API key needed


@dataclass
class AppSettings:
    """What the HTTP layer needs from the CLI and the loaded model.

    `tokenizer` and `chat_template` may be filled in after create_app (the listener starts
    before the model loads) but must be set before get_scheduler() returns a scheduler: the
    loading gate keeps every route that reads them closed until then.
    """

    model_name: str                                  # ServerConfig.model_name()
    model_path: str = ""                             # -m as given
    tokenizer: Any = None                            # pyspec.tokenizer.Tokenizer
    chat_template: Any = None                        # pyspec.chat.ChatTemplate
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    api_keys: List[str] = field(default_factory=list)
    cors_origins: Any = "*"                          # --cors-origins (comma string or list)
    enable_metrics: bool = False                     # --metrics
    enable_slots: bool = True                        # --slots / --no-slots
    enable_props: bool = False                       # --props (POST /props)
    jinja: bool = False
    aliases: List[str] = field(default_factory=list)
    tags: List[str] = field(default_factory=list)
    model_meta: Dict[str, Any] = field(default_factory=dict)  # n_ctx_train, n_embd, n_params,
                                                              # size, ftype (for /v1/models)
    build_info: str = f"b{__version__}-pyspec"       # system_fingerprint and /props build_info
    sse_ping_interval: float = 30.0                  # keep-alive comment when no token comes
    n_batch: int = 2048                              # -b: /infill cuts its prompt parts by it
    spm_infill: bool = False                         # --spm-infill


def _error(err: ServerError) -> JSONResponse:
    return JSONResponse(err.to_json(), status_code=err.code, media_type=JSON_CONTENT_TYPE)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type=JSON_CONTENT_TYPE)


def _origin_allowed(origin: str, allowed) -> bool:
    if isinstance(allowed, str):
        allowed = allowed.split(",")
    entries = [o.strip() for o in allowed if o.strip()]
    if "*" in entries:
        return True
    host = origin.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    return origin in entries or host in entries


class _Gate:
    """Pure ASGI middleware (BaseHTTPMiddleware would get between streaming responses and the
    client's disconnect): Server header, CORS, OPTIONS pre-flight, the loading gate, API key."""

    def __init__(self, app, settings: AppSettings, get_scheduler):
        self.app = app
        self.settings = settings
        self.get_scheduler = get_scheduler

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        extra = [(b"server", b"llama.cpp")]
        origin = headers.get("origin")
        if origin is not None and _origin_allowed(origin, self.settings.cors_origins):
            extra += [(b"access-control-allow-origin", origin.encode("latin-1")),
                      (b"access-control-allow-credentials", b"true")]

        started = False

        async def send_with_headers(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + extra
            await send(message)

        if scope["method"] == "OPTIONS":  # CORS pre-flight bypasses key and loading checks
            resp = Response(b"", status_code=200, headers={
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": "*"})
            return await resp(scope, receive, send_with_headers)
        if self.get_scheduler() is None:
            resp = _error(ServerError("Loading model", "unavailable_error", 503))
            return await resp(scope, receive, send_with_headers)
        if self.settings.api_keys and scope["path"] not in PUBLIC_PATHS:
            offered = [headers.get("x-api-key")]
            auth = headers.get("authorization")
            if auth is not None:  # "Bearer " is optional, as in llama
                offered.append(auth[len("Bearer "):] if auth.startswith("Bearer ") else auth)
            if not any(k is not None and k in self.settings.api_keys for k in offered):
                resp = _error(ServerError("Invalid API Key", "authentication_error", 401))
                return await resp(scope, receive, send_with_headers)
        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as exc:  # a bug, not bad input: log it, answer llama's 500 JSON
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if not started:
                resp = _error(ServerError(f"{type(exc).__name__}: {exc}", "server_error", 500))
                await resp(scope, receive, send_with_headers)


async def _body(request: Request) -> Any:
    """The JSON body. A parse error is a 500 server_error, as llama's json::parse throws a
    parse_error that its handler wrapper does not map to 400."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        line = getattr(exc, "lineno", 1)
        col = getattr(exc, "colno", 1)
        msg = getattr(exc, "msg", str(exc))
        raise ServerError(f"[json.exception.parse_error.101] parse error at line {line}, "
                          f"column {col}: syntax error while parsing value - {msg}",
                          "server_error", 500) from None


async def _watch_disconnect(request: Request, handles) -> None:
    """Cancels the handles when the client disconnects (the body was already read, so the next
    ASGI message is the disconnect), then returns: the task being done means "client gone".
    The request's own code also stops waiting then, since a cancelled handle need not yield
    anything more."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for h in handles:
                    h.cancel()
                return
    except Exception:  # no disconnect signal to watch: never report one
        await asyncio.Future()


_END = object()


async def _merge(handles) -> AsyncIterator[Tuple[int, Any]]:
    """(index, item) from all handles as they come; a ServerError from any handle is raised."""
    if len(handles) == 1:
        async for item in handles[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, h):
        try:
            async for item in h:
                await queue.put((i, item))
            await queue.put((i, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class _Results:
    """Per-request rendering state for the three formats (native, oai_cmpl, chat)."""

    def __init__(self, kind: str, ctx: ResponseContext, params: CompletionParams, tasks,
                 settings_json: dict, logprobs: bool):
        self.kind, self.ctx, self.params, self.tasks = kind, ctx, params, tasks
        self.settings_json = settings_json
        self.logprobs = logprobs
        self.n_predicted = [0] * len(tasks)
        self.finals: List[Optional[Final]] = [None] * len(tasks)
        self.started = [False] * len(tasks)

    def prompt_finals(self) -> List[Final]:
        # usage counts each prompt once, whatever n is
        return [self.finals[i] for i in range(0, len(self.tasks), self.params.n_cmpl)]

    def events(self, index: int, item) -> List[bytes]:
        """The SSE events of one scheduler item."""
        ctx, n_probs = self.ctx, self.tasks[index].n_probs
        out = []
        if self.kind == "chat" and not self.started[index]:
            out.append(sse(chat_role_chunk(ctx, index)))
        self.started[index] = True
        if isinstance(item, Chunk):
            self.n_predicted[index] += len(item.tokens)
            if not item.text and not item.tokens:
                return out
            if self.kind == "native":
                out.append(sse(native_partial(ctx, item, index, self.n_predicted[index],
                                              len(self.tasks[index].prompt_ids), n_probs)))
            elif self.kind == "oai_cmpl":
                out.append(sse(oai_completion_chunk(ctx, item, index, n_probs)))
            elif item.text or self.logprobs:
                out.append(sse(chat_content_chunk(ctx, item, index, self.logprobs)))
            return out
        self.finals[index] = item
        last = all(f is not None for f in self.finals)
        if self.kind == "native":
            out.append(sse(native_final(ctx, item, self.tasks[index], index, self.settings_json,
                                        stream=True)))
        elif self.kind == "oai_cmpl":
            out.append(sse(oai_completion_final_chunk(ctx, item, index)))
        else:
            include_usage = self.params.include_usage
            out.append(sse(chat_finish_chunk(ctx, item, index,
                                             with_timings=last and not include_usage)))
            if last and include_usage:
                out.append(sse(chat_usage_chunk(ctx, self.finals, self.prompt_finals())))
        if last and self.kind != "native":
            out.append(SSE_DONE)
        return out

    def final_json(self) -> Any:
        finals = self.finals
        if self.kind == "native":
            objs = [native_final(self.ctx, f, self.tasks[i], i, self.settings_json,
                                 return_tokens=self.params.return_tokens)
                    for i, f in enumerate(finals)]
            return objs[0] if len(objs) == 1 else objs
        n_probs = self.tasks[0].n_probs
        if self.kind == "oai_cmpl":
            return oai_completion(self.ctx, finals, n_probs, self.prompt_finals())
        return chat_completion(self.ctx, finals, self.logprobs, self.prompt_finals())


def create_app(settings: AppSettings, get_scheduler: Callable[[], Any]) -> FastAPI:
    """The application. `get_scheduler()` returns None while the model loads (every path
    answers 503 "Loading model"), then the Scheduler."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Gate, settings=settings, get_scheduler=get_scheduler)
    exporter: Dict[str, MetricsExporter] = {}

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code in (404, 405):  # llama's router: any unknown path/method pair
            return _error(ServerError("File Not Found", "not_found_error", 404))
        return _error(ServerError(str(exc.detail), "server_error", exc.status_code))

    def scheduler():
        s = get_scheduler()
        if s is None:  # the gate already answered; only a race with shutdown gets here
            raise ServerError("Loading model", "unavailable_error", 503)
        return s

    def context() -> ResponseContext:
        return ResponseContext(settings.tokenizer, settings.model_name, settings.build_info)

    # -- health, models, props ---------------------------------------------------------------

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return _json({"status": "ok"})

    @app.get("/models")
    @app.get("/v1/models")
    async def models():
        s = scheduler()
        tok, meta, name = settings.tokenizer, settings.model_meta, settings.model_name
        return _json({
            "models": [{
                "name": name, "model": name, "modified_at": "", "size": "", "digest": "",
                "type": "model", "description": "", "tags": [""],
                "capabilities": ["completion"], "parameters": "",
                "details": {"parent_model": "", "format": "gguf", "family": "",
                            "families": [""], "parameter_size": "",
                            "quantization_level": ""}}],
            "object": "list",
            "data": [{
                "id": name, "aliases": sorted(settings.aliases), "tags": list(settings.tags),
                "object": "model", "created": int(time.time()), "owned_by": "llamacpp",
                "meta": {"vocab_type": 1 if tok.model == "llama" else 2,
                         "n_vocab": tok.n_vocab, "n_ctx": s.n_ctx_slot,
                         "n_ctx_train": meta.get("n_ctx_train", 0),
                         "n_embd": meta.get("n_embd", 0), "n_params": meta.get("n_params", 0),
                         "size": meta.get("size", 0), "ftype": meta.get("ftype", "")}}],
        })

    def default_settings_json(s) -> dict:
        from .types import GenerationRequest
        d = settings.defaults
        req = GenerationRequest(prompt_ids=[], n_predict=d.n_predict, temperature=d.temperature,
                                top_k=d.top_k, top_p=d.top_p, min_p=d.min_p, seed=d.seed,
                                repeat_last_n=d.repeat_last_n, repeat_penalty=d.repeat_penalty,
                                presence_penalty=d.presence_penalty,
                                frequency_penalty=d.frequency_penalty, stop=list(d.stop),
                                n_probs=d.n_probs, cache_prompt=d.cache_prompt)
        return generation_settings(req, speculative_types=["draft"] if s.speculative else [])

    def token_text(tid) -> str:
        if tid is None or tid < 0:
            return ""
        return settings.tokenizer.token_to_piece(tid).decode("utf-8", errors="replace")

    @app.get("/props")
    async def props():
        s = scheduler()
        tmpl = settings.chat_template
        return _json({
            "default_generation_settings": {"params": default_settings_json(s),
                                            "n_ctx": s.n_ctx_slot},
            "total_slots": s.n_slots,
            "model_alias": settings.model_name,
            "model_ftype": settings.model_meta.get("ftype", ""),
            "model_path": settings.model_path,
            "modalities": {"vision": False, "audio": False},
            "media_marker": "<__media__>",
            "endpoint_slots": settings.enable_slots,
            "endpoint_props": settings.enable_props,
            "endpoint_metrics": settings.enable_metrics,
            "ui": False,
            "ui_settings": {},
            "chat_template": tmpl.source if tmpl is not None else "",
            "chat_template_caps": {},
            "bos_token": token_text(settings.tokenizer.bos_id),
            "eos_token": token_text(settings.tokenizer.eos_id),
            "build_info": settings.build_info,
            "is_sleeping": False,
            "cors_proxy_enabled": False,
        })

    @app.post("/props")
    async def set_props(request: Request):
        if not settings.enable_props:
            raise ServerError("This server does not support changing global properties. "
                              "Start it with `--props`", "not_supported_error", 501)
        await _body(request)
        return _json({"success": True})

    # -- slots, metrics ----------------------------------------------------------------------

    @app.get("/slots")
    async def slots(request: Request):
        if not settings.enable_slots:
            raise ServerError("This server does not support slots endpoint. Start it with "
                              "`--slots`", "not_supported_error", 501)
        data = scheduler().slots()
        fail = request.query_params.get("fail_on_no_slot", "")
        if fail not in ("", "0", "false") and not any(not sl.get("is_processing") for sl in data):
            raise ServerError("no slot available", "unavailable_error", 503)
        return _json(data)

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: str):
        raise ServerError("This server does not support slots action. Start it with "
                          "`--slot-save-path`", "not_supported_error", 501)

    # Embeddings and reranking need --embedding/--reranking in llama; we have neither.
    @app.post("/embedding")
    @app.post("/embeddings")
    @app.post("/v1/embeddings")
    async def embeddings():
        raise ServerError("This server does not support embeddings. Start it with "
                          "`--embeddings`", "not_supported_error", 501)

    @app.post("/rerank")
    @app.post("/reranking")
    @app.post("/v1/rerank")
    @app.post("/v1/reranking")
    async def rerank():
        raise ServerError("This server does not support reranking. Start it with "
                          "`--reranking`", "not_supported_error", 501)

    @app.get("/metrics")
    async def metrics():
        if not settings.enable_metrics:
            raise ServerError("This server does not support metrics endpoint. Start it with "
                              "`--metrics`", "not_supported_error", 501)
        scheduler()
        if "e" not in exporter:
            exporter["e"] = MetricsExporter(lambda: get_scheduler().metrics())
        # set as a header: Starlette would append "; charset=utf-8" to a text/ media_type
        return Response(exporter["e"].render(),
                        headers={"Content-Type": METRICS_CONTENT_TYPE,
                                 "Process-Start-Time-Unix": str(int(_START_TIME))})

    # -- tokens and templates ------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(request: Request):
        scheduler()
        body = await _body(request)
        if not isinstance(body, dict) or body.get("content") is None:
            return _json({"tokens": []})
        content = body["content"]
        if not isinstance(content, (str, list)):
            raise ServerError("Field 'content': expected a string or an array")
        add_special = bool(body.get("add_special", False))
        parse_special = bool(body.get("parse_special", True))
        ids = tokenize_mixed(settings.tokenizer, content, add_special, parse_special)
        if not body.get("with_pieces", False):
            return _json({"tokens": ids})
        out = []
        for t in ids:
            piece = settings.tokenizer.token_to_piece(t)
            try:
                out.append({"id": t, "piece": piece.decode("utf-8")})
            except UnicodeDecodeError:  # part of a character: the raw bytes
                out.append({"id": t, "piece": list(piece)})
        return _json({"tokens": out})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        scheduler()
        body = await _body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if tokens is None:
            tokens = []
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ServerError("Field 'tokens': expected an array of token ids")
        n_vocab = settings.tokenizer.n_vocab
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise ServerError(f"invalid token id {bad[0]} (the vocabulary has {n_vocab} tokens)")
        # llama joins the pieces as they are (tokens_to_str)
        return _json({"content": settings.tokenizer.decode(tokens, continuation=True)})

    @app.post("/apply-template")
    async def apply_template(request: Request):
        scheduler()
        body = await _body(request)
        return _json({"prompt": render_chat(body, settings.chat_template, settings.jinja)})

    # -- generation ----------------------------------------------------------------------------

    async def generate(request: Request, kind: str, body: Any = None):
        s = scheduler()
        if body is None:
            body = await _body(request)
        if kind == "chat":
            params = parse_chat(body, settings.tokenizer, settings.chat_template,
                                settings.defaults, s.n_slots, settings.jinja, s.speculative)
            logprobs = bool(body.get("logprobs")) and params.base.n_probs > 0
        else:
            params = parse_completion(body, settings.tokenizer, settings.defaults, s.n_slots,
                                      speculative=s.speculative)
            logprobs = params.base.n_probs > 0
        tasks = params.tasks()
        eog = sorted(settings.tokenizer.eog_ids)
        settings_json = generation_settings(params.base, eog, params.stream,
                                            speculative_types=params.speculative_types,
                                            timings_per_token=params.timings_per_token)
        handles = []
        try:
            for t in tasks:
                handles.append(s.submit(t, stream=params.stream))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        results = _Results(kind, context(), params, tasks, settings_json, logprobs)
        watcher = asyncio.ensure_future(_watch_disconnect(request, handles))
        stream = _merge(handles)
        if not params.stream:
            async def collect():
                async for i, item in stream:
                    if isinstance(item, Final):
                        results.finals[i] = item

            collecting = asyncio.ensure_future(collect())
            try:
                await asyncio.wait({collecting, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not collecting.done():  # the client left: nobody reads an answer
                    collecting.cancel()
                    await asyncio.wait({collecting})
                    return Response(status_code=499)
                collecting.result()  # raises the request's ServerError
                return _json(results.final_json())
            finally:
                watcher.cancel()
                for h in handles:
                    h.cancel()  # idempotent; frees what a failed sibling left running
                await stream.aclose()

        # A stream's first result decides: an error is a plain JSON error with its status.
        try:
            first = await stream.__anext__()
        except BaseException:
            watcher.cancel()
            for h in handles:
                h.cancel()
            await stream.aclose()
            raise

        ping = body.get("sse_ping_interval") if isinstance(body, dict) else None
        if isinstance(ping, bool) or not isinstance(ping, (int, float)) or ping <= 0:
            ping = settings.sse_ping_interval

        async def events():
            nxt = None
            try:
                for ev in results.events(*first):
                    yield ev
                while True:
                    nxt = asyncio.ensure_future(stream.__anext__())
                    while not nxt.done():
                        await asyncio.wait({nxt, watcher}, timeout=ping,
                                           return_when=asyncio.FIRST_COMPLETED)
                        if watcher.done() and not nxt.done():
                            return  # the client left (the handles are cancelled)
                        if not nxt.done():
                            yield b":\n\n"  # keep-alive, as llama's --sse-ping-interval
                    try:
                        i, item = nxt.result()
                    except StopAsyncIteration:
                        break
                    for ev in results.events(i, item):
                        yield ev
            except ServerError as exc:
                yield sse(exc.to_json())  # later errors: an event, and no [DONE]
            finally:
                if nxt is not None and not nxt.done():
                    nxt.cancel()
                    await asyncio.wait({nxt})  # the generator must stop before aclose()
                watcher.cancel()
                for h in handles:
                    h.cancel()
                await stream.aclose()

        return StreamingResponse(events(),
                                 headers={"Content-Type": "text/event-stream",
                                          "X-Accel-Buffering": "no",
                                          "Cache-Control": "no-cache"})

    @app.post("/completion")
    @app.post("/completions")
    async def completion(request: Request):
        return await generate(request, "native")

    @app.post("/infill")
    async def infill(request: Request):
        s = scheduler()
        check_infill_support(settings.tokenizer)  # before the body, as llama-server
        body = await _body(request)
        prefix, suffix, extra, prompt = infill_fields(body)
        n_predict = body.get("n_predict", settings.defaults.n_predict)
        if isinstance(n_predict, bool) or not isinstance(n_predict, int):
            n_predict = settings.defaults.n_predict  # the completion parser reports a bad one
        ids = infill_tokens(settings.tokenizer, prefix, suffix, extra, prompt, settings.n_batch,
                            s.n_ctx_slot, n_predict, settings.spm_infill)
        return await generate(request, "native", dict(body, prompt=ids))

    @app.post("/v1/completions")
    async def oai_completions(request: Request):
        return await generate(request, "oai_cmpl")

    @app.post("/chat/completions")
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    return app


_START_TIME = time.time()
