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

An interval in which speculative decoding verified drafts adds vLLM's ``SpecDecodingLogging``
line, from the cores' speculative-decoding counters (the ``tandem:spec_decode_*`` families)::

    SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.20 tokens/s,
    Drafted throughput: 3.20 tokens/s, Accepted: 12 tokens, Drafted: 32 tokens,
    Per-position acceptance rate: 0.750, 0.500, 0.250, 0.000, Avg Draft acceptance rate: 37.5%
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True)
class SpecDecodingStats:
    """Speculative-decoding counters since the start or over an interval (vLLM's
    SpecDecodingStats): verifications (``num_drafts``: sequence-steps with draft tokens),
    draft and accepted tokens, and accepted tokens by draft position (position i counts when
    the first i + 1 drafts of a verification were accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @classmethod
    def from_stats(cls, s: Mapping) -> SpecDecodingStats:
        """From engine stats keyed as ``SchedulerStats``'s fields (``AsyncLLM.stats()``)."""
        return cls(s.get("spec_decode_num_drafts", 0), s.get("spec_decode_num_draft_tokens", 0),
                   s.get("spec_decode_num_accepted_tokens", 0),
                   tuple(s.get("spec_decode_num_accepted_tokens_per_pos", ())))

    def __sub__(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts since ``earlier`` (positions ``earlier`` lacks counted from 0)."""
        before = earlier.num_accepted_tokens_per_pos
        per_pos = tuple(n - (before[i] if i < len(before) else 0)
                        for i, n in enumerate(self.num_accepted_tokens_per_pos))
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / draft tokens (0..1); NaN without draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: 1 (the token sampled after the accepted drafts) + the
        accepted drafts per verification; NaN without verifications."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def per_position_acceptance_rates(self) -> list[float]:
        """Accepted tokens at each draft position / verifications (0..1, non-increasing)."""
        return [n / self.num_drafts if self.num_drafts else math.nan for n in self.num_accepted_tokens_per_pos]


def format_spec_decoding_line(stats: SpecDecodingStats, elapsed_s: float) -> str:
    """vLLM's ``SpecDecodingLogging`` line of the counts ``stats`` of an interval of
    ``elapsed_s`` seconds (> 0)."""
    rates = ", ".join(f"{r:.3f}" for r in stats.per_position_acceptance_rates)
    return (f"SpecDecoding metrics: Mean acceptance length: {stats.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {stats.num_accepted_tokens / elapsed_s:.2f} tokens/s, "
            f"Drafted throughput: {stats.num_draft_tokens / elapsed_s:.2f} tokens/s, "
            f"Accepted: {stats.num_accepted_tokens} tokens, Drafted: {stats.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100 * stats.acceptance_rate:.1f}%")


class StatsLogger:
    """Logs the stats line of the interval since its previous call (see the module docstring).

    Args:
        stats: the current measurements, keyed as ``AsyncLLM.stats()``: ``prompt_tokens``
            and ``generation_tokens`` (counters), ``num_running``, ``num_waiting``,
            ``kv_cache_usage``, ``prefix_cache_queries``, ``prefix_cache_hits``, and the
            ``spec_decode_*`` counters (:meth:`SpecDecodingStats.from_stats`).
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
        first = stats()
        self._last = self._counters(first)
        self._last_spec = SpecDecodingStats.from_stats(first)
        self._shown_busy = False  # the last line showed requests running or waiting

    @staticmethod
    def _counters(s: Mapping[str, float]) -> tuple[float, float]:
        return s.get("prompt_tokens", 0), s.get("generation_tokens", 0)

    def log(self) -> str | None:
        """Log the line of the interval since the previous call, and the speculative-decoding
        line when drafts were verified in it; returns what was logged (one line per line),
        or None (nothing logged) when the interval had no tokens, nothing runs or waits,
        and the previous line said so too."""
        now, s = self.clock(), self.stats()
        prompt, generation = self._counters(s)
        spec = SpecDecodingStats.from_stats(s)
        elapsed = now - self._last_time
        d_prompt, d_generation = prompt - self._last[0], generation - self._last[1]
        d_spec = spec - self._last_spec
        self._last_time, self._last, self._last_spec = now, (prompt, generation), spec
        running, waiting = int(s.get("num_running", 0)), int(s.get("num_waiting", 0))
        if not (d_prompt or d_generation or running or waiting or self._shown_busy) or elapsed <= 0:
            return None
        self._shown_busy = bool(running or waiting)
        queries = s.get("prefix_cache_queries", 0)
        line = self.prefix + format_stats_line(
            d_prompt / elapsed, d_generation / elapsed, running, waiting, s.get("kv_cache_usage", 0.0),
            s.get("prefix_cache_hits", 0) / queries if queries else 0.0, self.kv_cache_device)
        logger.info("%s", line)
        if d_spec.num_drafts:
            spec_line = self.prefix + format_spec_decoding_line(d_spec, elapsed)
            logger.info("%s", spec_line)
            line += "\n" + spec_line
        return line


__all__ = ["LOG_STATS_INTERVAL_S", "SpecDecodingStats", "StatsLogger", "format_spec_decoding_line",
           "format_stats_line"]
