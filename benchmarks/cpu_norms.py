"""The C++ RMSNorms of the CPU against the torch ops, side by side in one engine: the
embedded model (or ``--model``), one sequence, greedy; the RMSNorm layers' fused-ops mode
switched between ``cpu`` and ``torch`` before each generation, in alternating order, so both
run on the same weights, cache and threads.

    python benchmarks/cpu_norms.py [--rounds 8] [--max-tokens 128] [--model PATH]

Prints each mode's generation tok/s (median, spread, every run), the 1-minute load average
before and after, and where the two modes' greedy tokens first differ (fp32 sums of squares
in another order can flip a near-tie).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from tandem import LLM, SamplingParams
    from tandem.layers.norm import RMSNorm

    llm = LLM(args.model, enable_prefix_caching=False)
    norms = [m for m in llm.engine.client.core.runner.model.modules() if isinstance(m, RMSNorm)]
    if norms[0].fused_ops_mode != "cpu":
        raise SystemExit(f"the engine resolved fused-ops mode {norms[0].fused_ops_mode!r}, not 'cpu'")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt = "Write a short story about a robot who learns to paint."
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[float]] = {"cpu": [], "torch": []}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for mode in ("cpu", "torch") if r % 2 == 0 else ("torch", "cpu"):
            for m in norms:
                m.fused_ops_mode = mode
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            runs[mode].append(args.max_tokens / (time.perf_counter() - start))
            tokens[mode] = list(out[0].outputs[0].token_ids)
    llm.engine.shutdown()
    for mode, v in runs.items():
        print(f"{mode:5} median {statistics.median(v):.1f} tok/s ({min(v):.1f}-{max(v):.1f}); runs "
              + " ".join(f"{x:.1f}" for x in v))
    print(f"cpu / torch: {statistics.median(runs['cpu']) / statistics.median(runs['torch']):.2f}x; "
          f"load {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    a, b = tokens["cpu"], tokens["torch"]
    diff = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    print("greedy tokens: " + ("identical" if diff is None else f"first differ at token {diff} of {len(a)}"))


if __name__ == "__main__":
    main()
