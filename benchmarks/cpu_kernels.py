"""The CPU's C++ kernels (tandem.layers.cpu_ops) against the torch ops, side by side in one
engine: the embedded model (or ``--model``), ``--num-seqs`` sequences, greedy; before each
generation the RMSNorm, RoPE and MLP layers' fused-ops mode, the attention backend's decode
kernel and the one-op decoder layer of plain decode steps (tandem.models.cpu_decode) are
switched between ``cpu`` and ``torch`` (``--ops`` picks which: norms, rotary, attention, silu,
layer), in alternating order, so both run on the same weights, cache and threads.

    python benchmarks/cpu_kernels.py [--rounds 8] [--max-tokens 128] [--num-seqs 1]
        [--ops norms,rotary,attention,silu,layer] [--model PATH]

Prints each mode's generation tok/s (median, spread, every run), the 1-minute load average
before and after, and where the two modes' greedy tokens first differ (fp32 sums in another
order can flip a near-tie).
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
    ap.add_argument("--num-seqs", type=int, default=1)
    ap.add_argument("--ops", default="norms,rotary,attention,silu,layer")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from tandem import LLM, SamplingParams
    from tandem.layers.norm import RMSNorm
    from tandem.layers.rotary import RotaryEmbedding
    from tandem.models.llama import MLP

    llm = LLM(args.model, enable_prefix_caching=False)
    model = llm.engine.client.core.runner.model
    ops = set(args.ops.split(","))
    kinds = (RMSNorm,) * ("norms" in ops) + (RotaryEmbedding,) * ("rotary" in ops) + (MLP,) * ("silu" in ops)
    layers = [m for m in model.modules() if isinstance(m, kinds)]
    backends = {m.backend for m in model.modules() if hasattr(m, "backend")} if "attention" in ops else set()
    fast = model.cpu_decode if "layer" in ops else None
    if any(m.fused_ops_mode != "cpu" for m in layers) or any(not b.cpu_kernels for b in backends) \
            or ("layer" in ops and fast is None):
        raise SystemExit("the engine did not resolve fused-ops mode 'cpu' (the C++ kernels did not build?) "
                         "or the model has no one-op decoder layer")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [f"Write a short story about a robot who learns to paint, number {i}." for i in range(args.num_seqs)]
    llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[float]] = {"cpu": [], "torch": []}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for mode in ("cpu", "torch") if r % 2 == 0 else ("torch", "cpu"):
            for m in layers:
                m.fused_ops_mode = mode
            for b in backends:
                b.cpu_kernels = mode == "cpu"
            if fast is not None:
                model.cpu_decode = fast if mode == "cpu" else None
            start = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            runs[mode].append(args.num_seqs * args.max_tokens / (time.perf_counter() - start))
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
