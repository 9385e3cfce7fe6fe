"""Offline throughput benchmark (``tandem bench throughput``), as vLLM's benchmark_throughput."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from tandem.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    num_prompts: int
    input_len: int
    output_len: int
    elapsed_s: float
    requests_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    num_preemptions: int


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, avoiding the first 1000 ids (special tokens in most vocabularies)."""
    g = torch.Generator().manual_seed(seed)
    low = min(1000, vocab_size // 2)
    return torch.randint(low, vocab_size, (num_prompts, input_len), generator=g).tolist()


def run_throughput(llm, num_prompts: int, input_len: int, output_len: int, ignore_eos: bool = True,
                   seed: int = 0) -> ThroughputResult:
    """Generate ``num_prompts`` random prompts of ``input_len`` tokens, greedy, ``output_len`` new tokens each."""
    prompts = random_prompts(num_prompts, input_len, llm.engine.vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
    # Warm-up outside the timed region (first-call allocations, kernel selection).
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    pre = llm.engine.scheduler.num_preemptions
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n_in = num_prompts * input_len
    return ThroughputResult(num_prompts, input_len, output_len, elapsed, num_prompts / elapsed, n_in / elapsed,
                            n_out / elapsed, (n_in + n_out) / elapsed, llm.engine.scheduler.num_preemptions - pre)


def main(args: argparse.Namespace) -> None:
    from tandem.entrypoints.cli import engine_config_from_args
    from tandem.entrypoints.llm import LLM

    cfg = engine_config_from_args(args)
    llm = LLM(**vars(cfg))
    res = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, args.ignore_eos, args.seed)
    print(f"Throughput: {res.requests_per_s:.2f} requests/s, {res.total_tokens_per_s:.1f} total tokens/s, "
          f"{res.input_tokens_per_s:.1f} input tokens/s, {res.output_tokens_per_s:.1f} output tokens/s "
          f"({res.num_prompts} prompts, {res.elapsed_s:.2f} s, {res.num_preemptions} preemptions)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(res) | {"async_output_proc": cfg.async_output_proc, "model": cfg.model}, f, indent=2)
    llm.engine.shutdown()
