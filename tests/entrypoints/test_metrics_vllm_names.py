"""``/metrics`` exports vLLM V1's metric names beside Tandem's own: each vLLM family vLLM
documents for a quantity Tandem measures exists with vLLM's type and label set and carries
exactly its ``tandem:`` twin's samples (one measurement, two names), both from one server
process and summed over several API-server processes (prometheus_client's multiprocess mode)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import MODEL_NAME

ENGINE_LABELS = {"model_name", "engine"}
FRONT_END_LABELS = {"model_name"}  # measured per request by the front end, which engine served it is not kept

# vLLM name -> (type, labels of its series, its tandem: twin), as vLLM V1 exports them
# (vllm/v1/metrics/loggers.py); counters by their family name, without ``_total``.
VLLM_FAMILIES = {
    "vllm:num_requests_running": ("gauge", ENGINE_LABELS, "tandem:num_requests_running"),
    "vllm:num_requests_waiting": ("gauge", ENGINE_LABELS, "tandem:num_requests_waiting"),
    "vllm:kv_cache_usage_perc": ("gauge", ENGINE_LABELS, "tandem:kv_cache_usage_perc"),
    "vllm:gpu_cache_usage_perc": ("gauge", ENGINE_LABELS, "tandem:kv_cache_usage_perc"),
    "vllm:prefix_cache_queries": ("counter", ENGINE_LABELS, "tandem:prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("counter", ENGINE_LABELS, "tandem:prefix_cache_hits"),
    "vllm:gpu_prefix_cache_queries": ("counter", ENGINE_LABELS, "tandem:prefix_cache_queries"),
    "vllm:gpu_prefix_cache_hits": ("counter", ENGINE_LABELS, "tandem:prefix_cache_hits"),
    "vllm:num_preemptions": ("counter", ENGINE_LABELS, "tandem:num_preemptions"),
    "vllm:prompt_tokens": ("counter", FRONT_END_LABELS, "tandem:prompt_tokens"),
    "vllm:generation_tokens": ("counter", FRONT_END_LABELS, "tandem:generation_tokens"),
    "vllm:request_success": ("counter", FRONT_END_LABELS | {"finished_reason"}, "tandem:request_success"),
    "vllm:time_to_first_token_seconds": ("histogram", FRONT_END_LABELS, "tandem:time_to_first_token_seconds"),
    "vllm:inter_token_latency_seconds": ("histogram", FRONT_END_LABELS, "tandem:inter_token_latency_seconds"),
    "vllm:time_per_output_token_seconds": ("histogram", FRONT_END_LABELS, "tandem:inter_token_latency_seconds"),
    "vllm:request_time_per_output_token_seconds": ("histogram", FRONT_END_LABELS,
                                                   "tandem:time_per_output_token_seconds"),
    "vllm:e2e_request_latency_seconds": ("histogram", FRONT_END_LABELS, "tandem:e2e_request_latency_seconds"),
    "vllm:request_prompt_tokens": ("histogram", FRONT_END_LABELS, "tandem:request_prompt_tokens"),
    "vllm:request_generation_tokens": ("histogram", FRONT_END_LABELS, "tandem:request_generation_tokens"),
}


def _samples(family, prefix: str) -> list[tuple[str, list, float]]:
    # ``host`` is Tandem's own label; vLLM's engine series do not have it.
    return sorted((s.name[len(prefix):], sorted((k, v) for k, v in s.labels.items() if k != "host"), s.value)
                  for s in family.samples)


def check_vllm_families(text: str, model_name: str) -> dict:
    """Asserts every ``VLLM_FAMILIES`` entry against the scrape ``text``; returns the families by name."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, labels, twin) in VLLM_FAMILIES.items():
        fam = families.get(name)
        assert fam is not None, f"{name} not exported"
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)
            assert s.labels["model_name"] == model_name, (name, s.labels)
        assert _samples(fam, name) == _samples(families[twin], twin), name
    return families


def _value(families: dict, family: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in families[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_server_exports_vllm_names_equal_to_their_tandem_twins(server, client):
    stream = client.completions.create(model=MODEL_NAME, prompt="Count: 1, 2, 3,", max_tokens=4, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert len([c for c in stream if c.choices]) >= 2  # streamed: inter-token latencies observed
    families = check_vllm_families(httpx.get(f"{server.url}/metrics").text, MODEL_NAME)
    # The request above reached every family (not only zeros equal to zeros).
    for name in ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]:
        assert _value(families, name, name + "_count") >= 1, name
    assert _value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") >= 4
    assert _value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") > 0
    assert _value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") > 0
    assert _value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="length") >= 1
    assert {s.labels["engine"] for s in families["vllm:num_requests_running"].samples} == {"0"}


def _fake_llm() -> SimpleNamespace:
    """What ServerMetrics reads of an AsyncLLM: two replicas' latest scheduler stats."""
    stats = {0: {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "prefix_cache_queries": 40,
                 "prefix_cache_hits": 16, "num_preemptions": 1},
             1: {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "prefix_cache_queries": 8,
                 "prefix_cache_hits": 0, "num_preemptions": 0}}
    readies = [SimpleNamespace(engine_index=e, host=f"host{e}") for e in stats]
    return SimpleNamespace(client=SimpleNamespace(readies=readies), replica_stats=lambda: stats, config=None,
                           stat_listeners=[])


_API_SERVER = textwrap.dedent("""
    import sys
    from tests.entrypoints.test_metrics_vllm_names import _fake_llm
    from tandem.engine.async_llm import RequestStats
    from tandem.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics(_fake_llm(), "m", sys.argv[1])
    m.on_first_token(0.05)
    m.on_inter_token(0.02)
    m.on_inter_token(0.03)
    m.on_request_finished(RequestStats(7, 3, 0.05, 0.1, 0.025, "length"))
    m.on_tokens(7, 3)
""")


def test_vllm_names_summed_over_api_servers_without_double_counting(tmp_path):
    from tandem.entrypoints.openai.metrics import ServerMetrics

    # Two API-server processes observe one request each into the shared multiprocess folder;
    # processes of their own because prometheus_client reads PROMETHEUS_MULTIPROC_DIR at import.
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [subprocess.Popen([sys.executable, "-c", _API_SERVER, str(tmp_path)], env=env, cwd=root)
             for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    families = check_vllm_families(generate_latest(ServerMetrics(_fake_llm(), "m", str(tmp_path)).registry).decode(),
                                   "m")
    assert _value(families, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2
    assert _value(families, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 4
    assert _value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 6
    assert _value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert _value(families, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", engine="0") == 0.25
    assert _value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", engine="0") == 16
