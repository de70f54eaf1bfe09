"""A real `pyspec-server` process on 127.0.0.1 for tests: started with llama-server's flags,
polled on /health until ready, stopped (and its log shown on failure) at the end."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import requests

from conftest import subprocess_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: List[str], env: Optional[dict] = None, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyspec.server.main", "--host", "127.0.0.1", "--port",
             str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=dict(subprocess_env(), **(env or {})),
            cwd=tempfile.gettempdir())
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pyspec-server exited with {self.proc.returncode}:\n"
                                   + self.output())
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("pyspec-server did not become ready:\n" + self.output())
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def get(self, path, **kw):
        return requests.get(self.url + path, timeout=kw.pop("timeout", 120), **kw)

    def post(self, path, json=None, **kw):
        return requests.post(self.url + path, json=json, timeout=kw.pop("timeout", 120), **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
