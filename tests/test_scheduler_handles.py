"""The server's scheduler (pyspec/server/scheduler.py) over a tiny target: what a request's handle
yields. A streamed request gets a Chunk per step and then the Final; one that does not stream
gets only the Final, with the same text and tokens (a Chunk a step woke the event loop, whose
Python then competed with the engine's compute threads)."""
from __future__ import annotations

import asyncio

import pytest

from pyspec import _core
from pyspec.server.scheduler import Scheduler, SchedulerConfig
from pyspec.server.types import Chunk, Final, GenerationRequest
from pyspec.tokenizer import Tokenizer
from test_speculative import Pairs  # noqa: E402  (tests/ is on sys.path under pytest)


def test_only_streamed_requests_get_chunks(tmp_path):
    target, _, _, _, _ = Pairs(tmp_path).known_acceptance(0.7, True, seed=3)
    sched = Scheduler(_core.Model(str(target)), Tokenizer.from_gguf(str(target)), None,
                      SchedulerConfig(n_slots=1, n_ctx_slot=256, n_threads=1))
    sched.start()

    async def run(stream):
        req = GenerationRequest(prompt_ids=[7, 9, 11], n_predict=12, temperature=0.0,
                                ignore_eos=True, cache_prompt=False)
        return [item async for item in sched.submit(req, stream=stream)]

    async def both():
        return await run(True), await run(False)

    try:
        streamed, whole = asyncio.run(both())
    finally:
        sched.stop()
    chunks = [it for it in streamed if isinstance(it, Chunk)]
    assert len(chunks) >= 2 and isinstance(streamed[-1], Final)
    assert sum(len(c.tokens) for c in chunks) == 12
    assert len(whole) == 1 and isinstance(whole[0], Final)
    assert whole[0].tokens == streamed[-1].tokens and len(whole[0].tokens) == 12
    assert whole[0].content == streamed[-1].content == "".join(c.text for c in chunks)


def test_warmup_leaves_no_trace(tmp_path):
    """llama-server's warmup run (Scheduler.warmup, before start): afterwards no request is held,
    every slot's cache is empty, the metrics count nothing of it, and a request then gets the
    tokens it gets from a scheduler that never warmed up (the drafter speculating in both)."""
    target, drafter, _, _, _ = Pairs(tmp_path).known_acceptance(0.7, True, seed=5)
    req = dict(prompt_ids=[7, 9, 11, 13], n_predict=16, temperature=0.0, ignore_eos=True)

    def serve(warm):
        model = _core.Model(str(target))
        sched = Scheduler(model, Tokenizer.from_gguf(str(target)), _core.DraftModel(str(drafter), model),
                          SchedulerConfig(n_slots=2, n_ctx_slot=256, n_threads=1, draft_n_max=3))
        if warm:
            assert sched.warmup([5, 6, 7, 8, 9]) > 0.0
            assert sched.engine.n_requests == 0
            assert all(sched.engine.cached_tokens(s) == [] for s in range(2))
            assert sched.metrics()["n_decode_total"] == 0
        sched.start()

        async def run():
            return [item async for item in sched.submit(GenerationRequest(**req), stream=False)]

        try:
            final = asyncio.run(run())[-1]
            return final.tokens, sched.metrics()
        finally:
            sched.stop()

    cold_tokens, cold_metrics = serve(False)
    warm_tokens, warm_metrics = serve(True)
    assert warm_tokens == cold_tokens and len(warm_tokens) == 16
    assert warm_metrics["spec_decode_num_drafts_total"] > 0
    for key in ("prompt_tokens_total", "tokens_predicted_total", "n_decode_total",
                "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                "decoded_ahead_steps_total"):
        assert warm_metrics[key] == cold_metrics[key], key


def test_warmup_runs_only_before_start(tmp_path):
    target, _, _, _, _ = Pairs(tmp_path).known_acceptance(0.7, True, seed=3)
    sched = Scheduler(_core.Model(str(target)), Tokenizer.from_gguf(str(target)), None,
                      SchedulerConfig(n_slots=1, n_ctx_slot=256, n_threads=1))
    sched.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            sched.warmup([1, 2])
    finally:
        sched.stop()
