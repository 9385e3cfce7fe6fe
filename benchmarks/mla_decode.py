"""MLA decode on the GPU at the DeepSeek-V2-Lite shape (16 heads, kv_lora_rank 512, rope 64,
v 128, hidden 2048, bf16, block size 16), measured as the engine runs it: inside CUDA
graphs, with the engine's block-table width (``--max-model-len``), the transposed
``[H, nd, R]`` query / output views of the layer's bmms, and caches (and layers) rotated so
that no call finds the previous one's latents in L2.

Modes (each prints a markdown table; times are per call / per layer, microseconds):

* ``kernel`` (default): :func:`tandem.attention.triton_mla.mla_decode_attention` with the
  launch the engine takes now (``DECODE_LAUNCH_TABLE``) and with the launch of session 8's
  start (block_n 32, 4 warps, 2 stages, split count from the block-table width, no minimum
  segment), against the floor: reading the latents once plus the query and the output
  (``sum(seq_lens) * 576 * 2 + nd * 16 * (576 + 512) * 2`` bytes) at 4.8 TB/s.
  ``--torch`` adds the gather + SDPA reference.
* ``sweep``: the launch space (split count x minimum segment x block_n x warps x stages x
  heads per program x register cap), every kernel variant compiled first,
  every point checked against the reference; prints the best points per shape and, per
  batch, the best point over the contexts as a ``MLADecodeLaunch(...)`` row to paste into
  ``DECODE_LAUNCH_TABLE`` (tandem/attention/triton_mla.py).
* ``layer``: the whole :class:`tandem.layers.mla.MLAAttention` decode forward (projections,
  RoPE, cache write, absorbed attention, output projection) as the engine runs it now
  (``new``) and as it ran at session 8's start (``old``: the same weights through the former
  sequence of ops and launch), against the floor of reading the layer's weights and latents
  and against a roofline floor that also counts the projections' math (:func:`layer_floors_us`).

Contexts: an integer ``c`` gives every request ``c`` tokens; ``mix`` draws them uniformly
from 128..384 (the seed workload: 128 prompt tokens, up to 256 generated).

    python benchmarks/mla_decode.py kernel --batches 256,1024 --contexts 128,256,384,mix
    python benchmarks/mla_decode.py sweep --batches 256,1024 --contexts 128,256,384,mix
    python benchmarks/mla_decode.py layer --batches 256,1024 --contexts mix
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS_PER_S = 989e12  # H200 SXM dense bf16 tensor-core peak (datasheet)
L2_BYTES = 50 * 2**20
HEADS, RANK, ROPE, NOPE, V_DIM, HIDDEN, BLOCK = 16, 512, 64, 128, 128, 2048, 16
SCALE = (NOPE + ROPE) ** -0.5
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")
#: The launch at session 8's start (commit 2dc28d2): block_n 32, block_h 16, 4 warps,
#: 2 stages, split count targeting two programs per SM (at most 32, one per 256 keys of the
#: bound), every segment as long as the others.
OLD_LAUNCH = dict(block_n=32, block_h=16, heads_per_program=16, num_warps=4, num_stages=2, min_tokens_per_split=1)


def old_num_splits(nd: int, bound: int) -> int:
    from tandem.triton_utils import num_sms

    return max(1, min(-(-2 * num_sms(DEVICE) // nd), 32, -(-bound // 256)))


def context_lens(spec: str, nd: int, gen: torch.Generator) -> list[int]:
    if spec == "mix":
        return torch.randint(128, 385, (nd,), generator=gen).tolist()
    return [int(spec)] * nd


@dataclasses.dataclass
class DecodeBatch:
    """Engine-like decode inputs: ``layers`` latent caches with the same block tables."""

    seq_lens: torch.Tensor  # [nd] int32
    block_tables: torch.Tensor  # [nd, max_model_len / 16] int32, unused entries 0
    caches: list[torch.Tensor]  # [1, num_blocks, 16, 1, 576] each
    lens: list[int]

    @property
    def latent_bytes(self) -> int:
        return sum(self.lens) * (RANK + ROPE) * 2


def make_batch(nd: int, spec: str, max_model_len: int, min_layers: int = 2, seed: int = 0) -> DecodeBatch:
    """Blocks of every request drawn at random from the pool (as after many steps of
    interleaved allocation); enough caches that together they exceed L2 four times."""
    gen = torch.Generator().manual_seed(seed)
    lens = context_lens(spec, nd, gen)
    nbs = [-(-n // BLOCK) for n in lens]
    num_blocks = 1 + sum(nbs)
    perm = (1 + torch.randperm(num_blocks - 1, generator=gen)).int()
    width = -(-max_model_len // BLOCK)
    tables = torch.zeros(nd, width, dtype=torch.int32)
    start = 0
    for r, nb in enumerate(nbs):
        tables[r, :nb] = perm[start: start + nb]
        start += nb
    layer_bytes = num_blocks * BLOCK * (RANK + ROPE) * 2
    layers = max(min_layers, min(8, -(-4 * L2_BYTES // layer_bytes)))
    caches = [torch.randn(1, num_blocks, BLOCK, 1, RANK + ROPE, device=DEVICE, dtype=DTYPE) for _ in range(layers)]
    return DecodeBatch(torch.tensor(lens, dtype=torch.int32, device=DEVICE), tables.to(DEVICE), caches, lens)


def graph_time_us(fn: Callable[[int], None], calls: int, replays: int = 20, profile: str | None = None) -> float:
    """Microseconds per ``fn(i)`` call, ``i`` in ``range(calls)``, captured back to back in
    one CUDA graph and replayed ``replays`` times (after a warm-up replay). ``profile``:
    also print the GPU kernels of the replays under this title (torch.profiler, averages
    per call)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and allocate outside the capture
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        print(f"\nGPU kernels of {profile} ({replays * calls} calls; divide the totals by that):")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def torch_reference(q_lat, q_pe, kv_cache, block_tables, seq_lens) -> torch.Tensor:
    """Gather + masked SDPA over the whole block-table width actually used."""
    nd = q_lat.shape[0]
    nb = -(-int(seq_lens.max()) // BLOCK)
    lat = kv_cache[0][block_tables[:, :nb].long()].reshape(nd, nb * BLOCK, -1).unsqueeze(1)
    mask = torch.arange(nb * BLOCK, device=q_lat.device)[None, :] < seq_lens[:, None]
    q = torch.cat((q_lat, q_pe), dim=-1).unsqueeze(2)
    o = F.scaled_dot_product_attention(q, lat, lat[..., :RANK], attn_mask=mask[:, None, None, :], scale=SCALE,
                                       enable_gqa=True)
    return o.squeeze(2)


class KernelCase:
    """One (batch, context) shape: engine-layout queries/outputs and a reference. Calls pass
    the block-table width as ``max_seq_len``, as the engine's graph warm-up does, so the eager
    calls run the kernel variant (split count) that the capture records."""

    def __init__(self, nd: int, spec: str, max_model_len: int) -> None:
        self.nd, self.spec = nd, spec
        self.batch = make_batch(nd, spec, max_model_len)
        q_lat_hnr = torch.randn(HEADS, nd, RANK, device=DEVICE, dtype=DTYPE)  # bmm output layout
        self.q_lat = q_lat_hnr.transpose(0, 1)
        q = torch.randn(nd, HEADS, NOPE + ROPE, device=DEVICE, dtype=DTYPE)  # q_proj output
        self.q_pe = q[..., NOPE:]
        self.out_hnr = torch.empty(HEADS, nd, RANK, device=DEVICE, dtype=DTYPE)
        b = self.batch
        self.ref = torch_reference(self.q_lat, self.q_pe, b.caches[0], b.block_tables, b.seq_lens).float()
        self.floor_bytes = b.latent_bytes + nd * HEADS * (RANK + ROPE + RANK) * 2
        self.floor_us = self.floor_bytes / HBM_BYTES_PER_S * 1e6

    def run(self, layer: int, **launch) -> torch.Tensor:
        from tandem.attention.triton_mla import mla_decode_attention

        b = self.batch
        return mla_decode_attention(self.q_lat, self.q_pe, b.caches[layer % len(b.caches)], b.block_tables,
                                    b.seq_lens, SCALE, out=self.out_hnr.transpose(0, 1),
                                    max_seq_len=b.block_tables.shape[1] * BLOCK, **launch)

    def time(self, **launch) -> tuple[float, float]:
        """(us per call in a CUDA graph, max abs error vs the reference)."""
        err = (self.run(0, **launch).float() - self.ref).abs().max().item()
        return graph_time_us(lambda i: self.run(i, **launch), calls=2 * len(self.batch.caches)), err

    def row(self, name: str, us: float, err: float) -> str:
        gbs = self.batch.latent_bytes / us / 1e3
        return (f"| {self.nd} | {self.spec} | {name} | {us:.1f} | {self.floor_us:.1f} | {us / self.floor_us:.2f} | "
                f"{gbs:.0f} | {err:.3g} |")


HEADER = ("| batch | context | launch | us / call | floor us | x floor | latent GB/s | max abs err |\n"
          "|---|---|---|---|---|---|---|---|")


_SHORT = dict(num_splits="splits", min_tokens_per_split="min_tok", block_n="bn", block_h="bh",
              heads_per_program="hpp", num_warps="nw", num_stages="ns", maxnreg="reg")


def launch_name(launch: dict) -> str:
    return " ".join(f"{_SHORT.get(k, k)}={v}" for k, v in launch.items() if k != "max_batch")


def mode_kernel(args) -> None:
    from tandem.attention.triton_mla import decode_launch

    print(HEADER)
    for nd in args.batches:
        for spec in args.contexts:
            case = KernelCase(nd, spec, args.max_model_len)
            if args.torch:
                b = case.batch
                us = graph_time_us(lambda i: torch_reference(case.q_lat, case.q_pe, b.caches[i % len(b.caches)],
                                                              b.block_tables, b.seq_lens), calls=len(b.caches))
                print(case.row("torch gather + SDPA", us, 0.0), flush=True)
            old = dict(OLD_LAUNCH, num_splits=old_num_splits(nd, case.batch.block_tables.shape[1] * BLOCK))
            table = launch_name(dataclasses.asdict(decode_launch(nd)))
            for name, launch in ((f"old: {launch_name(old)}", old), (f"table: {table}", {})):
                print(case.row(name, *case.time(**launch)), flush=True)


def sweep_points(args) -> list[dict]:
    """The launch space; a register cap only for 4-warp programs (8 warps already fit in
    fewer than 170 registers)."""
    points = []
    for bn, bh, nw, ns, hpp, reg in itertools.product(args.block_n, args.block_h, args.warps, args.stages,
                                                      args.heads_per_program, args.maxnreg):
        if (reg and nw != 4) or hpp > bh:
            continue
        for splits in args.splits:
            for min_tok in (args.min_tokens if splits > 1 else [args.min_tokens[0]]):
                points.append(dict(num_splits=splits, min_tokens_per_split=min_tok, block_n=bn, block_h=bh,
                                   heads_per_program=hpp, num_warps=nw, num_stages=ns, maxnreg=reg))
    return points


def variant_key(p: dict) -> tuple:
    """What a launch point compiles: its kernel variant and launch options."""
    return p["block_n"], p["block_h"], p["num_warps"], p["num_stages"], p["maxnreg"], p["num_splits"] == 1


def compile_variants(points: list[dict], max_model_len: int) -> list[dict]:
    """Compile every kernel variant the points use (outside the timing budget) on a small
    batch; returns the points whose variant compiled and fits the GPU."""
    case = KernelCase(4, "64", max_model_len)
    compiled: set[tuple] = set()
    failed: dict[tuple, str] = {}
    start = time.monotonic()
    for p in points:
        key = variant_key(p)
        if key in failed or key in compiled:
            continue
        try:
            case.run(0, **dict(p, num_splits=1 if key[-1] else 2))
            torch.cuda.synchronize()
            compiled.add(key)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, skip its points
            failed[key] = type(e).__name__
    print(f"compiled {len(compiled)} kernel variants in {time.monotonic() - start:.0f} s; "
          f"failed: {failed or 'none'}", flush=True)
    return [p for p in points
            if variant_key(p) not in failed]


def mode_sweep(args) -> None:
    from tandem.attention.triton_mla import decode_launch

    points = compile_variants(sweep_points(args), args.max_model_len)
    print(f"{len(points)} launch points x {len(args.batches) * len(args.contexts)} shapes")
    results: dict[tuple[int, str], list[tuple[float, float, dict]]] = {}
    deadline = time.monotonic() + args.budget_s
    shapes_left = len(args.batches) * len(args.contexts)
    print(HEADER)
    for nd in args.batches:
        for spec in args.contexts:
            # Each shape gets an equal share of what is left of the budget.
            shape_deadline = time.monotonic() + (deadline - time.monotonic()) / shapes_left
            shapes_left -= 1
            case = KernelCase(nd, spec, args.max_model_len)
            old = dict(OLD_LAUNCH, num_splits=old_num_splits(nd, case.batch.block_tables.shape[1] * BLOCK))
            print(case.row("old: " + launch_name(old), *case.time(**old)), flush=True)
            print(case.row("table: " + launch_name(dataclasses.asdict(decode_launch(nd))), *case.time()), flush=True)
            timed = []
            for p in points:
                if time.monotonic() > shape_deadline:
                    print(f"| {nd} | {spec} | this shape's share of the {args.budget_s} s budget spent: "
                          f"{len(points) - len(timed)} points skipped | | | | |")
                    break
                try:
                    us, err = case.time(**p)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                    print(f"| {nd} | {spec} | {launch_name(p)} | failed: {type(e).__name__} | | | | |", flush=True)
                    continue
                if err > args.max_err:
                    print(case.row(launch_name(p) + " **WRONG**", us, err), flush=True)
                    continue
                timed.append((us, err, p))
            timed.sort(key=lambda t: t[0])
            results[nd, spec] = timed
            for us, err, p in timed[: args.top]:
                print(case.row(launch_name(p), us, err), flush=True)
        print(f"\nbatch {nd}, best over the contexts:\n{best_row(nd, args.contexts, results, points)}\n", flush=True)
    print("\nBest launch per batch over the contexts (geometric mean of us / call); rows for "
          "DECODE_LAUNCH_TABLE in tandem/attention/triton_mla.py (set max_batch to the batch "
          "range each row should serve, the last row's to 1 << 31):\n")
    for nd in args.batches:
        print(best_row(nd, args.contexts, results, points))


def best_row(nd: int, contexts: list[str], results: dict, points: list[dict]) -> str:
    """The point with the best geometric mean over ``contexts`` at batch ``nd``, as a
    ``MLADecodeLaunch`` row with its times."""
    from tandem.attention.triton_mla import MLADecodeLaunch

    per_point: dict[str, list[float]] = {}
    for spec in contexts:
        for us, _, p in results.get((nd, spec), []):
            per_point.setdefault(launch_name(p), []).append(us)
    complete = {k: v for k, v in per_point.items() if len(v) == len(contexts)}
    if not complete:
        return f"    # batch {nd}: no launch ran on every context"
    best = min(complete, key=lambda k: sum(math.log(x) for x in complete[k]))
    p = next(p for p in points if launch_name(p) == best)
    times = ", ".join(f"{s}: {t:.1f} us" for s, t in zip(contexts, complete[best]))
    return f"    {MLADecodeLaunch(max_batch=nd, **p)!r},  # {times}"


# ------------------------------------------------------------------------------ layer


def lite_config():
    from transformers import DeepseekV2Config

    return DeepseekV2Config(hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=None, kv_lora_rank=RANK,
                            qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
                            max_position_embeddings=4096, rope_theta=10000.0)


def old_layer_forward(attn, x, positions, kv_cache, meta) -> torch.Tensor:
    """The decode forward of :class:`MLAAttention` at session 8's start (commit 2dc28d2):
    RMSNorm, RoPE, concat and cache write as separate kernels, the old launch, the output
    copied into place."""
    from tandem.attention.triton_mla import mla_decode_attention
    from tandem.layers.fused_ops import apply_rotary
    from tandem.layers.mla_latent import write_latent_cache

    t = x.shape[0]
    q_nope, q_pe = attn.q_proj(x).view(t, HEADS, NOPE + ROPE).split([NOPE, ROPE], dim=-1)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([RANK, ROPE], dim=-1)
    c_kv = attn.kv_a_layernorm(c_kv)
    q_pe, k_pe = apply_rotary(q_pe, k_pe[:, None], attn.rotary.cos, attn.rotary.sin, positions, interleaved=True)
    write_latent_cache(torch.cat((c_kv, k_pe[:, 0]), dim=-1), kv_cache, meta.slot_mapping)
    out = q_nope.new_empty(t, HEADS, V_DIM)
    w_uk, w_uv = attn._absorbed_weights()
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)
    o = torch.empty_like(q_lat)
    splits = old_num_splits(t, meta.block_tables.shape[1] * BLOCK)
    mla_decode_attention(q_lat.transpose(0, 1), q_pe, kv_cache, meta.block_tables, meta.seq_lens, attn.scale,
                         out=o.transpose(0, 1), max_seq_len=meta.max_seq_len, num_splits=splits, **OLD_LAUNCH)
    out[:t] = torch.bmm(o, w_uv.transpose(1, 2)).transpose(0, 1)
    return attn.o_proj(out.reshape(t, HEADS * V_DIM))


