"""The engine thread: N slots over one `_core.SpecEngine` (csrc/spec/spec_engine.h).

Each slot is a target sequence of the engine and, when a drafter is loaded, a drafter slot of its
own, so a request never waits for drafter state. Requests wait in a FIFO queue while every slot
(or the slot they pinned with `id_slot`) is busy; a new request joins the running batch at the
next step (continuous batching), and its prompt is decoded in chunks of the batch size
interleaved with the other slots' rounds of generation, all in one target decode per step.

Prompt cache (llama-server's cache_prompt, default on): a slot keeps its KV rows when its request
ends, and the next request in that slot decodes only what follows the longest common prefix of
its prompt and the slot's cached tokens (the engine's keep_cache / reuse_cache; the last prompt
token is always decoded). A request without id_slot goes, as in llama-server, to the idle slot
whose cached tokens cover the largest fraction of its prompt when that fraction exceeds the slot
prompt similarity (-sps, 0.1), else to the least recently used idle slot. cache_prompt false:
nothing is reused and the slot keeps nothing.

Threads: the HTTP layer calls `submit` from its event loop and iterates the returned handle
asynchronously; only this thread touches the engine, and `SpecEngine.step` releases the GIL, so
the event loop keeps serving while a step runs. Results cross back with
`loop.call_soon_threadsafe`. A cancelled handle (a client that went away) is dropped from the
engine before the next step, which frees its target sequence and drafter slot.

Text: tokens become text through the tokenizer's streaming decoder (UTF-8 safe), then through the
stop-string matcher, which holds back what may be the start of a stop string; a match ends the
request (stop_type "word") and the text stops before it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Deque, Dict, List, Optional

from .. import _core
from ..stops import StopMatcher
from .types import (Chunk, Final, GenerationRequest, ServerError, TokenProb,
                    context_exceeded)

log = logging.getLogger("pyspec.server")


@dataclass
class SchedulerConfig:
    n_slots: int = 1
    n_ctx_slot: int = 4096          # cells each slot may use
    n_batch: int = 512              # target rows per graph, and prompt rows per slot per step
    n_threads: int = 1
    kv_type: str = "f16"
    draft_n_max: int = -1           # < 0: the drafter's block
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    verify: Optional[str] = None    # rejection (None) or block at T > 0; T = 0 is greedy matching
    slot_prompt_similarity: float = 0.1  # llama-server's -sps: reuse a slot above this overlap
    backend: str = "cpu"            # target and drafter contexts: "cpu" or "cuda" (-ngl / -ngld)
    ngram_n: int = 0                # > 0: ngram-simple ahead of the drafter (--spec-ngram-size-n)
    ngram_m: int = 48               # its most drafts a round (--spec-ngram-size-m)


class RequestHandle:
    """One submitted request: async-iterate for Chunk..., Final (only Final when the request does
    not stream); cancel() from any thread."""

    def __init__(self, task_id: int, req: GenerationRequest, loop: asyncio.AbstractEventLoop,
                 wake: Callable[[], None], stream: bool = True):
        self.id = task_id
        self.id_slot = -1
        self.request = req
        # Whether the reader wants a Chunk per step. Each one wakes the event loop, whose Python
        # then competes with the engine's compute threads for the cores: SmolLM2 on 2 CPU threads
        # (bench/bench_server_decode.py, old and new alternating) took 1.05-1.19x the engine's own
        # time a token for a whole (non-streamed) reply with a Chunk a step, 1.01-1.04x without.
        self.stream = stream
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._wake = wake
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self._wake()

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled = True

    async def __aiter__(self):
        while True:
            item = await self._queue.get()
            if isinstance(item, ServerError):
                raise item
            yield item
            if isinstance(item, Final):
                return


class _Slot:
    """What /slots shows about a slot, and the request it runs."""

    def __init__(self, sid: int):
        self.id = sid
        self.task: Optional["_Task"] = None
        self.last: Optional["_Task"] = None  # the latest task, for /slots after it ends
        self.t_last_used = -1                # when its latest task ended (LRU choice)


class _Task:
    """A request while it runs in a slot."""

    def __init__(self, handle: RequestHandle, slot: _Slot, tokenizer, seed: int):
        self.handle = handle
        self.req = handle.request
        self.slot = slot
        self.seed = seed
        self.decoder = tokenizer.stream_decoder(skip_special=True, continuation=True)
        self.matcher = StopMatcher(list(self.req.stop))
        self.tokens: List[int] = []
        self.text: List[str] = []
        self.probs: List[TokenProb] = []
        self.n_prompt_done = 0
        self.n_cached = 0     # prompt tokens reused from the slot's cache
        self.t_start = time.perf_counter()
        self.t_prompt = None  # when the prompt was done (the first token came)
        self.t_last = self.t_start
        self.stats: dict = {}
        self.done = False


class Scheduler:
    def __init__(self, model: _core.Model, tokenizer, drafter: Optional[_core.DraftModel],
                 config: SchedulerConfig,
                 settings_json: Optional[Callable[[GenerationRequest], dict]] = None):
        self.config = config
        self.n_slots = int(config.n_slots)
        self.n_ctx_slot = int(config.n_ctx_slot)
        self.has_drafter = drafter is not None
        self.speculative = self.has_drafter or int(config.ngram_n) > 0
        self.tokenizer = tokenizer
        self._settings_json = settings_json or _default_settings_json
        self.engine = _core.SpecEngine(
            model, drafter, n_ctx=self.n_slots * self.n_ctx_slot, n_seq_max=self.n_slots,
            n_draft_slots=self.n_slots, n_batch=int(config.n_batch),
            draft_n_batch=max(int(config.n_batch), 64), n_threads=int(config.n_threads),
            draft_n_max=int(config.draft_n_max), prefill_chunk=int(config.n_batch),
            kv_dtype=config.kv_type, backend=config.backend, ngram_n=int(config.ngram_n),
            ngram_m=int(config.ngram_m))
        self.draft_n_max = int(self.engine.draft_n_max)
        self._eog = sorted(int(t) for t in tokenizer.eog_ids)
        self._slots = [_Slot(i) for i in range(self.n_slots)]
        self._queue: Deque[RequestHandle] = collections.deque()
        self._tasks: Dict[int, _Task] = {}
        self._ids = itertools.count(1)
        self._uses = itertools.count(0)  # release order of the slots (LRU)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._running = False
        self._thread: Optional[threading.Thread] = None
        self._m = collections.Counter()
        self._accepted_per_pos: Dict[int, int] = collections.Counter()
        self._busy_sum = 0
        self._registry_size = 0  # drafter states held, read by the engine thread after each step
        # The engine's lifetime counters at the end of warmup(), which the metrics leave out.
        self._ahead_base = (0, 0)

    # -- lifecycle -------------------------------------------------------------------------

    def warmup(self, prompt_ids: List[int], max_tokens: int = 3) -> float:
        """llama-server's warmup run: one throwaway greedy request straight through the engine
        before the scheduler thread starts, so the work that happens once (the CPU's packed
        weights, the GPU's weight upload, plans and CUDA graphs; the drafter's too) is not paid by
        the first client. The caches are cleared afterwards and the metrics leave it out; nothing
        of it reaches a client. Returns the seconds it took."""
        if self._thread is not None:
            raise RuntimeError("warmup() runs before start()")
        t0 = time.perf_counter()
        self.engine.add_request(0, list(prompt_ids), max_tokens=max_tokens, temperature=0.0,
                                verify="greedy", seq=0, draft=self.speculative)
        for _ in range(64 + len(prompt_ids)):  # a few prompt chunks and rounds; never a hang
            if not self.engine.n_requests:
                break
            self.engine.step()
        if self.engine.has_request(0):
            self.engine.cancel(0)
        self.engine.clear_cache()
        self._ahead_base = (int(self.engine.n_decoded_ahead), int(self.engine.n_ahead_overruled))
        return time.perf_counter() - t0

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="pyspec-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify_all()
        if self._thread:
            self._thread.join()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # -- the HTTP side ---------------------------------------------------------------------

    def submit(self, req: GenerationRequest, stream: bool = True) -> RequestHandle:
        """Queues req; stream=False: its handle yields only the Final (RequestHandle.stream)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ServerError("the prompt is empty: give some text or token ids")
        if n >= self.n_ctx_slot:
            raise context_exceeded(n, self.n_ctx_slot)
        if not -1 <= req.id_slot < self.n_slots:
            raise ServerError(f"Invalid id_slot: {req.id_slot} (the server has {self.n_slots} "
                              "slots)")
        vocab = self.tokenizer.n_vocab
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise ServerError(f"a prompt token id is outside the vocabulary (0..{vocab - 1})")
        handle = RequestHandle(next(self._ids), req, asyncio.get_running_loop(), self._wake, stream)
        with self._cv:
            self._queue.append(handle)
            self._cv.notify_all()
        return handle

    def slots(self) -> List[dict]:
        with self._lock:
            return [self._slot_json(s) for s in self._slots]

    def idle_slots(self) -> int:
        with self._lock:
            return sum(1 for s in self._slots if s.task is None)

    def metrics(self) -> dict:
        with self._lock:
            m = dict(self._m)
            busy = sum(1 for s in self._slots if s.task is not None)
            registry = self._registry_size
            deferred = len(self._queue)
            per_pos = dict(self._accepted_per_pos)
        n_dec = m.get("n_decode_total", 0)
        return {
            "prompt_tokens_total": m.get("prompt_tokens_total", 0),
            "prompt_tokens_cached_total": m.get("prompt_tokens_cached_total", 0),
            "prompt_seconds_total": m.get("prompt_seconds_total", 0.0),
            "tokens_predicted_total": m.get("tokens_predicted_total", 0),
            "tokens_predicted_seconds_total": m.get("tokens_predicted_seconds_total", 0.0),
            "n_decode_total": n_dec,
            "n_tokens_max": m.get("n_tokens_max", 0),
            "spec_decode_num_draft_tokens_total": m.get("draft_tokens", 0),
            "spec_decode_num_accepted_tokens_total": m.get("accepted_tokens", 0),
            "spec_decode_num_drafts_total": m.get("drafts", 0),
            "spec_decode_num_accepted_tokens_per_pos": per_pos,
            "requests_processing": busy,
            "requests_deferred": deferred,
            "n_busy_slots_per_decode": self._busy_sum / n_dec if n_dec else 0.0,
            # pyspec's own: requests holding drafter state (0 once every request has ended).
            "draft_registry_size": registry,
            # pyspec's own: steps queued before the host read the step before them, and rows of
            # those whose token the host's draw overruled (dropped and decoded again).
            "decoded_ahead_steps_total": m.get("decoded_ahead_steps_total", 0),
            "decoded_ahead_overruled_total": m.get("decoded_ahead_overruled_total", 0),
        }

    @property
    def registry_size(self) -> int:
        """Requests holding drafter state (0 without a drafter); read between steps."""
        return int(self.engine.registry_size) if self.has_drafter else 0

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._running and not self._queue and not self._tasks:
                    self._cv.wait()
                if not self._running:
                    break
                self._drop_cancelled()
                self._admit()
                if not self._tasks:
                    continue
            try:
                outs = self.engine.step()
            except Exception as exc:  # a broken step must not take the server down silently
                log.exception("engine step failed")
                with self._lock:
                    for task in list(self._tasks.values()):
                        self._fail(task, ServerError(f"engine step failed: {exc}", "server_error",
                                                     500))
                    # Whatever the broken step left in the caches is not trusted for reuse.
                    self.engine.clear_cache()
                continue
            with self._lock:
                self._m["n_decode_total"] += 1
                self._busy_sum += len(self._tasks)
                for o in outs:
                    task = self._tasks.get(int(o["request_id"]))
                    if task is not None:
                        self._on_output(task, o)
                self._registry_size = self.registry_size
                self._m["decoded_ahead_steps_total"] = (int(self.engine.n_decoded_ahead) -
                                                        self._ahead_base[0])
                self._m["decoded_ahead_overruled_total"] = (int(self.engine.n_ahead_overruled) -
                                                            self._ahead_base[1])
        # Shutdown: whoever still waits gets an error, not a hang.
        with self._lock:
            for task in list(self._tasks.values()):
                self._fail(task, ServerError("the server is shutting down", "unavailable_error",
                                             503))
            while self._queue:
                self._queue.popleft()._put(ServerError("the server is shutting down",
                                                       "unavailable_error", 503))

    def _drop_cancelled(self) -> None:
        for tid, task in list(self._tasks.items()):
            if task.handle.cancelled:
                self.engine.cancel(tid)
                self._release(task)
                log.info("slot %d: task %d cancelled (client gone), slot released",
                         task.slot.id, tid)
        self._registry_size = self.registry_size
        if any(h.cancelled for h in self._queue):
            self._queue = collections.deque(h for h in self._queue if not h.cancelled)

    def _admit(self) -> None:
        """Moves queued requests into idle slots, first come first served; a request pinned to a
        busy slot waits without holding up the others."""
        waiting: Deque[RequestHandle] = collections.deque()
        while self._queue:
            h = self._queue.popleft()
            slot = self._free_slot(h.request.id_slot, h.request.prompt_ids)
            if slot is None:
                waiting.append(h)
                continue
            try:
                self._start(h, slot)
            except ServerError as err:
                h._put(err)
            except ValueError as err:
                h._put(ServerError(str(err)))
        self._queue = waiting

    def _free_slot(self, want: int, prompt: List[int]) -> Optional[_Slot]:
        """The pinned slot when idle; else llama-server's choice (get_available_slot): the idle
        slot whose cached tokens share the largest fraction of the prompt, when that fraction
        exceeds slot_prompt_similarity, else the least recently used idle slot (ties: the
        smallest id)."""
        if want >= 0:
            s = self._slots[want]
            return s if s.task is None else None
        idle = [s for s in self._slots if s.task is None]
        if not idle:
            return None
        sps = float(self.config.slot_prompt_similarity)
        if sps > 0.0 and prompt:
            best, best_sim = None, 0.0
            for s in idle:
                sim = self.engine.cached_prefix(s.id, prompt) / len(prompt)
                if sim > best_sim and sim > sps:
                    best, best_sim = s, sim
            if best is not None:
                return best
        return min(idle, key=lambda s: (s.t_last_used, s.id))

    def _start(self, h: RequestHandle, slot: _Slot) -> None:
        req = h.request
        seed = req.seed if req.seed >= 0 else random.getrandbits(32)
        bias = dict(req.logit_bias)
        if req.ignore_eos:
            # As llama.cpp: end-of-generation tokens get a -inf bias and nothing stops on them.
            bias.update({t: float("-inf") for t in self._eog})
        max_tokens = req.n_predict if req.n_predict >= 0 else -1
        task = _Task(h, slot, self.tokenizer, seed)
        if max_tokens == 0:
            slot.last = task
            self._finish(task, "limit", truncated=False)
            return
        temperature = max(0.0, float(req.temperature))
        verify = "greedy" if temperature == 0.0 else (self.config.verify
                                                      if self.config.verify in ("rejection", "block")
                                                      else "rejection")
        self.engine.add_request(
            h.id, list(req.prompt_ids), max_tokens=max_tokens, temperature=temperature,
            top_k=max(0, int(req.top_k)), top_p=min(1.0, max(0.0, float(req.top_p))),
            min_p=min(1.0, max(0.0, float(req.min_p))), seed=seed, verify=verify,
            stop_ids=[] if req.ignore_eos else self._eog,
            draft_p_min=float(self.config.draft_p_min), draft_n_min=int(self.config.draft_n_min),
            logit_bias=sorted(bias.items()),
            repeat_last_n=int(req.repeat_last_n) if req.repeat_last_n >= 0 else self.n_ctx_slot,
            repeat_penalty=float(req.repeat_penalty),
            presence_penalty=float(req.presence_penalty),
            frequency_penalty=float(req.frequency_penalty),
            n_probs=max(0, int(req.n_probs)), seq=slot.id,
            draft=bool(req.speculative) and self.speculative,
            keep_cache=bool(req.cache_prompt), reuse_cache=bool(req.cache_prompt))
        task.n_cached = int(self.engine.stats(h.id)["n_cached"])
        h.id_slot = slot.id
        slot.task = slot.last = task
        self._tasks[h.id] = task

    def _on_output(self, task: _Task, o: dict) -> None:
        now = time.perf_counter()
        task.n_prompt_done += int(o["n_prompt_processed"])
        task.stats = o["stats"]
        toks = [int(t) for t in o["tokens"]]
        if toks or o["finished"]:
            if task.t_prompt is None:
                task.t_prompt = now
                # The prompt's last pass gave the first token: every uncached row is done.
                task.n_prompt_done = len(task.req.prompt_ids) - task.n_cached
            task.t_last = now
        if task.handle.cancelled:
            return
        probs = [TokenProb(int(i), float(lp), [(int(a), float(b)) for a, b in top])
                 for i, lp, top in o.get("probs", [])]
        text, used, hit = [], [], False
        for k, t in enumerate(toks):
            used.append(t)
            task.tokens.append(t)
            if probs:
                task.probs.append(probs[k])
            piece, hit = task.matcher.feed(task.decoder.push(t))
            text.append(piece)
            if hit:  # the tokens after the stop string are dropped with its text
                break
        if o["finished"] and not hit:
            piece, hit = task.matcher.feed(task.decoder.flush())
            text.append(piece if hit else piece + task.matcher.finish())
        new = "".join(text)
        if new or used:
            task.text.append(new)
            if task.handle.stream:
                task.handle._put(Chunk(new, used, probs[:len(used)] if probs else []))
        if hit:
            if not o["finished"]:
                self.engine.cancel(task.handle.id)
            self._finish(task, "word")
        elif o["finished"]:
            reason = o["stop_reason"]
            if reason == "stop":
                self._finish(task, "eos")
            else:
                self._finish(task, "limit", truncated=(reason == "context"))

    def _finish(self, task: _Task, stop_type: str, truncated: bool = False) -> None:
        st = task.stats
        t_prompt = task.t_prompt if task.t_prompt is not None else task.t_last
        prompt_ms = max(0.0, (t_prompt - task.t_start) * 1e3)
        predicted_ms = max(1e-3, (task.t_last - t_prompt) * 1e3)
        n_prompt = len(task.req.prompt_ids)
        final = Final(
            content="".join(task.text), tokens=list(task.tokens), stop_type=stop_type,
            stopping_word=task.matcher.matched if stop_type == "word" else "",
            truncated=truncated, id_slot=task.slot.id, n_prompt=n_prompt, n_cached=task.n_cached,
            n_predicted=len(task.tokens), prompt_ms=prompt_ms, predicted_ms=predicted_ms,
            draft_n=int(st.get("draft_n", 0)), draft_n_accepted=int(st.get("draft_n_accepted", 0)),
            seed=task.seed, probs=list(task.probs))
        task.final = final
        m = self._m
        # As llama-server: prompt_tokens_total counts the decoded prompt tokens (prompt_n),
        # prompt_tokens_cached_total the reused ones (cache_n).
        m["prompt_tokens_total"] += n_prompt - final.n_cached
        m["prompt_tokens_cached_total"] += final.n_cached
        m["prompt_seconds_total"] += prompt_ms / 1e3
        m["tokens_predicted_total"] += final.n_predicted
        m["tokens_predicted_seconds_total"] += predicted_ms / 1e3
        m["n_tokens_max"] = max(m["n_tokens_max"], n_prompt + final.n_predicted)
        if final.draft_n:
            m["draft_tokens"] += final.draft_n
            m["accepted_tokens"] += final.draft_n_accepted
            m["drafts"] += int(st.get("n_rounds", 0))
            for pos, n in enumerate(st.get("accepted_at", [])):
                self._accepted_per_pos[pos] += int(n)
        t = final.timings()
        line = (f"slot {task.slot.id} | task {task.handle.id} | prompt {t['prompt_n']} tokens, "
                f"{t['prompt_per_second']:.1f} tokens/s | decode {t['predicted_n']} tokens, "
                f"{t['predicted_per_second']:.1f} tokens/s | stop {stop_type}")
        if final.draft_n:
            line += (f" | draft acceptance {final.draft_n_accepted / final.draft_n:.3f} "
                     f"({final.draft_n_accepted}/{final.draft_n})")
        if st.get("ngram_rounds"):   # ngram-simple's share, as llama-server's per-type statistics
            line += (f" | ngram-simple: {st['ngram_rounds']} drafts, "
                     f"{st['ngram_draft_n_accepted']}/{st['ngram_draft_n']} tokens accepted")
        if st.get("draft_stopped"):
            line += " | drafting stopped: " + str(st.get("draft_stop_reason", ""))
        log.info(line)
        task.handle._put(final)
        self._release(task)

    def _fail(self, task: _Task, err: ServerError) -> None:
        if self.engine.has_request(task.handle.id):
            self.engine.cancel(task.handle.id)
        task.handle._put(err)
        self._release(task)

    def _release(self, task: _Task) -> None:
        task.done = True
        task.slot.t_last_used = next(self._uses)
        self._tasks.pop(task.handle.id, None)
        if task.slot.task is task:
            task.slot.task = None

    # -- /slots ----------------------------------------------------------------------------

    def _slot_json(self, s: _Slot) -> dict:
        out = {"id": s.id, "n_ctx": self.n_ctx_slot, "speculative": self.speculative,
               "is_processing": s.task is not None}
        task = s.task or s.last
        if task is None:
            return out
        st = task.stats
        n_remain = (task.req.n_predict - len(task.tokens)) if task.req.n_predict >= 0 else -1
        draft_n, acc = int(st.get("draft_n", 0)), int(st.get("draft_n_accepted", 0))
        out.update({
            "id_task": task.handle.id,
            "n_prompt_tokens": len(task.req.prompt_ids),
            "n_prompt_tokens_processed": task.n_prompt_done,
            "n_prompt_tokens_cache": task.n_cached,
            "params": self._settings_json(task.req),
            "next_token": [{"has_next_token": s.task is not None,
                            "has_new_line": "\n" in "".join(task.text),
                            "n_remain": n_remain, "n_decoded": len(task.tokens)}],
            # pyspec's addition: the slot's drafting so far (its latest request).
            "speculative_stats": {
                "draft_n": draft_n, "draft_n_accepted": acc,
                "acceptance_rate": acc / draft_n if draft_n else 0.0,
                "mean_accepted_length": float(st.get("mean_accepted_length", 0.0)),
                "accepted_per_position": list(st.get("accepted_at", [])),
                "drafted_per_position": list(st.get("drafted_at", [])),
                "drafting_stopped": bool(st.get("draft_stopped", False)),
                # the part of the above that ngram-simple drafted (--spec-type ngram-simple)
                "ngram_rounds": int(st.get("ngram_rounds", 0)),
                "ngram_draft_n": int(st.get("ngram_draft_n", 0)),
                "ngram_draft_n_accepted": int(st.get("ngram_draft_n_accepted", 0)),
            },
        })
        return out


def _default_settings_json(req: GenerationRequest) -> dict:
    d = asdict(req)
    d.pop("prompt_ids")
    d["logit_bias"] = [[k, v] for k, v in req.logit_bias.items()]
    return d
