"""MLA decode attention on the GPU: Tandem's paged Triton kernel (launch-parameter variants)
against the plain-torch absorbed path it replaced (gather the latents, masked SDPA), at the
DeepSeek-V2-Lite shape (16 heads, kv_lora_rank 512, rope 64), bf16, block size 16.

Prints the time per call and the bandwidth of reading each request's latents once
(``nd * context * 576 * 2`` bytes), against the H200's 4.8 TB/s.

    python benchmarks/mla_decode.py [--batches 64,256,512] [--contexts 512,2048]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

HBM_BYTES_PER_S = 4.8e12


def torch_absorbed(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, rank):
    nd, bs = q_lat.shape[0], kv_cache.shape[2]
    nb = block_tables.shape[1]
    lat = kv_cache[0][block_tables.long()].reshape(nd, nb * bs, -1).unsqueeze(1)
    mask = torch.arange(nb * bs, device=q_lat.device)[None, :] < seq_lens[:, None]
    q = torch.cat((q_lat, q_pe), dim=-1).unsqueeze(2)
    o = F.scaled_dot_product_attention(q, lat, lat[..., :rank], attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--contexts", default="512,2048")
    args = ap.parse_args()
    from tandem.attention.triton_mla import mla_decode_attention

    dev, dt = torch.device("cuda"), torch.bfloat16
    heads, rank, rope, bs = 16, 512, 64, 16
    scale = (128 + 64) ** -0.5
    variants = [dict(), dict(block_n=16), dict(block_n=64, num_warps=8), dict(block_n=32, num_warps=8),
                dict(block_n=32, num_stages=3), dict(block_n=64, num_warps=4, num_stages=1)]
    print("| batch | context | variant | us | GB/s | % of HBM peak | max abs err vs torch |")
    print("|---|---|---|---|---|---|---|")
    for nd in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            nb = ctx // bs
            num_blocks = nd * nb + 1
            kv = torch.randn(1, num_blocks, bs, 1, rank + rope, device=dev, dtype=dt)
            tables = (1 + torch.randperm(nd * nb, device=dev)).view(nd, nb).int()
            seq_lens = torch.full((nd,), ctx, device=dev, dtype=torch.int32)
            q_lat = torch.randn(nd, heads, rank, device=dev, dtype=dt)
            q_pe = torch.randn(nd, heads, rope, device=dev, dtype=dt)
            ref = torch_absorbed(q_lat, q_pe, kv, tables, seq_lens, scale, rank)
            nbytes = nd * ctx * (rank + rope) * 2
            ms = triton.testing.do_bench(lambda: torch_absorbed(q_lat, q_pe, kv, tables, seq_lens, scale, rank))
            print(f"| {nd} | {ctx} | torch gather + SDPA | {ms * 1e3:.1f} | {nbytes / ms / 1e6:.0f} | "
                  f"{100 * nbytes / ms * 1e3 / HBM_BYTES_PER_S:.0f} | |", flush=True)
            for v in variants:
                out = mla_decode_attention(q_lat, q_pe, kv, tables, seq_lens, scale, **v)
                err = (out.float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(lambda: mla_decode_attention(q_lat, q_pe, kv, tables, seq_lens, scale, **v))
                name = "triton " + (", ".join(f"{k}={x}" for k, x in v.items()) or "default")
                print(f"| {nd} | {ctx} | {name} | {ms * 1e3:.1f} | {nbytes / ms / 1e6:.0f} | "
                      f"{100 * nbytes / ms * 1e3 / HBM_BYTES_PER_S:.0f} | {err:.3g} |", flush=True)


if __name__ == "__main__":
    main()
