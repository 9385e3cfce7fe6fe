"""Dense paged decode attention on the GPU at the Llama-3.1-8B shape (32 q heads, 8 kv heads,
head_dim 128, bf16 queries, block size 16), measured as the engine runs it: one
:meth:`tandem.attention.triton_backend.TritonAttentionBackend.forward` per layer (the new
tokens' K/V written into the paged cache, then split-KV decode attention), inside a CUDA
graph, blocks of every request scattered over the pool, enough layers' caches that no call
finds the previous one's K/V in L2.

For each (batch, context, cache dtype) it prints the time per layer of the whole forward and
of the cache write alone (the backend's kernel, and the torch ops it replaced: ``.contiguous()``
of v, then ``write_kv_cache``), against the floor of reading the context's K/V once (plus q, the
new K/V and the output) at 4.8 TB/s; ``--sweep`` adds the decode launch space (block_n x
warps x stages), each point checked against the default launch's output.

Contexts: an integer ``c`` gives every request ``c`` tokens; ``mix`` draws them uniformly
from 128..384 (the seed workload: 128 prompt tokens, up to 256 generated).

    python benchmarks/paged_decode.py --batches 256,1024 --contexts 128,256,384,mix --kv-dtypes bf16,fp8
    python benchmarks/paged_decode.py --batches 256 --contexts mix --kv-dtypes bf16,fp8 --sweep
"""

from __future__ import annotations

import argparse
import itertools

import torch
from mla_decode import context_lens, graph_time_us

HBM_BYTES_PER_S = 4.8e12
L2_BYTES = 50 * 2**20
HQ, HK, D, BLOCK = 32, 8, 128, 16
DEVICE = torch.device("cuda")
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


class Case:
    """Decode inputs for ``nd`` requests: shuffled block tables, one cache per layer."""

    def __init__(self, nd: int, spec: str, kv_dtype: torch.dtype, max_model_len: int, seed: int = 0) -> None:
        from tandem.attention.metadata import AttentionMetadata

        gen = torch.Generator().manual_seed(seed)
        self.nd, self.spec, self.lens = nd, spec, context_lens(spec, nd, gen)
        nbs = [-(-n // BLOCK) for n in self.lens]
        num_blocks = 1 + sum(nbs)
        perm = (1 + torch.randperm(num_blocks - 1, generator=gen)).int()
        tables = torch.zeros(nd, -(-max_model_len // BLOCK), dtype=torch.int32)
        start = 0
        for r, nb in enumerate(nbs):
            tables[r, :nb] = perm[start: start + nb]
            start += nb
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        layer_bytes = 2 * num_blocks * BLOCK * HK * D * elem
        self.caches = [torch.randn(2, num_blocks, BLOCK, HK, D, device=DEVICE).to(kv_dtype)
                       for _ in range(max(2, min(8, -(-4 * L2_BYTES // layer_bytes))))]
        seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=DEVICE)
        bt = tables.to(DEVICE)
        pos = seq_lens.long() - 1
        slots = bt.gather(1, (pos // BLOCK)[:, None])[:, 0].long() * BLOCK + pos % BLOCK
        # max_seq_len: the block-table width, as the engine's capture buffers give it.
        self.meta = AttentionMetadata(torch.arange(nd + 1, dtype=torch.int32, device=DEVICE), seq_lens, seq_lens - 1,
                                      bt, slots, 1, bt.shape[1] * BLOCK, list(range(nd + 1)), self.lens, nd)
        qkv = torch.randn(nd, (HQ + 2 * HK) * D, device=DEVICE, dtype=torch.bfloat16)
        q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
        # Strided views of one qkv_proj output, as the model passes them.
        self.q, self.k, self.v = q.view(nd, HQ, D), k.view(nd, HK, D), v.view(nd, HK, D)
        self.floor_us = (sum(self.lens) * 2 * HK * D * elem + nd * (2 * HQ + 2 * HK) * D * 2) / HBM_BYTES_PER_S * 1e6

    def forward(self, backend, layer: int) -> torch.Tensor:
        return backend.forward(self.q, self.k, self.v, self.caches[layer % len(self.caches)], self.meta, D ** -0.5)

    def write(self, layer: int, kernel: bool) -> None:
        from tandem.attention.backend import write_kv_cache
        from tandem.attention.triton_reshape_and_cache import reshape_and_cache

        cache = self.caches[layer % len(self.caches)]
        if kernel:
            reshape_and_cache(self.k, self.v, cache, self.meta.slot_mapping)
        else:
            write_kv_cache(self.k, self.v.contiguous(), cache, self.meta.slot_mapping)


def backend_for(max_model_len: int, block_n: int = 64, warps: int | None = None, stages: int | None = None):
    from tandem.attention.triton_backend import TritonAttentionBackend

    b = TritonAttentionBackend(max_model_len=max_model_len, block_n=block_n)
    b.decode_num_warps, b.decode_num_stages = warps, stages
    return b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="256,1024")
    p.add_argument("--contexts", default="128,256,384,mix")
    p.add_argument("--kv-dtypes", default="bf16,fp8")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--sweep", action="store_true", help="also time the decode launch space")
    args = p.parse_args()
    print("| batch | context | kv cache | launch | forward us / layer | write us, kernel / torch ops | floor us | "
          "x floor | KV GB/s | max abs diff vs default |\n|---|---|---|---|---|---|---|---|---|---|")
    points = [dict(block_n=64)]
    if args.sweep:
        points += [dict(block_n=bn, warps=w, stages=s)
                   for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
    with torch.inference_mode():
        for nd, spec, kvd in itertools.product(map(int, args.batches.split(",")), args.contexts.split(","),
                                               args.kv_dtypes.split(",")):
            case = Case(nd, spec, KV_DTYPES[kvd], args.max_model_len)
            calls = 2 * len(case.caches)
            write_us = graph_time_us(lambda i: case.write(i, True), calls)
            torch_write_us = graph_time_us(lambda i: case.write(i, False), calls)
            ref = None
            for point in points:
                backend = backend_for(args.max_model_len, **point)
                try:
                    us = graph_time_us(lambda i: case.forward(backend, i), calls)
                except Exception as e:  # a launch the GPU cannot run (e.g. shared memory)
                    print(f"| {nd} | {spec} | {kvd} | {point} | failed: {type(e).__name__} | | | | | |")
                    continue
                out = case.forward(backend, 0).float()
                ref = out if ref is None else ref
                kv_gbs = sum(case.lens) * 2 * HK * D * case.caches[0].element_size() / us / 1e3
                print(f"| {nd} | {spec} | {kvd} | {point} | {us:.1f} | {write_us:.1f} / {torch_write_us:.1f} | "
                      f"{case.floor_us:.1f} | "
                      f"{us / case.floor_us:.2f} | {kv_gbs:.0f} | {(out - ref).abs().max().item():.3g} |", flush=True)


if __name__ == "__main__":
    main()
