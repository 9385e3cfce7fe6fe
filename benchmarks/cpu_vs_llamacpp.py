"""Tandem vs llama.cpp on the CPU, on the same GGUF file and thread count.

Workload per sequence count ``N`` (``--num-seqs``, default 1, 16 and 64): ``N`` prompts of
``--input-len`` tokens, ``--output-len`` generated tokens each, greedy, EOS ignored.

* llama.cpp (the build in ``--llamacpp``, run through its ``run.sh``): ``llama-bench -p
  INPUT -n OUTPUT -r 1`` for one sequence (its ``pp`` and ``tg`` tests), ``llama-batched-bench
  -npp INPUT -ntg OUTPUT -npl N`` for more (``speed_pp``, ``speed_tg`` of its jsonl line);
  each run a fresh process (the model load is not timed).
* Tandem: one ``LLM`` (``--quantization``, default: the engine's default for a GGUF on the
  CPU), loaded once and warmed up per ``N``; each run ``LLM.generate`` of ``N`` fresh
  random prompts. Prompt tok/s: prompt tokens over arrival to the last first token;
  generation tok/s: tokens after each first over the last first token to the last finish
  (as ``tandem generate``'s speed line).

Runs alternate llama.cpp, Tandem, llama.cpp, Tandem... (``--rounds`` of each per ``N``); per
engine the median and spread (min-max) are printed with the 1-minute load average around
the runs, and the ratio of medians. Both use ``--threads`` threads.

    python benchmarks/cpu_vs_llamacpp.py [--model GGUF] [--num-seqs 1 16 64] [--rounds 3] \\
        [--input-len 128] [--output-len 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

DEFAULT_LLAMACPP = "/work/shared/llamacpp"


def llamacpp_run(args, n: int) -> tuple[float, float]:
    """(prompt tok/s, generation tok/s) of one llama.cpp run of ``n`` sequences."""
    run = os.path.join(args.llamacpp, "run.sh")
    if n == 1:
        cmd = [run, "llama-bench", "-m", args.model, "-t", str(args.threads), "-p", str(args.input_len),
               "-n", str(args.output_len), "-r", "1", "-o", "json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows = json.loads(out)
        pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
        tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
        return float(pp), float(tg)
    ctx = n * (args.input_len + args.output_len) + 16
    cmd = [run, "llama-batched-bench", "-m", args.model, "-t", str(args.threads), "-npp", str(args.input_len),
           "-ntg", str(args.output_len), "-npl", str(n), "-c", str(ctx), "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return float(row["speed_pp"]), float(row["speed_tg"])


def tandem_run(llm, n: int, args, seed: int) -> tuple[float, float]:
    """(prompt tok/s, generation tok/s) of one ``LLM.generate`` of ``n`` fresh prompts."""
    from tandem import SamplingParams
    from tandem.benchmarks.throughput import random_prompts

    prompts = random_prompts(n, args.input_len, llm.engine.vocab_size, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    arrival = min(o.metrics["arrival_time"] for o in outs)
    first = max(o.metrics["first_token_time"] for o in outs)
    end = max(o.metrics["finished_time"] for o in outs)
    n_gen = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return n * args.input_len / (first - arrival), n_gen / (end - first)


def spread(values: list[float]) -> str:
    return (f"median {statistics.median(values):8.1f} (spread {min(values):.1f}-{max(values):.1f}; runs "
            + ", ".join(f"{v:.1f}" for v in values) + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--llamacpp", default=DEFAULT_LLAMACPP, help="folder of the llama.cpp build (with run.sh)")
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="alternated runs of each engine per sequence count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="Tandem's --quantization (default: the engine's)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    import tandem  # noqa: F401 - before torch: its OpenMP settings (tandem.envs) apply as in `tandem generate`
    import torch

    torch.set_num_threads(args.threads)
    from tandem import LLM
    from tandem.config import embedded_default_model

    args.model = args.model or embedded_default_model()
    t0 = time.perf_counter()
    llm = LLM(model=args.model, quantization=args.quantization, max_num_seqs=max(256, max(args.num_seqs)),
              max_model_len=args.input_len + args.output_len + 16)
    mode = llm.engine.resolved.weights_mode
    print(f"model {args.model}\ntandem weights {mode}, load {time.perf_counter() - t0:.1f} s; torch "
          f"{torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs; llama.cpp {args.llamacpp}; "
          f"input {args.input_len}, output {args.output_len}, greedy; {args.rounds} alternated rounds")
    summary = []
    for n in args.num_seqs:
        tandem_run(llm, n, argparse.Namespace(input_len=args.input_len, output_len=4), seed=99 + n)  # warm-up
        res = {"llama.cpp": ([], []), "tandem": ([], [])}
        loads = []
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in ("llama.cpp", "tandem"):
                pp, tg = llamacpp_run(args, n) if name == "llama.cpp" else tandem_run(llm, n, args, 1000 * n + r)
                res[name][0].append(pp)
                res[name][1].append(tg)
            loads.append(os.getloadavg()[0])
        print(f"\n{n} sequence(s): load average (1 min) {min(loads):.2f}-{max(loads):.2f}")
        for name, (pp, tg) in res.items():
            print(f"  {name:<9} prompt tok/s {spread(pp)}\n  {'':<9} gen    tok/s {spread(tg)}")
        ratios = [statistics.median(res["tandem"][i]) / statistics.median(res["llama.cpp"][i]) for i in (0, 1)]
        line = (f"{n:>3} seqs: tandem/llama.cpp prompt {ratios[0]:.2f}x, generation {ratios[1]:.2f}x "
                f"(load {min(loads):.2f}-{max(loads):.2f})")
        print("  " + line)
        summary.append(line)
    llm.engine.shutdown()
    print("\nsummary (ratio of medians):\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
