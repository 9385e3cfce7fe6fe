"""Where a step's GPU time goes: torch profiler over steady-state decode steps of a
dummy-weight model (default: Llama-3.1-8B shape, bf16, batch 256, context ~128-192), or with
``--phase prefill`` over the first steps of a fresh batch (prefill chunks of up to
``max_num_batched_tokens`` tokens), after one batch has warmed everything up; each profiled
step's wall time (synchronized) is printed too.

    python benchmarks/profile_decode.py --config-dir DIR --tokenizer DIR [--batch 256] [--warmup-steps 20] [--phase decode|prefill] [--engine-arg KEY=VALUE ...]

``--engine-arg`` passes an engine option (value parsed as JSON when it parses, else a
string), e.g. ``--engine-arg all2all_backend=simulated --engine-arg simulated_ep_rank_experts=true``.
FP8 with the activation quantization fused into the norm / SiLU-and-mul kernels (the
default) or as separate kernels: ``--engine-arg quantization=fp8``, the second run with
``TANDEM_FP8_FUSED_QUANT=off`` in the environment.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--engine-arg wants KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=20, help="steps before the profiled ones (a large batch's prefill chunks must be done)")
    ap.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--engine-arg", type=engine_arg, action="append", default=[])
    args = ap.parse_args()

    from tandem import LLM, SamplingParams
    from tandem.benchmarks.throughput import random_prompts

    llm = LLM(model=args.config_dir, tokenizer=args.tokenizer, load_format="dummy", dtype="bfloat16",
              max_model_len=2048, max_num_seqs=args.batch, **dict(args.engine_arg))
    eng = llm.engine

    def add_batch(seed: int) -> list[str]:
        ids = [f"{seed}-{i}" for i in range(args.batch)]
        for rid, p in zip(ids, random_prompts(args.batch, 128, eng.vocab_size, seed)):
            eng.add_request(rid, p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        return ids

    def drain(ids: list[str]) -> None:
        eng.abort_request(ids)
        while eng.has_unfinished_requests():
            eng.step()

    ids = add_batch(0)
    for _ in range(args.warmup_steps):  # prefills done, decode steady state
        eng.step()
    if args.phase == "prefill":
        drain(ids)
        ids = add_batch(1)
    torch.cuda.synchronize()
    step_ms = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
    print("step wall ms (synchronized, under the profiler):", " ".join(f"{t:.1f}" for t in step_ms))
    drain(ids)


if __name__ == "__main__":
    main()
