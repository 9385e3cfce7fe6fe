"""The seed workload on a DeepSeek-V2-Lite-shaped MoE model (MLA, 64 experts top-6 + 2
shared), bf16, dummy weights, one GPU (issues 6 and 7).

Runs ``tandem bench throughput`` (1000 random prompts, input 128, output 256, greedy, EOS
ignored, CUDA graphs on), each in its own process:
  1. ``local``: all experts on this GPU, no communication;
  2. ``simulated`` all-to-all (a modeled inter-node link on a communication stream, flags
     ``--link-gbps`` / ``--latency-us`` / ``--ep-size``), DBO off;
  3. ``sim_dbo``: the same with ``--enable-dbo`` (the default measured policy: decode graph
     sizes split only where the split replay was faster, steps with prefill tokens only if
     a split step of 2048 tokens was);
  4. ``sim_dbo_always``: ``--enable-dbo --no-dbo-measure-split`` (every step from the
     thresholds up split);
  5. ``sim_dbo_decode``: DBO on decode steps only (no step with prefill tokens is split).
With ``--rank-experts`` the simulated runs compute like one rank of the EP group
(``--simulated-ep-rank-experts``: ``64 / ep-size`` experts per layer, every routed pair on
them), the load a rank of a real DP+EP deployment gets.

    python benchmarks/gpu_deepseek_v2_lite.py --out DIR [--num-prompts 1000] [--runs local,sim,sim_dbo] [--rank-experts]
        [--max-num-seqs 256|default] [--max-num-batched-tokens N] [--mla-prefill auto,torch]

``--mla-prefill auto,torch`` runs each variant with the flash-attention MLA prefill and
again with the masked-SDPA reference (``TANDEM_MLA_PREFILL``), one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from model_shapes import DEEPSEEK_V2_LITE, seed_workload_command, write_config_dir


def run(cfg_dir: str, out: str, name: str, extra: list[str], args, mla_prefill: str = "auto") -> dict:
    path = os.path.join(out, f"{name}.json")
    if args.max_num_batched_tokens:
        extra = [*extra, "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd = seed_workload_command(cfg_dir, path, *extra, num_prompts=args.num_prompts, max_num_seqs=args.max_num_seqs)
    print(f"+ TANDEM_MLA_PREFILL={mla_prefill}", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "TANDEM_MLA_PREFILL": mla_prefill})
    with open(path) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=lambda t: None if t == "default" else int(t), default=256,
                    help="a number, or default (the engine's limits for the GPU)")
    ap.add_argument("--runs", default="local,sim,sim_dbo")
    ap.add_argument("--link-gbps", type=float, default=40.0)
    ap.add_argument("--latency-us", type=float, default=20.0)
    ap.add_argument("--ep-size", type=int, default=8)
    ap.add_argument("--rank-experts", action="store_true", help="simulated runs compute one EP rank's expert share")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="passed on (default: the engine's)")
    ap.add_argument("--mla-prefill", default="auto",
                    help="comma-separated TANDEM_MLA_PREFILL values; each run once per value, one after the "
                         "other (auto,torch: the flash-attention prefill, then the masked-SDPA one)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg_dir = write_config_dir(DEEPSEEK_V2_LITE, os.path.join(args.out, "deepseek_v2_lite"))
    sim = ["--all2all-backend", "simulated", "--simulated-link-gbps", str(args.link_gbps),
           "--simulated-link-latency-us", str(args.latency_us), "--simulated-ep-size", str(args.ep_size)]
    if args.rank_experts:
        sim.append("--simulated-ep-rank-experts")
    variants = {"local": ["--all2all-backend", "local"], "sim": sim, "sim_dbo": [*sim, "--enable-dbo"],
                "sim_dbo_always": [*sim, "--enable-dbo", "--no-dbo-measure-split"],
                "sim_dbo_decode": [*sim, "--enable-dbo", "--dbo-prefill-token-threshold", str(10**9)]}
    res = {}
    modes = args.mla_prefill.split(",")
    for name in args.runs.split(","):
        for mode in modes:
            key = name if len(modes) == 1 else f"{name}_prefill_{mode}"
            res[key] = run(cfg_dir, args.out, key, variants[name], args, mode)
    with open(os.path.join(args.out, "gpu_deepseek_v2_lite.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"\nsimulated link: {args.link_gbps} GB/s, {args.latency_us} us, EP {args.ep_size}"
          f"{', one rank of experts' if args.rank_experts else ''}")
    print("| run | requests/s | output tok/s | GPU idle between steps | median decode step (batch) "
          "| decode-only steps: GPU s (count) | steps with prefill: GPU s (count) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        idle = r.get("gpu_idle_fraction")
        print(f"| {name} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
              f"{'' if idle is None else f'{100 * idle:.2f}%'} | "
              f"{r.get('decode_step_ms_at_max_batch') or 0:.2f} ms ({r.get('max_decode_batch')}) | "
              f"{r.get('decode_steps_s') or 0:.2f} ({r.get('num_decode_steps')}) | "
              f"{r.get('prefill_steps_s') or 0:.2f} ({r.get('num_prefill_steps')}) |")
    for name in args.runs.split(","):
        for mode in modes[1:]:
            a, b = res[f"{name}_prefill_{modes[0]}"], res[f"{name}_prefill_{mode}"]
            print(f"\n{name}: TANDEM_MLA_PREFILL {modes[0]} / {mode}: {a['requests_per_s'] / b['requests_per_s']:.3f}x "
                  f"requests/s; steps with prefill {a.get('prefill_steps_s') or 0:.2f} s vs "
                  f"{b.get('prefill_steps_s') or 0:.2f} s of GPU time")
    for on in ("sim_dbo", "sim_dbo_always", "sim_dbo_decode"):
        if "sim" in res and on in res:
            print(f"\n{on} / sim (DBO on / off): {res[on]['requests_per_s'] / res['sim']['requests_per_s']:.3f}x")


if __name__ == "__main__":
    main()
