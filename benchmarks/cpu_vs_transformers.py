"""Tandem vs transformers ``generate`` on the CPU, side by side in one process.

Workload per batch size ``N`` (``--num-prompts``, default 1, 16 and 64): ``N`` random
prompts of ``--input-len`` tokens, greedy, exactly ``--output-len`` new tokens each (EOS
ignored). Both engines hold the same weights: for a GGUF file transformers loads Tandem's
converted cache folder (the dequantized tensors Tandem loads, see
``tandem.model_loader.gguf_cache``); for a HF folder both load the folder. transformers
runs all ``N`` prompts in one ``generate`` call (equal lengths: no padding) with its
default dynamic KV cache and SDPA attention; Tandem runs them through ``LLM.generate``.

Pairings (``--pairings``): ``default`` runs each engine at its own default dtype (Tandem's
``dtype="auto"``, transformers' ``from_pretrained`` without a dtype: fp32 for a GGUF file,
as ``from_pretrained(..., gguf_file=...)`` gives); ``bfloat16`` / ``float32`` run both at
that dtype (what the engine itself adds, at equal arithmetic).

Method (so that the ratio holds on a shared machine): per pairing both engines are loaded
and warmed up first (one untimed run of each batch size), then the timed runs alternate
``tandem, transformers, tandem, transformers, ...`` (``--repeats`` of each per batch size),
each repetition on fresh prompts (no prefix-cache hits) that both engines get. Reported:
per engine the median and the spread (min-max) of output tokens/s, the ratio of medians,
the median of the per-pair ratios, and the 1-minute load average around the runs. For
one prompt the figure is milliseconds per output token (end to end, prefill included).
Both engines use ``--threads`` torch threads (Tandem's step thread included).

    python benchmarks/cpu_vs_transformers.py [--model PATH] [--num-prompts 1 16 64] [--repeats 3] \\
        [--pairings default bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch


def load_transformers(model: str, dtype: torch.dtype | None):
    """transformers' model of the same weights Tandem loads, in ``dtype`` (None: its default)."""
    from transformers import AutoModelForCausalLM

    from tandem.model_loader.gguf_cache import checkpoint_folder
    from tandem.model_loader.loader import is_gguf

    folder = model
    if is_gguf(model):
        folder = checkpoint_folder(model)
        if folder is None:
            raise SystemExit(f"cannot write the converted weights of {model} into the GGUF cache")
    kwargs = {} if dtype is None else {"dtype": dtype}
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", **kwargs).eval()
    ref.generation_config.eos_token_id = None  # like ignore_eos
    ref.generation_config.pad_token_id = 0
    return ref


def run_tandem(llm, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    from tandem import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    gc.collect()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def run_transformers(ref, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    gc.collect()
    with torch.inference_mode():
        start = time.perf_counter()
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False)
        elapsed = time.perf_counter() - start
    return elapsed, out[:, ids.shape[1]:].tolist()


def summarize(name: str, values: list[float], unit: str) -> str:
    med = statistics.median(values)
    runs = ", ".join(f"{v:.1f}" for v in values)
    return f"  {name:<13}: median {med:8.2f} {unit} (spread {min(values):.2f}-{max(values):.2f}; runs {runs})"


def run_pairing(pairing: str, model: str, args) -> list[str]:
    """Load both engines for ``pairing``, time every batch size; returns summary lines."""
    from tandem import LLM
    from tandem.benchmarks.throughput import random_prompts

    t0 = time.perf_counter()
    llm = LLM(model=model, max_num_seqs=max(256, max(args.num_prompts)),
              dtype="auto" if pairing == "default" else pairing)
    t1 = time.perf_counter()
    ref = load_transformers(model, None if pairing == "default" else getattr(torch, pairing))
    t2 = time.perf_counter()
    vocab = llm.engine.vocab_size
    dtypes = f"tandem torch.{llm.engine.resolved.dtype}, transformers {ref.dtype}"
    print(f"\n=== pairing {pairing}: {dtypes}; load: tandem {t1 - t0:.1f} s, transformers {t2 - t1:.1f} s")
    summary = []
    for n in args.num_prompts:
        warm = random_prompts(n, args.input_len, vocab, seed=10_000 + n)
        run_tandem(llm, warm, min(args.output_len, 8))
        run_transformers(ref, warm, min(args.output_len, 8))
        rates: dict[str, list[float]] = {"tandem": [], "transformers": []}
        loads, same = [], 0
        for rep in range(args.repeats):
            prompts = random_prompts(n, args.input_len, vocab, seed=1000 * n + rep)
            loads.append(os.getloadavg()[0])
            t_el, t_tok = run_tandem(llm, prompts, args.output_len)
            h_el, h_tok = run_transformers(ref, prompts, args.output_len)
            loads.append(os.getloadavg()[0])
            same += sum(a == b for a, b in zip(t_tok, h_tok))
            rates["tandem"].append(sum(map(len, t_tok)) / t_el)
            rates["transformers"].append(sum(map(len, h_tok)) / h_el)
        pair = [a / b for a, b in zip(rates["tandem"], rates["transformers"])]
        ratio = statistics.median(rates["tandem"]) / statistics.median(rates["transformers"])
        print(f"\n{n} prompt(s): load average (1 min) {min(loads):.2f}-{max(loads):.2f}; "
              f"greedy outputs identical for {same}/{n * args.repeats} prompts")
        for name, vals in rates.items():
            if n == 1:
                print(summarize(name, [1000.0 / v for v in vals], "ms/output token"))
            else:
                print(summarize(name, vals, "output tok/s"))
        print(f"  ratio tandem/transformers (output tok/s): {ratio:.2f}x of medians; per-pair median "
              f"{statistics.median(pair):.2f}x (spread {min(pair):.2f}-{max(pair):.2f})")
        summary.append(f"{pairing:>9} ({dtypes}) {n:>3} prompt(s): {ratio:.2f}x (pairs {min(pair):.2f}-{max(pair):.2f}), "
                       f"load {min(loads):.2f}-{max(loads):.2f}")
    llm.engine.shutdown()
    del llm, ref
    gc.collect()
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each engine per batch size (>= 3)")
    ap.add_argument("--pairings", nargs="+", default=["default", "bfloat16"],
                    choices=["default", "bfloat16", "float32"],
                    help="default: each engine at its default dtype; a dtype: both at it")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads of both engines")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    torch.set_num_threads(args.threads)

    from tandem.config import embedded_default_model

    model = args.model or embedded_default_model()
    print(f"model {model}\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
          f"workload: input {args.input_len}, output {args.output_len}, greedy, EOS ignored; "
          f"{args.repeats} alternated runs of each engine per batch size")
    summary = [line for pairing in args.pairings for line in run_pairing(pairing, model, args)]
    print("\nsummary (ratio of median output tok/s, tandem / transformers):")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
