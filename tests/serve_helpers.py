"""Starting a real ``fullband serve`` process on a free port of 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fullband.data.tokenizers import ByteTokenizer, Tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_model(model, directory: Path, tokenizer: Tokenizer | None = None) -> Path:
    """A model directory as ``fullband serve`` loads it: weights, config and (by default a byte) tokenizer."""
    model.save_pretrained(directory)
    (tokenizer or ByteTokenizer()).save(directory / "tokenizer")
    return directory


class Server:
    def __init__(self, model_dir: Path, log: Path, *options: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")
        command = [sys.executable, "-m", "fullband", "serve", str(model_dir), "--port", str(self.port),
                   "--log-level", "warning", *options]
        # One thread: tiny models gain nothing from more, and the tests share the machine's cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"fullband serve exited with {self.process.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError(f"fullband serve did not answer within 120 s:\n{log.read_text()}")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


class ThreadServer:
    """A uvicorn server on a free port of 127.0.0.1, run on a thread of the test process: no start-up of a
    second Python, for tests that need a model built in place rather than the command line."""

    def __init__(self, model, tokenizer, name: str, max_batch: int = 16, max_queue: int = 256):
        import threading

        import uvicorn

        from fullband.engine import Engine
        from fullband.serve.app import create_app

        self.engine = Engine(model, max_batch=max_batch, max_queue=max_queue)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(self.engine, tokenizer, name)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
