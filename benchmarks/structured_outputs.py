"""Constrained (JSON schema) vs free requests through ``tandem serve``, side by side (issue 18).

One server; ``tandem bench serve`` runs alternate between free requests and the same
requests constrained with ``response_format`` ``json_schema`` (``--structured-output-ratio``
0 and 1), the order swapped every repeat; prints the median and spread of output token
throughput and TPOT of each and their ratio, and the share of constrained outputs valid
for the schema. A first untimed run of each kind warms the server (and the schema's
compiled grammar, cached per schema).

CPU, the embedded SmolLM2-135M-Instruct:

    python benchmarks/structured_outputs.py --out OUT --num-prompts 16 --input-len 64 --output-len 64 \\
        --max-concurrency 8 --repeats 3 -- --device cpu --max-model-len 1024

H200, the seed workload's shape (Llama-3.1-8B shape, bf16 dummy weights, input 128,
output 256, EOS ignored, 256 sequences):

    python benchmarks/structured_outputs.py --out OUT --llama8b --num-prompts 1000 --input-len 128 \\
        --output-len 256 --max-concurrency 256 --repeats 3 -- --max-num-seqs 256 --max-model-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def bench(url: str, out: str, name: str, ratio: float, args) -> dict:
    path = os.path.join(out, f"{name}.json")
    cmd = [sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve", "--base-url", url, "--dataset", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--ignore-eos",
           "--structured-output-ratio", str(ratio), "--save-result", "--result-dir", out,
           "--result-filename", f"{name}.json", "--seed", "0"]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    if args.json_schema_path:
        cmd += ["--json-schema-path", args.json_schema_path]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(path) as f:
        return json.load(f)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--llama8b", action="store_true", help="serve the Llama-3.1-8B shape with bf16 dummy weights")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-schema-path", default=None)
    p.add_argument("serve_args", nargs="*", help="extra tandem serve flags (after --)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from tandem.entrypoints.openai.testing import RemoteServer

    serve_args = list(args.serve_args)
    args.tokenizer = None
    if args.llama8b:
        from model_shapes import LLAMA_31_8B, tokenizer_dir, write_config_dir

        model = write_config_dir(LLAMA_31_8B, os.path.join(args.out, "llama8b"))
        args.tokenizer = tokenizer_dir()
        serve_args = [model, "--tokenizer", args.tokenizer, "--load-format", "dummy", "--dtype", "bfloat16", *serve_args]
    load = os.getloadavg()
    with RemoteServer(serve_args, timeout=1200) as srv:
        bench(srv.url, args.out, "warm_free", 0.0, args)
        bench(srv.url, args.out, "warm_constrained", 1.0, args)
        runs: dict[str, list[dict]] = {"free": [], "constrained": []}
        for r in range(args.repeats):
            order = ("free", "constrained") if r % 2 == 0 else ("constrained", "free")
            for kind in order:
                runs[kind].append(bench(srv.url, args.out, f"{kind}_{r}", 1.0 if kind == "constrained" else 0.0, args))
                time.sleep(1)
    tput = {k: [x["output_throughput"] for x in v] for k, v in runs.items()}
    tpot = {k: [x["median_tpot_ms"] for x in v] for k, v in runs.items()}
    res = {
        "load_average_before": load, "load_average_after": os.getloadavg(), "args": vars(args),
        "output_throughput": tput, "median_tpot_ms": tpot,
        "throughput_ratio": [c / f for c, f in zip(tput["constrained"], tput["free"])],
        "tpot_ratio": [c / f for c, f in zip(tpot["constrained"], tpot["free"])],
        "schema_valid": [(x["num_schema_valid"], x["num_constrained"]) for x in runs["constrained"]],
        "output_tokens": {k: [x["total_output_tokens"] for x in v] for k, v in runs.items()},
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(res, f, indent=2)
    for k in ("free", "constrained"):
        print(f"{k:12s} output tok/s {summary(tput[k])}   median TPOT ms {summary(tpot[k])}")
    print(f"constrained / free: throughput {summary(res['throughput_ratio'])}, TPOT {summary(res['tpot_ratio'])}")
    print(f"constrained outputs valid for the schema: {res['schema_valid']}; load average {load} -> "
          f"{res['load_average_after']}")


if __name__ == "__main__":
    main()
