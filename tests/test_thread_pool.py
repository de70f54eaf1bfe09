"""CPU backends share one thread pool per thread count (core/thread_pool.h, ThreadPool::shared).

A speculative engine's target and drafter take turns on it, so neither's workers spin on the
cores the other needs. Contexts used from different threads at the same time must still compute
correctly: the pool runs one task at a time, whoever asks.
"""

import hashlib
import os
import signal
import threading
import time

import numpy as np
import pytest

from default_model import require_default_model

require_default_model()

import pyspec  # noqa: E402

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 17, 2573, 28, 9, 42, 7, 600, 31]]


@pytest.fixture(scope="module")
def model():
    return pyspec.Model(n_threads=2)


def _logits(ctx, prompt):
    ctx.kv_clear()
    out = [ctx.decode(prompt).logits[-1].copy()]
    tok = int(np.argmax(out[0]))
    for i in range(6):
        out.append(ctx.decode([tok], positions=[len(prompt) + i]).logits[-1].copy())
        tok = int(np.argmax(out[-1]))
    return out


def test_contexts_on_the_shared_pool_compute_the_same_from_two_threads(model):
    """Two contexts (one shared pool of 2 workers) decoding at the same time from two Python
    threads (decode releases the GIL) give bit-for-bit what each gives alone."""
    ctxs = [pyspec.Context(model, n_ctx=128, n_seq_max=1, n_batch=32) for _ in PROMPTS]
    alone = [_logits(c, p) for c, p in zip(ctxs, PROMPTS)]
    for _ in range(3):
        got = [None, None]
        errors = []

        def work(i):
            try:
                got[i] = _logits(ctxs[i], PROMPTS[i])
            except Exception as exc:   # reported below, not lost in the thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a decode never finished"
        assert not errors, errors
        for a, b in zip(alone, got):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_pool(model):
    """A child forked after the parent started a pool (none of whose workers exist in the child)
    decodes with a fresh one, to the parent's bits, instead of waiting forever on the parent's."""
    ctx = pyspec.Context(model, n_ctx=128, n_seq_max=1, n_batch=32)
    want = _logits(ctx, PROMPTS[0])[-1]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report the last logits' checksum, then leave without pytest
        status = 1
        try:
            got = _logits(pyspec.Context(model, n_ctx=128, n_seq_max=1, n_batch=32), PROMPTS[0])[-1]
            os.write(write_fd, hashlib.sha256(got.tobytes()).digest())   # fits the pipe
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child never finished decoding")
    data = b""
    while chunk := os.read(read_fd, 1 << 20):
        data += chunk
    os.close(read_fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert data == hashlib.sha256(want.tobytes()).digest()
