"""The server log's periodic stats line (vLLM's): its format, and that it is logged for an
interval with work and not for an idle one."""

from __future__ import annotations

import logging

from tandem.engine.stat_logger import StatsLogger, format_stats_line


def test_format_is_vllms():
    assert format_stats_line(512.0, 96.25, 4, 1, 0.0312, 0.42) == (
        "Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.2 tokens/s, Running: 4 reqs, "
        "Waiting: 1 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 42.0%")
    assert "CPU KV cache usage: 0.0%" in format_stats_line(0, 0, 0, 0, 0.0, 0.0, kv_cache_device="CPU")


class _Source:
    """Stands in for ``AsyncLLM.stats()`` and the clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "num_running": 0, "num_waiting": 0,
                      "kv_cache_usage": 0.0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def advance(self, seconds: float, **changes) -> None:
        self.now += seconds
        self.stats.update(changes)


def test_logged_while_there_is_work_and_until_the_idle_state_is_shown(caplog):
    caplog.set_level(logging.INFO, logger="tandem.engine.stat_logger")
    src = _Source()
    stats_logger = StatsLogger(lambda: src.stats, kv_cache_device="CPU", clock=lambda: src.now)
    src.advance(10)
    assert stats_logger.log() is None  # idle from the start: nothing
    src.advance(10, prompt_tokens=200, generation_tokens=50, num_running=3, num_waiting=2, kv_cache_usage=0.25,
                prefix_cache_queries=200, prefix_cache_hits=50)
    assert stats_logger.log() == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, CPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    src.advance(5, num_running=5, num_waiting=0)  # no new tokens, but requests run: logged
    assert "Avg generation throughput: 0.0 tokens/s, Running: 5 reqs" in stats_logger.log()
    src.advance(10, generation_tokens=150, num_running=0, kv_cache_usage=0.0)  # the work ends in this interval
    assert "Avg generation throughput: 10.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs" in stats_logger.log()
    for _ in range(3):  # idle
        src.advance(10)
        assert stats_logger.log() is None
    src.advance(10, generation_tokens=160, num_running=1)  # the last tokens, before the final state arrived
    assert "Running: 1 reqs" in stats_logger.log()
    src.advance(10, num_running=0)
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs" in stats_logger.log()
    src.advance(10)
    assert stats_logger.log() is None
    assert len(caplog.messages) == 5 and all(m.startswith("Avg prompt throughput") for m in caplog.messages)


def test_prefix_names_the_api_server(caplog):
    caplog.set_level(logging.INFO, logger="tandem.engine.stat_logger")
    src = _Source()
    stats_logger = StatsLogger(lambda: src.stats, prefix="API server 1: ", clock=lambda: src.now)
    src.advance(10, num_waiting=1)
    assert stats_logger.log().startswith("API server 1: Avg prompt throughput: 0.0 tokens/s")
    assert caplog.messages[-1].startswith("API server 1: ")
