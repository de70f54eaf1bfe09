"""The server's scheduler (pyspec/server/scheduler.py) over a tiny target: what a request's handle
yields. A streamed request gets a Chunk per step and then the Final; one that does not stream
gets only the Final, with the same text and tokens (a Chunk a step woke the event loop, whose
Python then competed with the engine's compute threads)."""
from __future__ import annotations

import asyncio

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
