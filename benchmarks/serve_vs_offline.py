"""Serving vs offline throughput on the same workload, alternated and repeated.

Each round runs ``tandem bench throughput`` (offline, ``LLM``) and then ``tandem serve`` +
``tandem bench serve --request-rate inf`` (random prompts of the same lengths, EOS
ignored) with the same engine flags, and records requests/s of both and the server's
median TPOT and inter-token latency, and the front end's CPU time per output token; prints
the per-round ratios and their median and spread, and writes them as JSON. Engine flags after ``--`` go to both (model, dtype, limits, parallel layout);
``--server-args`` (one shell-quoted string) go to ``tandem serve`` only; repeated, each
round runs one served run per value (side by side, same offline figure), e.g.
``--server-args "" --server-args "--api-server-count 4"``. ``--extra-bench`` (one quoted
string of ``tandem bench serve`` flags, repeatable) runs more loads against each server
after the main one, e.g. ``--extra-bench "--max-concurrency 256" --extra-bench
"--request-rate 20 --num-prompts 300"``; each records requests/s, median TPOT and TTFT
percentiles.

Example (CPU, tiny model)::

    python benchmarks/serve_vs_offline.py --num-prompts 64 --input-len 32 --output-len 32 --rounds 3 \\
        --out /tmp/svo.json -- /tmp/tiny --tokenizer <gguf> --load-format dummy --device cpu --max-num-seqs 64
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from tandem.entrypoints.openai.testing import RemoteServer


def offline(engine: list[str], a: argparse.Namespace) -> float:
    if engine and not engine[0].startswith("-"):  # bench throughput takes the model as --model
        engine = ["--model", *engine]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "bench", "throughput", *engine,
                        "--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len), "--output-len",
                        str(a.output_len), "--output-json", f.name], check=True)
        return json.load(open(f.name))["requests_per_s"]


def frontend_pids(srv: RemoteServer) -> list[int]:
    """The server's front-end processes: the launching process and every API server (each
    found through ``/debug/engine_stats`` on new connections)."""
    pids = {srv.proc.pid}
    seen: dict[int, int] = {}
    count, deadline = None, time.monotonic() + 120
    while (count is None or len(seen) < count) and time.monotonic() < deadline:
        r = httpx.get(f"{srv.url}/debug/engine_stats", timeout=60)
        if r.status_code != 200:  # an API server still attaching to the cores answers 503
            time.sleep(0.2)
            continue
        info = r.json()["api_server"]
        count = info["count"]
        seen[info["index"]] = info["pid"]
    return sorted(pids | set(seen.values()))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes so far (their threads included)."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def bench_serve(url: str, tok: list[str], a: argparse.Namespace, load: list[str], d: str, name: str) -> dict:
    """``tandem bench serve`` of the random workload at ``load`` (later flags win); its result
    JSON, with the benchmark client's own CPU time (``client_cpu_s``) and wall time
    (``client_wall_s``) added: a client near one core would bound the served figure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve", "--base-url", url,
                    "--dataset", "random", "--random-input-len", str(a.input_len), "--random-output-len",
                    str(a.output_len), "--random-range-ratio", "0", "--num-prompts", str(a.num_prompts),
                    "--request-rate", "inf", "--ignore-eos", *tok, *load,
                    "--save-result", "--result-dir", d, "--result-filename", name], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.path.join(d, name)) as f:
        r = json.load(f)
    r["client_cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    r["client_wall_s"] = time.monotonic() - t0
    return r


def served(engine: list[str], server_args: str, a: argparse.Namespace) -> dict:
    """One served run: requests/s, median TPOT, median and P99 ITL, and the front end's CPU
    time per output token (the launching process and every API server; the cores left out);
    then each ``--extra-bench`` load against the same server."""
    model, rest = (engine[0], engine[1:]) if engine and not engine[0].startswith("-") else (None, engine)
    with RemoteServer(([model] if model else []) + rest + shlex.split(server_args), timeout=1800) as srv, \
            tempfile.TemporaryDirectory() as d:
        tok = ["--tokenizer", rest[rest.index("--tokenizer") + 1]] if "--tokenizer" in rest else []
        pids = frontend_pids(srv)
        cpu0 = cpu_seconds(pids)
        r = bench_serve(srv.url, tok, a, ["--max-concurrency", str(a.max_concurrency)] if a.max_concurrency else [],
                        d, "r.json")
        cpu = cpu_seconds(pids) - cpu0
        extra = {}
        for i, load in enumerate(a.extra_bench or []):
            x = bench_serve(srv.url, tok, a, shlex.split(load), d, f"x{i}.json")
            extra[load] = {"req_s": x["request_throughput"], "median_tpot_ms": x["median_tpot_ms"],
                           "median_ttft_ms": x.get("median_ttft_ms"), "p99_ttft_ms": x.get("p99_ttft_ms"),
                           "p99_itl_ms": x.get("p99_itl_ms"),
                           "client_cpu_s": x["client_cpu_s"], "client_wall_s": x["client_wall_s"]}
        return {"serve_req_s": r["request_throughput"], "serve_median_tpot_ms": r["median_tpot_ms"],
                "serve_median_itl_ms": r.get("median_itl_ms"), "serve_p99_itl_ms": r.get("p99_itl_ms"),
                "frontend_cpu_us_per_token": 1e6 * cpu / max(1, r["total_output_tokens"]),
                "frontend_processes": len(pids), "client_cpu_s": r["client_cpu_s"],
                "client_wall_s": r["client_wall_s"], "extra": extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON file for the rounds")
    p.add_argument("--server-args", action="append", default=None,
                   help="flags for tandem serve only (one quoted string); repeat it to compare servers: each "
                        "round then runs one served run per value, in order, after the offline run")
    p.add_argument("--extra-bench", action="append", default=None,
                   help="tandem bench serve flags (one quoted string) of a further load on each server; repeatable")
    p.add_argument("engine", nargs=argparse.REMAINDER, help="-- then engine flags for both")
    a = p.parse_args()
    engine = a.engine[1:] if a.engine[:1] == ["--"] else a.engine
    variants = a.server_args or [""]
    rows = []
    for i in range(a.rounds):
        off = offline(engine, a)
        for v in variants:
            res = served(engine, v, a)
            rows.append({"round": i, "server_args": v, "offline_req_s": off, **res,
                         "ratio": res["serve_req_s"] / off, "time": time.time()})
            print(json.dumps(rows[-1]), flush=True)
    for v in variants:
        ratios = [r["ratio"] for r in rows if r["server_args"] == v]
        print(f"[{v or 'default server'}] serve / offline requests/s: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} rounds")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
