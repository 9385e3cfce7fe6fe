"""MLA prefill attention on the GPU: the variable-length flash-attention path against the
masked-SDPA group path it replaced, at the DeepSeek-V2-Lite shape (16 heads, qk_nope 128,
rope 64, v 128, kv_lora_rank 512), bf16, block size 16, shuffled block tables.

Both paths run ``MLAAttention._attend`` on one prefill-only step: gather the context
latents, decompress them with ``kv_b_proj``, attend. The two paths alternate call by call
(the order flips every round) and each figure is the median over the rounds with its
min-max spread (CUDA events). Then the kernel alone (inputs already decompressed) for a
few launch variants, with its causal-attention TFLOP/s (``2 * heads * (qk + v) *``
visible query-key pairs), and the gather + decompress alone.

Cases are ``NxQ`` (N fresh prompts of Q tokens) or ``NxQ@C`` (N chunks of Q tokens on C
cached tokens each)::

    python benchmarks/mla_prefill.py [--cases 128x128,16x128,8x2048,4x2048@2048] [--rounds 20]

``--tiny`` (4 heads, small widths) runs the same code on the CPU, to check the script, not
to time anything: ``TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/mla_prefill.py --tiny``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DeepseekV2Config

from model_shapes import DEEPSEEK_V2_LITE

TINY = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
            v_head_dim=32, q_lora_rank=None)
VARIANTS = [dict(), dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
            dict(block_m=128, block_n=32, num_warps=4, num_stages=2),
            dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
            dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
            dict(block_m=64, block_n=32, num_warps=4, num_stages=3)]


def parse_case(text: str) -> tuple[int, int, int]:
    n, rest = text.split("x")
    q, _, c = rest.partition("@")
    return int(n), int(q), int(c or 0)


def build_step(n: int, q_len: int, cached: int, cfg, dev, dtype, block_size: int = 16):
    """Metadata of a prefill-only step, a cache of random latents, random queries."""
    from tandem.attention.metadata import AttentionMetadata

    seq = q_len + cached
    nb = -(-seq // block_size)
    tables = (1 + torch.randperm(n * nb, device=dev)).view(n, nb).int()
    kv_cache = torch.randn(1, n * nb + 1, block_size, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device=dev).to(dtype)
    qsl = [i * q_len for i in range(n + 1)]
    seq_lens = [seq] * n
    p = torch.arange(cached, seq, device=dev)
    slots = (tables[:, p // block_size].long() * block_size + p % block_size).flatten()
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    meta = AttentionMetadata(t(qsl), t(seq_lens), t([cached] * n), tables, slots, q_len, seq, qsl, seq_lens, 0)
    heads = cfg.num_attention_heads
    q_nope = torch.randn(n * q_len, heads, cfg.qk_nope_head_dim, device=dev).to(dtype)
    q_pe = torch.randn(n * q_len, heads, cfg.qk_rope_head_dim, device=dev).to(dtype)
    return meta, kv_cache, q_nope, q_pe


def timed(fn, dev) -> float:
    """Milliseconds of one call (CUDA events on the GPU)."""
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def summary(ms: list[float]) -> str:
    return f"{statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})"


def bench_case(attn, cfg, case: str, args, dev, dtype) -> tuple[str, list[str]]:
    """The case's row of the path table and its rows of the kernel table."""
    from tandem.attention.triton_prefill_varlen import flash_attn_varlen_func

    n, q_len, cached = parse_case(case)
    meta, kv_cache, q_nope, q_pe = build_step(n, q_len, cached, cfg, dev, dtype)
    pairs = n * (q_len * cached + q_len * (q_len + 1) // 2)
    flops = 2 * attn.num_heads * (attn.qk_dim + attn.v_dim) * pairs
    outs, times = {}, {"torch": [], "triton": []}
    with torch.no_grad():
        for backend in times:  # warm-up (Triton compiles, cuBLAS heuristics)
            attn.prefill_backend = backend
            outs[backend] = attn._attend(q_nope, q_pe, kv_cache, meta)
        err = (outs["triton"].float() - outs["torch"].float()).abs().max().item()
        for r in range(args.rounds):
            order = ["torch", "triton"] if r % 2 == 0 else ["triton", "torch"]
            for backend in order:
                attn.prefill_backend = backend
                times[backend].append(timed(lambda: attn._attend(q_nope, q_pe, kv_cache, meta), dev))
        ratio = [a / b for a, b in zip(times["torch"], times["triton"])]
        row = (f"| {case} | {n * q_len} | {n * (q_len + cached)} | {summary(times['torch'])} | "
               f"{summary(times['triton'])} | {statistics.median(ratio):.1f}x ({min(ratio):.1f}-{max(ratio):.1f}) | "
               f"{err:.3g} |")
        print(row, flush=True)

        latent, _, _ = attn._gather_context(kv_cache, meta, 0, n, dtype)

        def decompress():
            lat, _, _ = attn._gather_context(kv_cache, meta, 0, n, dtype)
            return attn.kv_b_proj(lat[:, : attn.kv_lora_rank])

        dec = [timed(decompress, dev) for _ in range(args.rounds)]
        c_kv, k_pe = latent.split([attn.kv_lora_rank, attn.rope], dim=-1)
        kv = attn.kv_b_proj(c_kv).view(latent.shape[0], attn.num_heads, attn.nope + attn.v_dim)
        k_nope, v = kv.split([attn.nope, attn.v_dim], dim=-1)
        cu_k = torch.tensor([i * (q_len + cached) for i in range(n + 1)], dtype=torch.int32, device=dev)
        out = torch.empty(n * q_len, attn.num_heads, attn.v_dim, dtype=dtype, device=dev)
        kernel_rows = []
        for variant in VARIANTS[: 1 if args.tiny else None]:
            def kernel():
                flash_attn_varlen_func(q_nope, k_nope, v, meta.query_start_loc, cu_k, q_len, attn.scale, q_rope=q_pe,
                                       k_rope=k_pe[:, None], out=out, **variant)

            kernel()
            ms = [timed(kernel, dev) for _ in range(args.rounds)]
            name = ", ".join(f"{k}={x}" for k, x in variant.items()) or "default"
            tflops = flops / statistics.median(ms) / 1e9
            kernel_rows.append(f"| {case} | {name} | {summary(ms)} | {tflops:.0f} | {summary(dec)} |")
    return row, kernel_rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="128x128,16x128,8x2048,4x2048@2048")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="small widths on the CPU (TRITON_INTERPRET=1): a smoke run")
    args = ap.parse_args()
    from tandem.layers.mla import MLAAttention
    from tandem.layers.rotary import RotaryEmbedding

    dev = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:  # the interpreter needs the test suite's NumPy >= 2.4 fix (repo root on PYTHONPATH)
        from tests.triton_interpreter import patch_interpreter_for_numpy_2_4

        patch_interpreter_for_numpy_2_4()
    dtype = torch.bfloat16
    shape = {**DEEPSEEK_V2_LITE, **TINY} if args.tiny else DEEPSEEK_V2_LITE
    cfg = DeepseekV2Config(**{k: v for k, v in shape.items() if k != "architectures"})
    torch.manual_seed(0)
    attn = MLAAttention(cfg, RotaryEmbedding(cfg, cfg.qk_rope_head_dim, 8192))
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    attn = attn.to(dev, dtype)
    print(f"MLA prefill, {cfg.num_attention_heads} heads, nope {cfg.qk_nope_head_dim}, rope {cfg.qk_rope_head_dim}, "
          f"v {cfg.v_head_dim}, kv_lora_rank {cfg.kv_lora_rank}, {dtype}, {args.rounds} rounds; ms median (min-max)")
    print("| case | queries | keys | masked-SDPA groups ms | flash-attention path ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    kernel_rows = []
    for case in args.cases.split(","):
        kernel_rows += bench_case(attn, cfg, case, args, dev, dtype)[1]
    print("\nThe kernel alone (inputs decompressed), and the gather + decompress of the same step:")
    print("| case | launch | kernel ms | causal-attention TFLOP/s | gather + decompress ms |")
    print("|---|---|---|---|---|")
    print("\n".join(kernel_rows))


if __name__ == "__main__":
    main()