def decode_meta(batch: DecodeBatch):
    from tandem.attention.metadata import AttentionMetadata

    nd = len(batch.lens)
    dev = batch.seq_lens.device
    pos = batch.seq_lens.long() - 1
    slots = batch.block_tables.gather(1, (pos // BLOCK)[:, None])[:, 0].long() * BLOCK + pos % BLOCK
    # max_seq_len: the block-table width, as the engine's capture buffers give it (the eager
    # warm-up then picks the kernel variants that the capture uses).
    return AttentionMetadata(torch.arange(nd + 1, dtype=torch.int32, device=dev), batch.seq_lens,
                             batch.seq_lens - 1, batch.block_tables, slots, 1, batch.block_tables.shape[1] * BLOCK,
                             list(range(nd + 1)), batch.lens, nd)


def layer_floors_us(attn, batch: DecodeBatch, x: torch.Tensor) -> tuple[float, float]:
    """Two lower bounds on one decode layer, in microseconds: reading the layer's weights,
    the latents and ``x`` / the output once at HBM bandwidth (the issue's floor); and the
    roofline floor, where the projections (every weight multiplies every token once:
    ``2 * nd * numel`` FLOPs, ``kv_b_proj``'s through the absorbed bmms) and the attention
    (``2 * sum(lens) * heads * (2 * rank + rope)`` FLOPs) each take the longer of their
    bytes at HBM bandwidth and their FLOPs at the bf16 dense peak: from a few hundred rows
    up the projections are bound by math, not by their weight reads."""
    nd = x.shape[0]
    weight_numel = sum(p.numel() for p in attn.parameters() if p.dim() == 2)
    weight_bytes = sum(p.numel() * p.element_size() for p in attn.parameters())
    io_bytes = 2 * x.numel() * x.element_size()
    floor = (weight_bytes + batch.latent_bytes + io_bytes) / HBM_BYTES_PER_S
    proj = max((weight_bytes + io_bytes) / HBM_BYTES_PER_S, 2 * nd * weight_numel / BF16_FLOPS_PER_S)
    attn_flops = 2 * sum(batch.lens) * HEADS * (2 * RANK + ROPE)
    attend = max(batch.latent_bytes / HBM_BYTES_PER_S, attn_flops / BF16_FLOPS_PER_S)
    return floor * 1e6, (proj + attend) * 1e6


@torch.inference_mode()  # as the engine runs the model (and the bmm then writes in place)
def mode_layer(args) -> None:
    from tandem.layers.mla import MLAAttention
    from tandem.layers.rotary import RotaryEmbedding

    cfg = lite_config()
    torch.manual_seed(0)
    print("| batch | context | path | us / layer | floor us | x floor | roofline floor us | x roofline | "
          "max abs diff new vs old (of max abs out) |\n|---|---|---|---|---|---|---|---|---|")
    for nd in args.batches:
        for spec in args.contexts:
            batch = make_batch(nd, spec, args.max_model_len, min_layers=4)
            rotary = RotaryEmbedding(cfg, ROPE, args.max_model_len).to(DEVICE)
            layers = []
            for _ in batch.caches:
                attn = MLAAttention(cfg, rotary).to(device=DEVICE, dtype=DTYPE)
                for prm in attn.parameters():
                    prm.data.normal_(0, 0.02)
                attn.kv_a_layernorm.weight.data.fill_(1.0)
                layers.append(attn)
            meta = decode_meta(batch)
            x = torch.randn(nd, HIDDEN, device=DEVICE, dtype=DTYPE)
            positions = batch.seq_lens.long() - 1
            floor_us, roofline_us = layer_floors_us(layers[0], batch, x)
            n = len(layers)
            paths = {"old": lambda i: old_layer_forward(layers[i % n], x, positions, batch.caches[i % n], meta),
                     "new": lambda i: layers[i % n](x, positions, batch.caches[i % n], meta)}
            outs = {k: f(0).float() for k, f in paths.items()}
            diff = f'{(outs["new"] - outs["old"]).abs().max().item():.3g} of {outs["old"].abs().max().item():.3g}'
            for name, f in paths.items():
                us = graph_time_us(f, calls=n, profile=f"the {name} layer, batch {nd}, contexts {spec}"
                                   if args.profile else None)
                print(f"| {nd} | {spec} | {name} | {us:.1f} | {floor_us:.1f} | {us / floor_us:.2f} | "
                      f"{roofline_us:.1f} | {us / roofline_us:.2f} | {diff} |", flush=True)


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="kernel", choices=("kernel", "sweep", "layer"))
    ap.add_argument("--batches", type=ints, default=[256, 1024])
    ap.add_argument("--contexts", type=lambda s: s.split(","), default=["128", "256", "384", "mix"])
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="sets the block-table width, which bounds the split count under capture")
    ap.add_argument("--torch", action="store_true", help="kernel mode: also time the gather + SDPA reference")
    ap.add_argument("--profile", action="store_true", help="layer mode: print the kernels of each path")
    ap.add_argument("--splits", type=ints, default=[1, 2, 4, 8], help="sweep: split counts")
    ap.add_argument("--min-tokens", type=ints, default=[32, 64, 128], help="sweep: minimum keys per segment")
    ap.add_argument("--block-n", type=ints, default=[16, 32, 64], help="sweep: keys per iteration")
    ap.add_argument("--block-h", type=ints, default=[16],
                    help="sweep: query-tile rows (64: Hopper's warpgroup MMA, rows past the program's heads masked)")
    ap.add_argument("--warps", type=ints, default=[4, 8], help="sweep: warps")
    ap.add_argument("--stages", type=ints, default=[2, 3, 5],
                    help="sweep: pipeline stages (Triton 3.6 gives block_n 16 / 32 a second latent buffer from 5)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="sweep: seconds of timing, after compiling (one device call: 600 s in all)")
    ap.add_argument("--heads-per-program", type=ints, default=[16, 8],
                    help="sweep: heads per program (8: two programs per request read each latent tile)")
    ap.add_argument("--maxnreg", type=ints, default=[0, 168],
                    help="sweep: register caps of 4-warp programs (0: none; 168: three programs per SM)")
    ap.add_argument("--top", type=int, default=5, help="sweep: best points printed per shape")
    ap.add_argument("--max-err", type=float, default=3e-2, help="sweep: max abs error vs the reference (bf16)")
    args = ap.parse_args()
    {"kernel": mode_kernel, "sweep": mode_sweep, "layer": mode_layer}[args.mode](args)


if __name__ == "__main__":
    main()
