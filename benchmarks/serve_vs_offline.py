"""Serving vs offline throughput on the same workload, alternated and repeated.

Each round runs ``tandem bench throughput`` (offline, ``LLM``) and then ``tandem serve`` +
``tandem bench serve --request-rate inf`` (random prompts of the same lengths, EOS
ignored) with the same engine flags, and records requests/s of both and the server's
median TPOT; prints the per-round ratios and their median and spread, and writes them as
JSON. Engine flags after ``--`` go to both (model, dtype, limits, parallel layout).

Example (CPU, tiny model)::

    python benchmarks/serve_vs_offline.py --num-prompts 64 --input-len 32 --output-len 32 --rounds 3 \\
        --out /tmp/svo.json -- /tmp/tiny --tokenizer <gguf> --load-format dummy --device cpu --max-num-seqs 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tandem.entrypoints.openai.testing import RemoteServer


def offline(engine: list[str], a: argparse.Namespace) -> float:
    if engine and not engine[0].startswith("-"):  # bench throughput takes the model as --model
        engine = ["--model", *engine]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "bench", "throughput", *engine,
                        "--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len), "--output-len",
                        str(a.output_len), "--output-json", f.name], check=True)
        return json.load(open(f.name))["requests_per_s"]


def served(engine: list[str], a: argparse.Namespace) -> tuple[float, float]:
    model, rest = (engine[0], engine[1:]) if engine and not engine[0].startswith("-") else (None, engine)
    with RemoteServer(([model] if model else []) + rest, timeout=1800) as srv, tempfile.TemporaryDirectory() as d:
        tok = ["--tokenizer", rest[rest.index("--tokenizer") + 1]] if "--tokenizer" in rest else []
        subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve", "--base-url", srv.url,
                        "--dataset", "random", "--random-input-len", str(a.input_len), "--random-output-len",
                        str(a.output_len), "--random-range-ratio", "0", "--num-prompts", str(a.num_prompts),
                        "--request-rate", "inf", "--ignore-eos", *tok, *(["--max-concurrency", str(a.max_concurrency)]
                                                                         if a.max_concurrency else []),
                        "--save-result", "--result-dir", d, "--result-filename", "r.json"], check=True)
        r = json.load(open(os.path.join(d, "r.json")))
        return r["request_throughput"], r["median_tpot_ms"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON file for the rounds")
    p.add_argument("engine", nargs=argparse.REMAINDER, help="-- then engine flags for both")
    a = p.parse_args()
    engine = a.engine[1:] if a.engine[:1] == ["--"] else a.engine
    rows = []
    for i in range(a.rounds):
        off = offline(engine, a)
        srv, tpot = served(engine, a)
        rows.append({"round": i, "offline_req_s": off, "serve_req_s": srv, "ratio": srv / off, "serve_median_tpot_ms": tpot,
                     "time": time.time()})
        print(json.dumps(rows[-1]), flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"serve / offline requests/s: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
          f"max {max(ratios):.3f} over {len(ratios)} rounds")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
