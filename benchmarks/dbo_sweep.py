"""Dual-batch overlap on one GPU with the ``simulated`` all-to-all (issue 7).

DeepSeek-V2-Lite shape (27 layers, 64 routed experts top-6 + 2 shared, MLA), bf16, dummy
weights, decode steps of ``--batches`` sequences with ``--context`` cached tokens each, run
as CUDA graphs. For each batch size the compute time is the step time with a free link;
then the link bandwidth is set so that the modeled communication of a step (dispatch +
combine of every MoE layer) is ``ratio`` x compute, for each of ``--ratios``, and the step
is timed with DBO off (one batch) and on (two interleaved ubatches), beside
max(compute, comm), the best overlap can give. "compute split" is the step time of the two
ubatches with a free link: what splitting itself costs (each ubatch reads the expert weights
again, which dominates while the expert GEMMs are bound by weight reads), so
on / max(compute split, comm) is the overlap the interleaving achieves.

"floor" is a lower bound for any schedule of two ubatches: each ubatch is a chain (compute,
dispatch, expert compute, combine, next layer, ...) that runs in order, so the step takes
at least the compute of one ubatch alone, T(b/2) (measured: the unsplit step of b/2
sequences), plus that ubatch's exchanges, comm(b/2). Where T(b/2) is much more than half
of T(b) (latency-bound steps), the floor is well above max(compute, comm).

"policy" is what the engine runs by default with ``--enable-dbo``: the graph capture times
both variants of the size (``DBOPolicy(measure_split=True)``) and keeps the faster; its
column is the kept graph's step time and which one it kept.

``--rank-experts`` makes the simulated GPU compute like one rank of an EP=8 group
(``SimulatedAll2All(rank_experts=True)``: 8 experts per layer, every routed pair on them)
instead of holding all 64 experts: per expert, 8x the rows for the same weight read, as on a
rank of a real DP+EP deployment.

    python benchmarks/dbo_sweep.py --out DIR [--batches 64,128,256,512] [--ratios 0.25,0.5,1,1.5,2] [--rank-experts]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch

from model_shapes import DEEPSEEK_V2_LITE


def build(cfg_dict: dict, device: torch.device, link, rank_experts: bool = False):
    from transformers import AutoConfig

    from tandem.attention.selector import get_attention_backend
    from tandem.distributed.all2all import SimulatedAll2All
    from tandem.model_loader.loader import build_model

    d = dict(cfg_dict)
    d.pop("architectures", None)
    hf = AutoConfig.for_model(d.pop("model_type"), **d)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(hf, "", "dummy", get_attention_backend(device, 4096), dtype, device, max_positions=4096,
                        all2all=lambda e: SimulatedAll2All(e, link=link, record=False,
                                                                       rank_experts=rank_experts))
    return model, dtype


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,128,256,512")
    ap.add_argument("--ratios", default="0.25,0.5,1,1.5,2")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (dry run)")
    ap.add_argument("--rank-experts", action="store_true", help="compute one EP=8 rank's share of the experts")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from tandem.distributed.all2all import LinkModel
    from tandem.worker.cuda_graph import DecodeCUDAGraphs
    from tandem.worker.step_plan import DBOPolicy

    device = torch.device("cuda")
    cfg = dict(DEEPSEEK_V2_LITE)
    if args.tiny:
        cfg.update(num_hidden_layers=2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                   n_routed_experts=8, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, vocab_size=1000)
    link = LinkModel(bandwidth_gbps=1e9, latency_us=0.0, ep_size=8)
    model, dtype = build(cfg, device, link, args.rank_experts)
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 2:
        raise SystemExit("--batches: a split needs at least 2 sequences")
    ratios = [float(r) for r in args.ratios.split(",")]
    bs = 16
    blocks_per_seq = math.ceil((args.context + 1) / bs)
    num_blocks = max(batches) * blocks_per_seq + 1
    planes = getattr(model, "kv_cache_num_planes", 2)
    heads, dim = model.kv_cache_shape_per_block
    kv = [torch.zeros(planes, num_blocks, bs, heads, dim, dtype=dtype, device=device) for _ in range(len(model.layers))]
    from tandem.layers.moe import SparseMoeBlock

    num_moe = sum(1 for m in model.modules() if isinstance(m, SparseMoeBlock))
    top_k, hidden = cfg["num_experts_per_tok"], cfg["hidden_size"]
    elem = torch.finfo(dtype).bits // 8

    def step_time(b: int, split: bool, measure: bool = False) -> tuple[float, bool]:
        """Median step time (ms) of the graph for ``b`` sequences, and whether it is split.
        ``measure``: the engine's default policy picks split or plain by timing both."""
        dbo = DBOPolicy(decode_token_threshold=2, measure_split=measure) if split or measure else None
        g = DecodeCUDAGraphs(model, kv, b, blocks_per_seq, bs, device, dbo=dbo, sizes=[b])
        g.capture()
        table = (1 + np.arange(b)[:, None] * blocks_per_seq + np.arange(blocks_per_seq)[None, :]).astype(np.int32)
        pos = np.full(b, args.context, dtype=np.int64)
        slots = table[np.arange(b), pos // bs].astype(np.int64) * bs + pos % bs
        table_t = torch.from_numpy(table).to(device)
        ids = torch.randint(0, cfg["vocab_size"], (b,), device=device)
        times = []
        for i in range(args.iters + 3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.run(b, ids, pos, slots, pos + 1, pos, table_t, b)
            e.record()
            e.synchronize()
            if i >= 3:
                times.append(s.elapsed_time(e))
        kept_split = b in g.split_sizes
        del g
        torch.cuda.synchronize()
        return float(np.median(times)), kept_split

    rows = []

    def report() -> None:
        with open(os.path.join(args.out, "dbo_sweep.json"), "w") as f:
            json.dump(dict(config=cfg, context=args.context, latency_us=args.latency_us, rank_experts=args.rank_experts,
                           rows=rows), f, indent=2)
        plot(rows, os.path.join(args.out, "dbo_sweep.png"))

    for b in batches:
        link.bandwidth_gbps, link.latency_us = 1e9, 0.0
        compute, compute_split = step_time(b, False)[0], step_time(b, True)[0]
        compute_half = step_time(-(-b // 2), False)[0]  # the larger ubatch
        for r in ratios:
            exchange_bytes = link.bytes(b, top_k, hidden, elem)
            comm_target = r * compute * 1e-3
            latency_total = 2 * num_moe * args.latency_us * 1e-6
            link.latency_us = args.latency_us
            link.bandwidth_gbps = 2 * num_moe * exchange_bytes / max(comm_target - latency_total, 1e-9) / 1e9
            comm = 2 * num_moe * link.seconds(b, top_k, hidden, elem) * 1e3
            comm_half = 2 * num_moe * link.seconds(-(-b // 2), top_k, hidden, elem) * 1e3
            off, on = step_time(b, False)[0], step_time(b, True)[0]
            policy, policy_split = step_time(b, False, measure=True)
            row = dict(batch=b, ratio=r, compute_ms=compute, compute_split_ms=compute_split, comm_ms=comm,
                       link_gbps=link.bandwidth_gbps, dbo_off_ms=off, dbo_on_ms=on, bound_ms=max(compute, comm),
                       policy_ms=policy, policy_split=policy_split, compute_half_ms=compute_half,
                       two_ubatch_floor_ms=compute_half + comm_half)
            row["on_over_bound"] = on / row["bound_ms"]
            row["on_over_split_bound"] = on / max(compute_split, comm)
            row["on_over_off"] = on / off
            row["policy_over_off"] = policy / off
            row["floor_over_bound"] = row["two_ubatch_floor_ms"] / row["bound_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        report()
    print("\n| batch | comm/compute | link GB/s | compute ms | compute split ms | comm ms | DBO off ms | DBO on ms "
          "| max(compute, comm) ms | on / max | on / max(compute split, comm) | on / off | policy ms (kept) "
          "| policy / off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['ratio']:.2f} | {r['link_gbps']:.2f} | {r['compute_ms']:.2f} | "
              f"{r['compute_split_ms']:.2f} | {r['comm_ms']:.2f} | {r['dbo_off_ms']:.2f} | {r['dbo_on_ms']:.2f} | "
              f"{r['bound_ms']:.2f} | {r['on_over_bound']:.2f} | {r['on_over_split_bound']:.2f} | "
              f"{r['on_over_off']:.2f} | {r['policy_ms']:.2f} ({'split' if r['policy_split'] else 'plain'}) | "
              f"{r['policy_over_off']:.2f} |")
    print("\nLower bound of any two-ubatch overlap: each ubatch's chain of compute and exchanges runs in "
          "order, so a step takes at least one ubatch's compute alone, T(b/2), plus its exchanges:\n")
    print("| batch | comm/compute | T(b) ms | T(b/2) ms | comm(b/2) ms | floor ms | floor / max(compute, comm) "
          "| DBO on / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl = r["two_ubatch_floor_ms"]
        print(f"| {r['batch']} | {r['ratio']:.2f} | {r['compute_ms']:.2f} | {r['compute_half_ms']:.2f} | "
              f"{fl - r['compute_half_ms']:.2f} | {fl:.2f} | {r['floor_over_bound']:.2f} | {r['dbo_on_ms'] / fl:.2f} |")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        print(f"no plot: {e}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5), sharey=False)
    for ax, b in zip(np.atleast_1d(axes), batches):
        rs = [r for r in rows if r["batch"] == b]
        x = [r["ratio"] for r in rs]
        ax.plot(x, [r["dbo_off_ms"] for r in rs], "o-", label="DBO off")
        ax.plot(x, [r["dbo_on_ms"] for r in rs], "s-", label="DBO on")
        ax.plot(x, [r["two_ubatch_floor_ms"] for r in rs], "r-.", label="two-ubatch floor")
        ax.plot(x, [r["bound_ms"] for r in rs], "k--", label="max(compute, comm)")
        ax.plot(x, [max(r["compute_split_ms"], r["comm_ms"]) for r in rs], "k:", label="max(compute split, comm)")
        ax.set_title(f"decode batch {b}")
        ax.set_xlabel("comm / compute")
        ax.set_ylabel("step time (ms)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
