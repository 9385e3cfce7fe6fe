"""A ``tandem serve`` subprocess on a free local port, for tests and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """Start ``tandem serve`` with ``args`` on 127.0.0.1 and wait until ``/health`` answers.

    Use as a context manager; ``url`` is ``http://127.0.0.1:PORT`` and ``log()`` returns
    the server's output so far. ``new_session``: in a process group of its own (signals
    sent to its group reach no one else).

    Raises:
        RuntimeError: the server exited or did not become healthy within ``timeout`` s.
    """

    def __init__(self, args: list[str], timeout: float = 240.0, env: dict[str, str] | None = None,
                 new_session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="tandem-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tandem.entrypoints.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=new_session)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                log = self.log()
                self.stop()
                raise RuntimeError(f"tandem serve did not become healthy in {timeout} s:\n{log}")
            time.sleep(0.5)

    def log(self) -> str:
        with open(self._log.name) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def __enter__(self) -> "RemoteServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
