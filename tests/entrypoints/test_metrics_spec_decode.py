"""``/metrics``' speculative-decoding counters (vLLM's SpecDecodingProm families, ``tandem:``
and ``vllm:`` names): exported only with a speculative config, per engine, every draft
position from the start, and equal to the engine cores' own counters."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.test_metrics_vllm_names import _fake_llm, _samples

# Drafts at every batch size: the requests run together.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": None}
COUNTERS = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"]
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
# The embedded model, greedy, continues both with drafts of the n-gram proposer, the second
# rejecting some of them.
REPETITIVE = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
              "def add(a, b):\n    return a + b\n\n\ndef add(a, b):"]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, **labels: str) -> float:
    return sum(s.value for s in families[name].samples
               if s.name == name + "_total" and all(s.labels.get(k) == v for k, v in labels.items()))


def _spec_llm(num_speculative_tokens: int) -> SimpleNamespace:
    """Two replicas' stats with speculative-decoding counters; replica 1 has verified nothing."""
    llm = _fake_llm()
    stats = llm.replica_stats()
    stats[0].update(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30, spec_decode_num_accepted_tokens=15,
                    spec_decode_num_accepted_tokens_per_pos=[8, 5, 2])
    stats[1].update(spec_decode_num_accepted_tokens_per_pos=[0, 0, 0])
    llm.config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
                                 model_config=SimpleNamespace(deterministic=False))
    return llm


def _scrape(llm) -> dict:
    from tandem.entrypoints.openai.metrics import ServerMetrics

    return _families(generate_latest(ServerMetrics(llm, "m").registry).decode())


def test_counters_per_engine_with_their_vllm_twins():
    families = _scrape(_spec_llm(num_speculative_tokens=4))
    for name in COUNTERS + [PER_POS]:
        tandem, vllm = families[f"tandem:{name}"], families[f"vllm:{name}"]
        assert tandem.type == vllm.type == "counter", name
        assert _samples(tandem, f"tandem:{name}") == _samples(vllm, f"vllm:{name}"), name
        labels = {"model_name", "engine"} | ({"position"} if name == PER_POS else set())
        assert all(set(s.labels) == labels for s in vllm.samples), name
    assert [_value(families, f"vllm:{n}", engine="0") for n in COUNTERS] == [10, 30, 15]
    assert [_value(families, f"vllm:{n}", engine="1") for n in COUNTERS] == [0, 0, 0]
    # Every position up to K, those no draft reached yet at 0.
    assert [_value(families, f"vllm:{PER_POS}", engine="0", position=str(p)) for p in range(4)] == [8, 5, 2, 0]
    assert {s.labels["position"] for s in families[f"vllm:{PER_POS}"].samples if s.labels["engine"] == "1"} == \
        {"0", "1", "2", "3"}


def test_not_exported_without_a_speculative_config():
    families = _scrape(_fake_llm())
    assert not [name for name in families if "spec_decode" in name]


@pytest.fixture(scope="module")
def spec_server():
    from tandem.entrypoints.openai.testing import RemoteServer

    args = ["--max-model-len", "1024", "--kv-cache-memory-gib", "0.25", "--dtype", "float32", "--device", "cpu",
            "--speculative-config", json.dumps(SPEC)]
    with RemoteServer(args) as srv:
        yield srv


def test_server_counters_equal_the_engine_cores(spec_server):
    """Repetitive prompts, greedy: the n-gram proposer drafts, some drafts are rejected, and
    ``/metrics`` (both names) shows exactly the cores' counters; a position counts no more
    than the one before it, and the positions add up to the accepted tokens."""
    r = httpx.post(f"{spec_server.url}/v1/completions", timeout=120,
                   json={"prompt": REPETITIVE, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    engine = httpx.get(f"{spec_server.url}/debug/engine_stats", timeout=30).json()
    families = _families(httpx.get(f"{spec_server.url}/metrics", timeout=30).text)
    assert 0 < engine["spec_decode_num_accepted_tokens"] < engine["spec_decode_num_draft_tokens"]
    per_pos = engine[PER_POS]
    assert len(per_pos) == SPEC["num_speculative_tokens"]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == engine["spec_decode_num_accepted_tokens"]
    for prefix in ("tandem:", "vllm:"):
        assert [_value(families, prefix + n) for n in COUNTERS] == [engine[n] for n in COUNTERS], prefix
        assert [_value(families, prefix + PER_POS, position=str(p)) for p in range(len(per_pos))] == per_pos, prefix
