"""Hosts of a multi-host deployment as separate process trees on this machine (tests): a
``tandem serve`` launcher in a session of its own and every descendant it had, watched with
psutil for orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil


class Host:
    """One host: a ``tandem serve`` process in a session of its own, and its descendants."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tandem-host-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", "serve", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "TANDEM_STARTUP_TIMEOUT_S": "300", **(env or {})})
        self.pids: set[int] = {self.proc.pid}

    def text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def record(self) -> None:
        """Remember every process of the tree now (they are checked for orphans later)."""
        try:
            self.pids |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def alive(self) -> list[int]:
        out = []
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def kill9(self) -> None:
        self.record()
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_gone(self, timeout: float) -> float:
        """Seconds until the launcher exited and no process of the tree is left (or raises)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            self.proc.poll()
            if self.proc.returncode is not None and not self.alive():
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"processes {self.alive()} still alive after {timeout} s:\n{self.text()[-3000:]}")

    def stop(self, timeout: float) -> list[int]:
        """SIGTERM the launcher; returns the processes of the tree still alive after
        ``timeout`` s (killed)."""
        self.record()
        if self.proc.poll() is None:
            self.proc.terminate()
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.2)
        left = self.alive()
        self.kill9()
        return left

    def close(self) -> None:
        self.kill9()
        self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def wait_healthy(url: str, trees: list[Host], timeout: float = 300.0) -> None:
    """Until ``url``'s /health answers 200 (every host's processes then recorded); raises
    when a host exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t in trees:
            if t.proc.poll() is not None:
                raise AssertionError(f"a host exited with {t.proc.returncode}:\n{t.text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                for t in trees:
                    t.record()
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the two-host server did not become healthy:\n" + "\n".join(t.text()[-3000:] for t in trees))
