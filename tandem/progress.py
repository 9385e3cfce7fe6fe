"""Progress of the long steps of a start: GGUF conversion, weight loading, CUDA graph capture.

On a terminal (stderr is a TTY) a tqdm bar on stderr; elsewhere (a server's log file, a
pipe) an INFO line every :data:`LOG_INTERVAL_S` while the step runs. Either way one INFO
line with the time taken when it ends, as vLLM's "Loading weights took 0.52 seconds". A
thread refreshes the bar every second and writes the periodic lines, so that a stage that
blocks without counting anything (transformers parsing a GGUF file's metadata) still shows
its time passing.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

LOG_INTERVAL_S = 5.0
_BAR_REFRESH_S = 1.0

T = TypeVar("T")


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal (where a progress bar redraws in place)."""
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


class Progress:
    """One step's progress (see the module docstring); a context manager that writes the
    closing line when its block ends without an exception.

    Args:
        desc: what runs, e.g. "Loading model weights" (the bar's label, the lines' start).
        logger: where the lines go (the calling module's logger).
        total: units expected; None: unknown yet (:meth:`set_total`).
        unit: what is counted, e.g. "tensors".
        show: False: the closing line only (the ranks after the first of a deployment, so
            that one bar is drawn).
        interval_s: seconds between two periodic lines (default :data:`LOG_INTERVAL_S`).
    """

    def __init__(self, desc: str, logger: logging.Logger, total: int | None = None, unit: str = "it",
                 show: bool = True, interval_s: float | None = None) -> None:
        self.desc = desc
        self.logger = logger
        self.total = total
        self.unit = unit
        self.n = 0
        self.stage_name = ""
        self.start = time.perf_counter()
        self._bar = (tqdm(total=total, desc=desc, unit=f" {unit}", file=sys.stderr, dynamic_ncols=True)
                     if show and stderr_is_terminal() else None)
        self._stop = threading.Event()
        self._ticker = None
        if show:
            period = _BAR_REFRESH_S if self._bar is not None else interval_s or LOG_INTERVAL_S
            self._ticker = threading.Thread(target=self._tick, args=(period,), name="tandem-progress", daemon=True)
            self._ticker.start()

    def _tick(self, period: float) -> None:
        while not self._stop.wait(period):
            if self._bar is not None:
                self._bar.refresh()
            else:
                self.logger.info("%s", self.status())

    def status(self) -> str:
        """The periodic line: ``desc: n/total unit (p%), stage, N s``."""
        parts = []
        if self.total:
            parts.append(f"{self.n}/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%)")
        elif self.n:
            parts.append(f"{self.n} {self.unit}")
        if self.stage_name:
            parts.append(self.stage_name)
        parts.append(f"{time.perf_counter() - self.start:.0f} s")
        return f"{self.desc}: {', '.join(parts)}"

    def stage(self, name: str) -> None:
        """Name what runs now (shown after the count), e.g. "reading the tokenizer"."""
        self.stage_name = name
        if self._bar is not None:
            self._bar.set_postfix_str(name)

    def set_total(self, total: int) -> None:
        """Say how many units the step counts (once known)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def track(self, items: Iterable[T], total: int | None = None) -> Iterator[T]:
        """Yield ``items``, counting each (``total``: how many there are, if known)."""
        if total is not None:
            self.set_total(total)
        for item in items:
            yield item
            self.update()

    def close(self, log: bool = True) -> None:
        """Stop the bar and the periodic lines; with ``log``, write the closing line
        (``desc took X s (n unit)``)."""
        elapsed = time.perf_counter() - self.start
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if log:
            self.logger.info("%s took %.2f s%s", self.desc, elapsed, f" ({self.n} {self.unit})" if self.n else "")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(log=exc_type is None)


__all__ = ["LOG_INTERVAL_S", "Progress", "stderr_is_terminal"]
