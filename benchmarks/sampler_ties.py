"""Cost of the sampler's tie rule (``deterministic_rows``) beside a whole ``sample`` call.

Random-sampling rows (temperature 0.8, top_p 0.95, top_k 50) of ``[N, V]`` fp32 logits;
``sample`` includes ``deterministic_rows``, which is also timed alone on the same inputs.
The two are alternated, ``--repeats`` rounds of ``--iters`` calls each, and the medians
and spreads (min-max over rounds) printed.

    python benchmarks/sampler_ties.py --device cpu --vocab 49152
    python benchmarks/sampler_ties.py --device cuda --vocab 151936 --rows 1 32 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.worker.sampler import SamplingBatch, deterministic_rows, sample


def batch(n: int, vocab: int, device: torch.device) -> SamplingBatch:
    f = lambda v: torch.full((n,), v, dtype=torch.float32, device=device)  # noqa: E731
    return SamplingBatch(temperature=f(0.8), top_k=torch.full((n,), 50, device=device), top_p=f(0.95), min_p=f(0.0),
                         all_greedy=False, all_random=True, greedy_mask=None, need_top_k=True, need_top_p=True,
                         need_min_p=False, penalty_rows=None, penalty_slots=None, presence=None, frequency=None,
                         repetition=None, bias=None, seeded=[], max_num_logprobs=-1)


def timed(fn, iters: int, device: torch.device) -> float:
    """Mean ms of ``fn`` over ``iters`` calls (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device(args.device)
    print(f"device={dev} vocab={args.vocab} threads={torch.get_num_threads()}")
    print("rows  sample_ms(median [min-max])  tie_rule_ms(median [min-max])  share")
    for n in args.rows:
        logits = torch.randn(n, args.vocab, device=dev) * 4
        b = batch(n, args.vocab, dev)
        x = logits / 0.8
        s_times, d_times = [], []
        for fn in (lambda: sample(logits, b, None, None), lambda: deterministic_rows(x, x, None)):
            timed(fn, 2, dev)  # warm-up
        for _ in range(args.repeats):
            s_times.append(timed(lambda: sample(logits, b, None, None), args.iters, dev))
            d_times.append(timed(lambda: deterministic_rows(x, x, None), args.iters, dev))
        s, d = statistics.median(s_times), statistics.median(d_times)
        print(f"{n:4d}  {s:8.3f} [{min(s_times):.3f}-{max(s_times):.3f}]        "
              f"{d:8.3f} [{min(d_times):.3f}-{max(d_times):.3f}]        {d / s:6.1%}")


if __name__ == "__main__":
    main()
