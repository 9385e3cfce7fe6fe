"""Tandem vs transformers ``generate`` on the same workload, side by side in one process.

Workload: random prompts of ``--input-len`` tokens, greedy, exactly ``--output-len`` new
tokens each (EOS ignored). Transformers runs the prompts as static batches of
``--hf-batch-size`` (equal-length prompts, so no padding), with its default (dynamic) KV
cache and SDPA attention. Prints both throughputs and their ratio.

    python benchmarks/cpu_vs_transformers.py [--model PATH] [--num-prompts 32] [--input-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tandem import LLM
    from tandem.benchmarks.throughput import run_throughput, random_prompts
    from tandem.config import embedded_default_model
    from tandem.model_loader.loader import is_gguf

    model = args.model or embedded_default_model()
    llm = LLM(model=model)
    res = run_throughput(llm, args.num_prompts, args.input_len, args.output_len)
    llm.engine.shutdown()
    del llm

    if is_gguf(model):
        ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model))
    else:
        ref = AutoModelForCausalLM.from_pretrained(model)
    ref = ref.eval()
    ref.generation_config.eos_token_id = None  # like ignore_eos
    prompts = torch.tensor(random_prompts(args.num_prompts, args.input_len, ref.config.vocab_size, seed=0))
    with torch.no_grad():
        ref.generate(prompts[:1], max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        n_out = 0
        for i in range(0, args.num_prompts, args.hf_batch_size):
            batch = prompts[i : i + args.hf_batch_size]
            out = ref.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.output_len,
                               do_sample=False, pad_token_id=0)
            n_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        hf_elapsed = time.perf_counter() - start
    hf_out_tps = n_out / hf_elapsed
    print(f"workload: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, greedy, "
          f"torch threads {torch.get_num_threads()}")
    print(f"tandem       : {res.requests_per_s:.3f} req/s, {res.output_tokens_per_s:.1f} output tok/s ({res.elapsed_s:.1f} s)")
    print(f"transformers : {args.num_prompts / hf_elapsed:.3f} req/s, {hf_out_tps:.1f} output tok/s ({hf_elapsed:.1f} s, "
          f"batch {args.hf_batch_size})")
    print(f"ratio tandem/transformers (output tok/s): {res.output_tokens_per_s / hf_out_tps:.2f}x")


if __name__ == "__main__":
    main()
