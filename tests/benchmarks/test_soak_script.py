"""benchmarks/soak.py, bounded for CI (issue 53): a minute of the mixed load against ``tandem
serve`` (embedded model, CPU) gets no 5xx and no unexpected status, leaves no request, queue
or KV block behind, and the engine core's RSS after warm-up stays within 1.3x."""

from __future__ import annotations

import json
import os

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture
def soak(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import soak

    return soak


def test_outcome_classes(soak):
    assert soak.outcome_class(soak.Outcome("chat", 200)) == "ok"
    assert soak.outcome_class(soak.Outcome("bad", 400, expected_4xx=True)) == "4xx (expected)"
    assert soak.outcome_class(soak.Outcome("bad", 200, expected_4xx=True)) == "2xx for a bad request"
    assert soak.outcome_class(soak.Outcome("chat", 404)) == "4xx (unexpected)"
    assert soak.outcome_class(soak.Outcome("chat", 0)) == "disconnected"
    assert soak.outcome_class(soak.Outcome("chat", 500)) == "5xx"


def test_half_a_minute_of_mixed_load(soak, tmp_path):
    out = tmp_path / "soak.json"
    soak.main(["--duration-s", "24", "--concurrency", "8", "--sample-s", "3", "--warmup-s", "10", "--json", str(out),
               "--", "--max-model-len", "2048", "--kv-cache-memory-gib", "0.25", "--device", "cpu",
               "--api-server-count", "2"])
    r = json.loads(out.read_text())
    # The launcher and its two API servers (they listen on the port), one engine core.
    assert (len(r["fresh_mb"]["api"]), len(r["fresh_mb"]["core"])) == (3, 1), r["fresh_mb"]
    assert set(r["by_outcome"]) <= {"ok", "4xx (expected)", "disconnected"}, r["by_outcome"]
    assert r["by_outcome"]["ok"] > 0
    after = r["engines_after_load"]
    assert after["num_running"] == after["num_waiting"] == after["num_seqs_with_blocks"] == 0, after
    assert after["kv_cache_usage"] == 0.0
    assert r["core_growth_after_warmup"]["ratio"] <= 1.3, r["core_growth_after_warmup"]


def test_only_the_servers_error_event_counts_as_a_stream_error(soak):
    """A chunk whose generated text is the word "error" (random weights do that) is a
    chunk, not a failure; the server's OpenAI-shaped error event is one."""
    chunk = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
             b'"delta":{"content":"error"},"finish_reason":null}]}')
    assert not soak._is_error_event(chunk)
    assert not soak._is_error_event(b"data: [DONE]")
    assert soak._is_error_event(b'data: {"error": {"message": "engine died", "type": "InternalServerError"}}')
