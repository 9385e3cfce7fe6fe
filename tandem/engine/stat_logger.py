"""The server log's periodic stats line, as vLLM's ``LoggingStatLogger``.

Every :data:`LOG_STATS_INTERVAL_S` while there is work, one INFO line::

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.3 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 42.0%

computed from the measurements ``/metrics`` exports (:meth:`tandem.engine.async_llm.AsyncLLM.stats`):
the front end's prompt and generation token counters (prompt tokens count when a request is
accepted) give the interval's throughputs; the engine cores' latest scheduler stats give the
running and waiting sequences, the KV cache usage (mean over replicas) and the prefix cache
hit rate (hit / looked-up prompt tokens since start, the ``tandem:prefix_cache_hit_rate``
gauge). An interval with no tokens and no request running or waiting logs nothing, so an
idle server stays quiet, except the first such interval after a line that showed requests
running or waiting: the log then ends on the idle state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0


def format_stats_line(prompt_throughput: float, generation_throughput: float, num_running: int, num_waiting: int,
                      kv_cache_usage: float, prefix_cache_hit_rate: float, kv_cache_device: str = "GPU") -> str:
    """vLLM's stats line; ``kv_cache_usage`` and ``prefix_cache_hit_rate`` are fractions
    (0..1), ``kv_cache_device`` names where the cache is (``"GPU"``, ``"CPU"``)."""
    return (f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"Running: {num_running} reqs, Waiting: {num_waiting} reqs, "
            f"{kv_cache_device} KV cache usage: {100 * kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * prefix_cache_hit_rate:.1f}%")


class StatsLogger:
    """Logs the stats line of the interval since its previous call (see the module docstring).

    Args:
        stats: the current measurements, keyed as ``AsyncLLM.stats()``: ``prompt_tokens``
            and ``generation_tokens`` (counters), ``num_running``, ``num_waiting``,
            ``kv_cache_usage``, ``prefix_cache_queries``, ``prefix_cache_hits``.
        kv_cache_device: where the KV cache is, for the line (``"GPU"``, ``"CPU"``).
        prefix: put before the line (which of several API servers logs it).
        clock: seconds, monotonic.
    """

    def __init__(self, stats: Callable[[], Mapping[str, float]], kv_cache_device: str = "GPU", prefix: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stats = stats
        self.kv_cache_device = kv_cache_device
        self.prefix = prefix
        self.clock = clock
        self._last_time = clock()
        self._last = self._counters(stats())
        self._shown_busy = False  # the last line showed requests running or waiting

    @staticmethod
    def _counters(s: Mapping[str, float]) -> tuple[float, float]:
        return s.get("prompt_tokens", 0), s.get("generation_tokens", 0)

    def log(self) -> str | None:
        """Log the line of the interval since the previous call; returns it, or None (not
        logged) when the interval had no tokens, nothing runs or waits, and the previous
        line said so too."""
        now, s = self.clock(), self.stats()
        prompt, generation = self._counters(s)
        elapsed = now - self._last_time
        d_prompt, d_generation = prompt - self._last[0], generation - self._last[1]
        self._last_time, self._last = now, (prompt, generation)
        running, waiting = int(s.get("num_running", 0)), int(s.get("num_waiting", 0))
        if not (d_prompt or d_generation or running or waiting or self._shown_busy) or elapsed <= 0:
            return None
        self._shown_busy = bool(running or waiting)
        queries = s.get("prefix_cache_queries", 0)
        line = self.prefix + format_stats_line(
            d_prompt / elapsed, d_generation / elapsed, running, waiting, s.get("kv_cache_usage", 0.0),
            s.get("prefix_cache_hits", 0) / queries if queries else 0.0, self.kv_cache_device)
        logger.info("%s", line)
        return line


__all__ = ["LOG_STATS_INTERVAL_S", "StatsLogger", "format_stats_line"]
