"""The server log's periodic stats line (vLLM's): its format, and that it is logged for an
interval with work and not for an idle one; the speculative-decoding line (vLLM's
SpecDecodingLogging) of an interval that verified drafts."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from tandem.engine.async_llm import AsyncLLM, sum_replica_stats
from tandem.engine.messages import CoreMessage, EngineCoreOutputs, MsgpackDecoder, MsgpackEncoder, SchedulerStats
from tandem.engine.stat_logger import SpecDecodingStats, StatsLogger, format_spec_decoding_line, format_stats_line


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


def test_spec_decoding_line_is_vllms():
    stats = SpecDecodingStats(num_drafts=8, num_draft_tokens=32, num_accepted_tokens=12,
                              num_accepted_tokens_per_pos=(6, 4, 2, 0))
    assert format_spec_decoding_line(stats, elapsed_s=10.0) == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.20 tokens/s, "
        "Drafted throughput: 3.20 tokens/s, Accepted: 12 tokens, Drafted: 32 tokens, "
        "Per-position acceptance rate: 0.750, 0.500, 0.250, 0.000, Avg Draft acceptance rate: 37.5%")


def test_spec_decoding_line_covers_the_interval_and_only_one_with_drafts(caplog):
    caplog.set_level(logging.INFO, logger="tandem.engine.stat_logger")
    src = _Source()
    src.stats.update(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=20, spec_decode_num_accepted_tokens=9,
                     spec_decode_num_accepted_tokens_per_pos=[4, 3, 2, 0])
    stats_logger = StatsLogger(lambda: src.stats, clock=lambda: src.now)
    src.advance(10, generation_tokens=40, num_running=1, spec_decode_num_drafts=15, spec_decode_num_draft_tokens=60,
                spec_decode_num_accepted_tokens=29,
                spec_decode_num_accepted_tokens_per_pos=[12, 9, 6, 2])
    main, spec = stats_logger.log().split("\n")
    assert main.startswith("Avg prompt throughput") and caplog.messages[-2:] == [main, spec]
    assert spec == ("SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 2.00 tokens/s, "
                    "Drafted throughput: 4.00 tokens/s, Accepted: 20 tokens, Drafted: 40 tokens, "
                    "Per-position acceptance rate: 0.800, 0.600, 0.400, 0.200, Avg Draft acceptance rate: 50.0%")
    src.advance(10, generation_tokens=50)  # tokens without drafts (e.g. prefills only): no spec line
    assert "\n" not in stats_logger.log() and not caplog.messages[-1].startswith("SpecDecoding")


def test_spec_decoding_line_of_replicas_through_the_front_end():
    """Each core's counters cross msgpack and are summed by ``AsyncLLM.stats()`` (position by
    position) into what the logger reads."""
    front_end = SimpleNamespace(_scheduler_stats={}, output_processor=SimpleNamespace(
        stats={"prompt_tokens": 0, "generation_tokens": 0}, parents={}))
    enc, dec = MsgpackEncoder(), MsgpackDecoder(CoreMessage)

    def report(e: int, drafts: int, accepted_per_pos: tuple[int, ...]) -> None:
        st = SchedulerStats(num_running=1, spec_decode_num_drafts=drafts,
                            spec_decode_num_draft_tokens=drafts * len(accepted_per_pos),
                            spec_decode_num_accepted_tokens=sum(accepted_per_pos),
                            spec_decode_num_accepted_tokens_per_pos=list(accepted_per_pos))
        AsyncLLM._on_outputs(front_end, dec.decode(enc.encode(EngineCoreOutputs(e, [], st))))

    now = [0.0]
    stats_logger = StatsLogger(lambda: AsyncLLM.stats(front_end), clock=lambda: now[0])
    report(0, 4, (3, 2))
    report(1, 6, (5, 1))
    now[0] = 2.0
    spec_line = stats_logger.log().split("\n")[1]
    assert "Accepted: 11 tokens, Drafted: 20 tokens, Per-position acceptance rate: 0.800, 0.300" in spec_line


def test_replica_stats_sum_numbers_and_positions_element_wise():
    """Numbers add, per-position counts add position by position (the shorter padded with
    zeros, into a new list), kv_cache_usage is the average; the inputs are left as they were."""
    a = {"num_running": 2, "kv_cache_usage": 0.5, "spec_decode_num_drafts": 4,
         "spec_decode_num_accepted_tokens_per_pos": [3, 2]}
    b = {"num_running": 1, "kv_cache_usage": 0.25, "spec_decode_num_drafts": 6,
         "spec_decode_num_accepted_tokens_per_pos": (5, 1, 1)}
    assert sum_replica_stats([a, b]) == {"num_running": 3, "kv_cache_usage": 0.375, "spec_decode_num_drafts": 10,
                                         "spec_decode_num_accepted_tokens_per_pos": [8, 3, 1]}
    assert a["spec_decode_num_accepted_tokens_per_pos"] == [3, 2]
    assert sum_replica_stats([a])["spec_decode_num_accepted_tokens_per_pos"] is not \
        a["spec_decode_num_accepted_tokens_per_pos"]
    assert sum_replica_stats([b, {"num_running": 0, "spec_decode_num_accepted_tokens_per_pos": []}])[
        "spec_decode_num_accepted_tokens_per_pos"] == [5, 1, 1]
    assert sum_replica_stats([]) == {}
