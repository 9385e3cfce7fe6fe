"""Prometheus metrics of the server (``GET /metrics``), named like vLLM's with ``tandem:``.

Latency histograms (seconds) are observed by the front end as outputs arrive:
``time_to_first_token_seconds`` (arrival -> first token), ``inter_token_latency_seconds``
(between two streamed outputs), ``time_per_output_token_seconds`` (per request:
(e2e - ttft) / (tokens - 1)), ``e2e_request_latency_seconds``; so are the prompt and
generation token counters. Engine state (running and waiting requests, KV cache usage,
prefix-cache hits, preemptions, and with a speculative config the speculative-decoding
counters) is read at scrape time from the latest stats every engine core sent.

With several API servers (``--api-server-count``) each process writes its histograms and
counters to files in a shared folder (prometheus_client's multiprocess mode, as vLLM) and
``/metrics`` of any of them sums them all; the engine state is the same in every one of
them (every core sends its stats to every API server).

Every family whose quantity vLLM V1 also exports is exported a second time under vLLM's
name and label set (``_VLLM_NAMES``), for dashboards, autoscalers and routers written for
vLLM: the same samples of the same collection, renamed, so nothing is measured or counted
twice and both names always agree within one scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from tandem.engine.async_llm import AsyncLLM, RequestStats

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]

# Tandem family -> the vLLM V1 families that are the same quantity in the same unit (the
# README's metrics section lists what is left out and why). vLLM's
# ``time_per_output_token_seconds`` is its deprecated name of the per-token inter-token
# latency, not of Tandem's per-request ``time_per_output_token_seconds``; the ``gpu_``
# names are V1's deprecated ones, still read by older dashboards.
_VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "tandem:num_requests_running": ("vllm:num_requests_running",),
    "tandem:num_requests_waiting": ("vllm:num_requests_waiting",),
    "tandem:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tandem:prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "tandem:prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "tandem:num_preemptions": ("vllm:num_preemptions",),
    "tandem:prompt_tokens": ("vllm:prompt_tokens",),
    "tandem:generation_tokens": ("vllm:generation_tokens",),
    "tandem:request_success": ("vllm:request_success",),
    "tandem:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tandem:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                           "vllm:time_per_output_token_seconds"),
    "tandem:time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "tandem:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tandem:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "tandem:request_generation_tokens": ("vllm:request_generation_tokens",),
    "tandem:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "tandem:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tandem:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "tandem:spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}
# vLLM labels its engines' series model_name and engine only.
_NOT_VLLM_LABELS = frozenset({"host"})


class _EngineCollector:
    """Gauges and counters read from ``AsyncLLM.replica_stats()`` when scraped."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    def collect(self):
        """One series per replica, labelled ``engine`` (its data-parallel rank) and ``host``
        (where it runs), as vLLM labels its engines' gauges."""
        readies = {r.engine_index: r for r in getattr(self.llm.client, "readies", [])}
        replicas = self.llm.replica_stats() or {0: {}}
        labels = ["model_name", "engine", "host"]
        families = {}
        config = getattr(self.llm, "config", None)
        spec = config.speculative_config if config is not None else None

        def add(kind, name: str, doc: str, e: int, value: float, **extra_labels: str) -> None:
            fam = families.get(name)
            if fam is None:
                fam = families[name] = kind(name, doc, labels=labels + list(extra_labels))
            ready = readies.get(e)
            fam.add_metric([self.model_name, str(e), ready.host if ready is not None else "", *extra_labels.values()],
                           value)

        for e, s in replicas.items():
            add(GaugeMetricFamily, "tandem:num_requests_running", "Sequences in the running batch.", e,
                s.get("num_running", 0))
            add(GaugeMetricFamily, "tandem:num_requests_waiting", "Sequences waiting to be scheduled.", e,
                s.get("num_waiting", 0))
            add(GaugeMetricFamily, "tandem:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", e,
                s.get("kv_cache_usage", 0.0))
            add(GaugeMetricFamily, "tandem:kv_cache_free_blocks", "Free KV cache blocks.", e,
                s.get("num_free_blocks", 0))
            add(GaugeMetricFamily, "tandem:kv_cache_usable_blocks", "Usable KV cache blocks (all but the null block).",
                e, s.get("num_usable_blocks", 0))
            q, h = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
            add(GaugeMetricFamily, "tandem:prefix_cache_hit_rate",
                "Prefix cache hits / queries, in tokens, since start.", e, h / q if q else 0.0)
            add(CounterMetricFamily, "tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e, q)
            add(CounterMetricFamily, "tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.", e, h)
            add(CounterMetricFamily, "tandem:num_preemptions", "Preemptions (recompute).", e,
                s.get("num_preemptions", 0))
            if spec is not None:
                _add_spec_decode(add, e, s, spec.num_speculative_tokens)
        yield from families.values()
        det = GaugeMetricFamily("tandem:deterministic", "1: batch-invariant execution (--deterministic), 0: default.",
                                labels=["model_name"])
        det.add_metric([self.model_name], float(bool(config is not None and config.model_config.deterministic)))
        yield det


def _add_spec_decode(add: Callable[..., None], e: int, s: dict, num_speculative_tokens: int) -> None:
    """Replica ``e``'s speculative-decoding counters from its stats ``s`` (vLLM's
    SpecDecodingProm), every draft position up to ``num_speculative_tokens`` from the start.
    Acceptance rate: accepted / draft tokens; mean acceptance length: 1 + accepted / drafts;
    acceptance rate at a position: its accepted tokens / drafts."""
    add(CounterMetricFamily, "tandem:spec_decode_num_drafts", "Verifications: sequence-steps with draft tokens.",
        e, s.get("spec_decode_num_drafts", 0))
    add(CounterMetricFamily, "tandem:spec_decode_num_draft_tokens", "Draft tokens verified.", e,
        s.get("spec_decode_num_draft_tokens", 0))
    add(CounterMetricFamily, "tandem:spec_decode_num_accepted_tokens", "Draft tokens accepted.", e,
        s.get("spec_decode_num_accepted_tokens", 0))
    per_pos = s.get("spec_decode_num_accepted_tokens_per_pos", ())
    for pos in range(max(num_speculative_tokens, len(per_pos))):
        add(CounterMetricFamily, "tandem:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (0: the first draft).", e,
            per_pos[pos] if pos < len(per_pos) else 0, position=str(pos))


def _renamed(family: Metric, name: str) -> Metric:
    """``family``'s samples under ``name`` (and its ``_total``, ``_bucket``, ... suffixes),
    without the labels vLLM does not have."""
    out = Metric(name, family.documentation, family.type, family.unit)
    out.samples = [s._replace(name=name + s.name[len(family.name):],
                              labels={k: v for k, v in s.labels.items() if k not in _NOT_VLLM_LABELS})
                   for s in family.samples]
    return out


class _WithVllmNames:
    """Collects ``sources`` and yields each family, then its vLLM-named views (``_VLLM_NAMES``)."""

    def __init__(self, sources: Iterable[Collector]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        """Every family of ``sources``, each followed by its vLLM twins."""
        for source in self.sources:
            for family in source.collect():
                yield family
                for name in _VLLM_NAMES.get(family.name, ()):
                    yield _renamed(family, name)


class ServerMetrics:
    """The server's Prometheus registry (``registry``, what ``/metrics`` exports: the
    ``tandem:`` families and their vLLM-named views); a ``StatListener`` of ``AsyncLLM``.

    Args:
        multiprocess_dir: the ``PROMETHEUS_MULTIPROC_DIR`` shared by several API-server
            processes (set before prometheus_client was imported): export the sum over all
            of them. None: this process's own values.
    """

    def __init__(self, llm: AsyncLLM, model_name: str, multiprocess_dir: str | None = None) -> None:
        own = CollectorRegistry(auto_describe=False)
        front_end = own if multiprocess_dir is None else MultiProcessCollector(None, path=multiprocess_dir)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_WithVllmNames([front_end, _EngineCollector(llm, model_name)]))
        self.model_name = model_name
        lab = ["model_name"]
        r = own
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token (s).", lab,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between two streamed outputs (s).", lab,
                             buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("tandem:time_per_output_token_seconds", "Mean time per output token of a request (s).",
                              lab, buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "End-to-end request latency (s).", lab,
                             buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_len = Histogram("tandem:request_prompt_tokens", "Prompt tokens per request.", lab,
                                    buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.gen_len = Histogram("tandem:request_generation_tokens", "Generated tokens per request.", lab,
                                 buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("tandem:request_success", "Finished requests by finish reason.",
                                lab + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of accepted requests.", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens.", lab,
                                         registry=r).labels(model_name)
        # Every finish reason's series exists from the start (at 0), as vLLM's, so that
        # rate() over them works before the first request of each kind.
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        llm.stat_listeners.append(self)

    # StatListener
    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_inter_token(self, itl: float) -> None:
        self.itl.observe(itl)

    def on_request_finished(self, st: RequestStats) -> None:
        self.e2e.observe(st.e2e)
        if st.tpot is not None:
            self.tpot.observe(st.tpot)
        self.prompt_len.observe(st.num_prompt_tokens)
        self.gen_len.observe(st.num_generation_tokens)
        self._success.labels(self.model_name, st.finish_reason or "unknown").inc()

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)
