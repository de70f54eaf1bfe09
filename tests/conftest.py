"""Shared test helpers."""

import os
from pathlib import Path

import pyspec

# The directory holding the pyspec package these tests imported: the source tree after an
# in-place developer build, site-packages after `pip install .`. Subprocesses must import the
# same one, so they get it on PYTHONPATH and run from a neutral working directory (`python -m`
# puts the working directory first on sys.path, and a source checkout without an in-place build
# has no compiled core).
PYSPEC_PARENT = Path(pyspec.__file__).resolve().parents[1]


def subprocess_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(PYSPEC_PARENT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


class RequestRun:
    """What one request emitted over a SpecEngine run: its tokens in order, the draft block each
    of its rounds verified, the stats of its last output (its finished one) and its stop reason
    (None until it finished)."""

    def __init__(self):
        self.tokens, self.blocks, self.stats, self.stop_reason = [], [], None, None

    def add(self, o: dict) -> None:
        self.tokens += o["tokens"]
        if o["verified"]:
            self.blocks.append(list(o["verified"]))
        self.stats = o["stats"]
        if o["finished"]:
            self.stop_reason = o["stop_reason"]


def drain(engine, between=None):
    """Steps a SpecEngine until no request is left, yielding each output in order; between(outs),
    when given, runs after each step with that step's outputs (to pause, cancel or add requests)."""
    while engine.n_requests:
        outs = engine.step()
        yield from outs
        if between is not None:
            between(outs)


def run_requests(engine, between=None) -> dict:
    """Steps a SpecEngine until no request is left: {request id: RequestRun} of every request that
    emitted an output."""
    runs = {}
    for o in drain(engine, between):
        runs.setdefault(o["request_id"], RequestRun()).add(o)
    return runs
