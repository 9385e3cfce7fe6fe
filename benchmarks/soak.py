"""A long mixed load against ``tandem serve``: outcomes, latency and memory over time (issue 53).

Starts ``tandem serve`` (its flags after ``--``), then ``--concurrency`` clients send requests
for ``--duration-s`` seconds or ``--max-requests`` requests, whichever ends first. Each
request is drawn from a mix: chat or completions, streamed or not, with ``n=2``, logprobs,
stop strings, penalties, a JSON schema (one of ``--schemas`` distinct schemas), tools (chat); a
``--disconnect-ratio`` share of them is dropped by the client mid-way (a stream after its
second chunk, a plain request after 0.3 s) and a ``--bad-ratio`` share is invalid (each must
get a 4xx). Prompts share a few system prompts, so the prefix cache hits and evicts.

Every ``--sample-s`` seconds it records the RSS of the API server(s) and of the engine
core(s). It prints the requests by kind and outcome, latency percentiles, the RSS timeline,
the core's growth after warm-up (its largest RSS after ``--warmup-s`` over its RSS then:
issue 53 asks for at most ~1.3x) and, ``--settle-s`` seconds after the load, the engines'
queues and KV usage (all must be back to 0). ``--json PATH`` writes all of it.

CPU, the embedded SmolLM2-135M-Instruct (issue 53's soak: 16 clients, 12 minutes):

    python benchmarks/soak.py --duration-s 720 --concurrency 16 --json soak.json
    python benchmarks/soak.py --duration-s 120 -- --max-model-len 2048   # serve flags after --
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import httpx
import psutil

from tandem.entrypoints.openai.testing import RemoteServer

WORDS = ("the quick brown fox jumps over a lazy dog while seven engineers measure memory of one server "
         "under load and write down every number they see in a small notebook about caches arenas "
         "tensors grammars streams and requests").split()
SYSTEM_PROMPTS = tuple(f"You are assistant number {i}. " + " ".join((WORDS[i:] + WORDS[:i]) * 3) for i in range(4))
# A stream's client disconnects after this many chunks; a plain request's after this many seconds.
DISCONNECT_AFTER_CHUNKS = 2
DISCONNECT_AFTER_S = 0.3


@dataclass
class Outcome:
    """One request: its kind, HTTP status (0: the client dropped it; -1: a transport error),
    end-to-end and first-chunk latency (s, streams only for ``ttft``)."""

    kind: str
    status: int
    expected_4xx: bool = False
    latency: float = 0.0
    ttft: float | None = None
    error: str = ""


@dataclass
class Sample:
    """RSS (MB) of each process at ``t`` s after the load started."""

    t: float
    api_mb: list[float] = field(default_factory=list)
    core_mb: list[float] = field(default_factory=list)


def schema(i: int) -> dict:
    """The ``i``-th distinct JSON schema (its property names differ, so its grammar does)."""
    return {"type": "object", "properties": {f"name_{i}": {"type": "string", "maxLength": 24},
                                             f"count_{i}": {"type": "integer"},
                                             "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
            "required": [f"name_{i}", f"count_{i}"]}


def tools(rng: random.Random) -> list[dict]:
    """One to three function tools drawn from 50 names (a client's tool set)."""
    return [{"type": "function", "function": {
        "name": f"tool_{k}", "description": f"does thing {k}",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}} for k in rng.sample(range(50), rng.randint(1, 3))]


def prompt(rng: random.Random) -> str:
    """A shared system prompt plus 5-200 random words."""
    return rng.choice(SYSTEM_PROMPTS) + " " + " ".join(rng.choices(WORDS, k=rng.randint(5, 200)))


BAD_BODIES = (  # each must be answered 4xx
    {"temperature": -1.0},
    {"not_a_field": 1},
    {"model": "no-such-model"},
    {"max_tokens": 10**7},
    {"top_p": 2.0},
)


def build(rng: random.Random, model: str, schemas: int) -> tuple[str, str, dict]:
    """One request of the mix: (kind, path, body)."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.randint(8, 96), "temperature": rng.choice((0.0, 0.7, 1.0)),
                  "stream": stream}
    mods = []
    if rng.random() < 0.15:
        body["n"] = 2
        mods.append("n2")
    if rng.random() < 0.15:
        body.update({"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": 3})
        mods.append("logprobs")
    if rng.random() < 0.15:
        body["stop"] = rng.sample([".", "\n", " the", "engineers"], 2)
        mods.append("stop")
    if rng.random() < 0.05:
        body.update(presence_penalty=0.5, frequency_penalty=0.3)
        mods.append("penalty")
    if rng.random() < 0.1:
        s = rng.randrange(schemas)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{s}", "schema": schema(s)}}
        mods.append("json")
    elif chat and rng.random() < 0.1:
        body["tools"] = tools(rng)
        body["tool_choice"] = rng.choice(["auto", "required", {"type": "function", "function": {
            "name": body["tools"][0]["function"]["name"]}}])
        mods.append("tools")
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(rng)}]
    else:
        body["prompt"] = prompt(rng)
    kind = ("chat" if chat else "cmpl") + ("-stream" if stream else "") + "".join("+" + m for m in mods)
    return kind, "/v1/chat/completions" if chat else "/v1/completions", body


async def send(session: aiohttp.ClientSession, url: str, kind: str, body: dict, disconnect: bool) -> Outcome:
    """Send one request and read its answer (or drop it, ``disconnect``); never raises."""
    t0 = time.monotonic()
    out = Outcome(kind + ("+disconnect" if disconnect else ""), -1)
    try:
        if disconnect and not body.get("stream"):
            try:
                await asyncio.wait_for(_read(session, url, body, out, t0), DISCONNECT_AFTER_S)
            except asyncio.TimeoutError:
                out.status = 0
        else:
            await _read(session, url, body, out, t0, DISCONNECT_AFTER_CHUNKS if disconnect else None)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.status, out.error = -1, f"{type(e).__name__}: {e}"
    out.latency = time.monotonic() - t0
    return out


def _is_error_event(line: bytes) -> bool:
    """Whether an SSE ``data:`` line is the server's error event (an object with an
    ``error`` key), not a chunk whose generated text merely holds the word."""
    payload = line[len(b"data:"):].strip()
    if payload == b"[DONE]":
        return False
    try:
        event = json.loads(payload)
    except ValueError:
        return True  # not JSON: not a chunk the server meant to send
    return isinstance(event, dict) and "error" in event


async def _read(session: aiohttp.ClientSession, url: str, body: dict, out: Outcome, t0: float,
                drop_after_chunks: int | None = None) -> None:
    """Fill ``out`` from the answer; a stream is dropped after ``drop_after_chunks`` chunks
    (status 0), an error event in it counts as a 500."""
    async with session.post(url, json=body) as resp:
        out.status = resp.status
        if resp.status != 200 or not body.get("stream"):
            await resp.read()
            return
        chunks = 0
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            if out.ttft is None:
                out.ttft = time.monotonic() - t0
            if _is_error_event(line):
                out.status, out.error = 500, line.decode()[:200]
            chunks += 1
            if drop_after_chunks is not None and chunks >= drop_after_chunks:
                out.status = 0
                resp.close()
                return


async def client(idx: int, base: str, model: str, args: argparse.Namespace, deadline: float,
                 budget: list[int], outcomes: list[Outcome]) -> None:
    """One client: requests back to back until the deadline or the shared budget is spent."""
    rng = random.Random(args.seed * 1000 + idx)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            kind, path, body = build(rng, model, args.schemas)
            if rng.random() < args.bad_ratio:
                bad = rng.choice(BAD_BODIES)
                o = await send(session, base + path, "bad", {**body, **bad}, False)
                o.expected_4xx = True
            else:
                o = await send(session, base + path, kind, body, rng.random() < args.disconnect_ratio)
            outcomes.append(o)


def _mb(xs: list[float]) -> str:
    return "+".join(f"{x:.0f}" for x in xs)


def process_rss(server_pid: int, port: int) -> tuple[list[float], list[float]]:
    """RSS (MB) of the API-server processes (the launched one, and the spawned children
    listening on the server's ``port``: ``--api-server-count`` > 1) and of the engine cores
    (the other multiprocessing spawns, the resource tracker left out), each sorted."""
    api, core = [], []
    root = psutil.Process(server_pid)
    for p in [root] + root.children(recursive=True):
        try:
            cmd, rss = " ".join(p.cmdline()), p.memory_info().rss / 1e6
            serves_http = p is root or any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                                           for c in p.net_connections("tcp"))
        except psutil.Error:
            continue
        if "resource_tracker" in cmd:
            continue
        (api if serves_http or "spawn_main" not in cmd else core).append(rss)
    return sorted(api), sorted(core)


async def sampler(server_pid: int, port: int, every_s: float, t0: float, samples: list[Sample], outcomes: list[Outcome],
                  stop: asyncio.Event) -> None:
    """Record the RSS every ``every_s`` s until ``stop``; a progress line per sample."""
    while True:
        api, core = process_rss(server_pid, port)
        samples.append(Sample(round(time.monotonic() - t0, 1), api, core))
        print(f"t={samples[-1].t:.0f} s: {len(outcomes)} requests done, API server {_mb(api)} MB, "
              f"engine core {_mb(core)} MB", file=sys.stderr, flush=True)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except asyncio.TimeoutError:
            pass


async def load(base: str, model: str, server_pid: int, args: argparse.Namespace) -> tuple[list[Outcome], list[Sample]]:
    """Run the clients to the end of the load, then wait ``--settle-s``; the RSS sampled all along."""
    outcomes: list[Outcome] = []
    samples: list[Sample] = []
    t0 = time.monotonic()
    stop = asyncio.Event()
    port = int(base.rsplit(":", 1)[1])
    watch = asyncio.create_task(sampler(server_pid, port, args.sample_s, t0, samples, outcomes, stop))
    budget = [args.max_requests]
    await asyncio.gather(*(client(i, base, model, args, t0 + args.duration_s, budget, outcomes)
                           for i in range(args.concurrency)))
    print(f"load ended at t={time.monotonic() - t0:.0f} s; {args.settle_s:.0f} s to settle", file=sys.stderr,
          flush=True)
    await asyncio.sleep(args.settle_s)
    stop.set()
    await watch
    return outcomes, samples


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50/p90/p99/max of ``xs`` (s), rounded to ms; {} for none."""
    if not xs:
        return {}
    q = statistics.quantiles(xs, n=100) if len(xs) > 1 else [xs[0]] * 99
    return {"p50": round(q[49], 3), "p90": round(q[89], 3), "p99": round(q[98], 3), "max": round(max(xs), 3)}


def outcome_class(o: Outcome) -> str:
    """What a request's status means in this load (only ok, 4xx (expected) and
    disconnected are healthy)."""
    if o.status == 0:
        return "disconnected"
    if o.status < 0:
        return "transport error"
    if 400 <= o.status < 500:
        return "4xx (expected)" if o.expected_4xx else "4xx (unexpected)"
    if o.status >= 500:
        return "5xx"
    return "ok" if not o.expected_4xx else "2xx for a bad request"


def summarize(outcomes: list[Outcome], samples: list[Sample], after: dict, args: argparse.Namespace) -> dict:
    """The results: counts by outcome (and by kind), latency percentiles, the RSS samples and
    the core's growth after ``--warmup-s`` (the sum over its cores, MB)."""
    by_class: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        c = outcome_class(o)
        by_class[c] = by_class.get(c, 0) + 1
        base_kind = o.kind.split("+")[0]
        by_kind.setdefault(base_kind, {}).setdefault(c, 0)
        by_kind[base_kind][c] += 1
    ok = [o for o in outcomes if outcome_class(o) == "ok"]
    failed = [o for o in outcomes if o.error and outcome_class(o) in ("5xx", "transport error")]
    warm = [s for s in samples if s.t >= args.warmup_s and s.core_mb]
    growth = None
    if warm:
        base = sum(warm[0].core_mb)
        growth = {"core_mb_at_warmup": round(base, 1), "core_mb_max_after": round(max(sum(s.core_mb) for s in warm), 1),
                  "core_mb_last": round(sum(warm[-1].core_mb), 1)}
        growth["ratio"] = round(growth["core_mb_max_after"] / base, 3)
    return {"requests": len(outcomes), "by_outcome": by_class, "by_kind": by_kind,
            "latency_s": percentiles([o.latency for o in ok]),
            "ttft_s": percentiles([o.ttft for o in ok if o.ttft is not None]),
            "errors": sorted({o.error for o in failed})[:10],
            "core_growth_after_warmup": growth, "engines_after_load": after,
            "rss": [asdict(s) for s in samples]}


def engines_after(base: str) -> dict:
    """The engines' queues, KV usage and prefix-cache counters (``/debug/engine_stats``)."""
    s = httpx.get(f"{base}/debug/engine_stats", timeout=30).json()
    return {k: s[k] for k in ("num_running", "num_waiting", "kv_cache_usage", "num_unfinished_seqs",
                              "num_seqs_with_blocks", "prefix_cache_queries", "prefix_cache_hits")}


def report(r: dict) -> None:
    """Print the results of :func:`summarize`."""
    print(f"\n{r['requests']} requests: " + ", ".join(f"{k} {v}" for k, v in sorted(r["by_outcome"].items())))
    for kind, counts in sorted(r["by_kind"].items()):
        print(f"  {kind:<14} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"latency (ok, s): {r['latency_s']}\nTTFT (ok streams, s): {r['ttft_s']}")
    for e in r["errors"]:
        print(f"  error: {e}")
    print("\n   t (s)   API server MB   engine core MB")
    for s in r["rss"]:
        print(f"{s['t']:8.0f}   {_mb(s['api_mb']):>13}   {_mb(s['core_mb']):>14}")
    print(f"\ncore growth after warm-up: {r['core_growth_after_warmup']}")
    print(f"engines after the load: {r['engines_after_load']}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=720.0, help="load duration (default 720)")
    ap.add_argument("--max-requests", type=int, default=10**9, help="stop after this many requests")
    ap.add_argument("--concurrency", type=int, default=16, help="clients sending back to back (default 16)")
    ap.add_argument("--schemas", type=int, default=200, help="distinct JSON schemas in the mix (default 200)")
    ap.add_argument("--disconnect-ratio", type=float, default=0.1)
    ap.add_argument("--bad-ratio", type=float, default=0.1)
    ap.add_argument("--sample-s", type=float, default=15.0, help="seconds between two RSS samples (default 15)")
    ap.add_argument("--warmup-s", type=float, default=120.0,
                    help="the core's RSS at this time is the base of its growth ratio (default 120)")
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after the load before the last sample")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--server-log", help="write the server's output here")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    with RemoteServer(["--disable-uvicorn-access-log", *serve_args], timeout=600) as srv:
        model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
        api, core = process_rss(srv.proc.pid, srv.port)
        print(f"server ready: API server {_mb(api)} MB, engine core {_mb(core)} MB; load for {args.duration_s:.0f} s, "
              f"{args.concurrency} clients", flush=True)
        outcomes, samples = asyncio.run(load(srv.url, model, srv.proc.pid, args))
        r = summarize(outcomes, samples, engines_after(srv.url), args)
        r["fresh_mb"] = {"api": api, "core": core}
        r["args"] = vars(args) | {"serve_args": serve_args}
        if args.server_log:
            with open(args.server_log, "w") as f:
                f.write(srv.log())
    report(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
