"""Fused-MoE Triton kernel (tandem.layers.fused_moe_triton) == the per-expert loop.

On the CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by
conftest.py), so the shapes are small; the CUDA tests (skipped without a GPU) check the
DeepSeek-V2-Lite expert shape in bf16 and CUDA-graph capture/replay with new routing.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

triton_test_setup("tandem.layers.fused_moe_triton", bf16_rounding=True)

from tandem.layers.fused_moe_triton import (  # noqa: E402
    default_config,
    fused_experts_triton,
    moe_align_block_size,
    moe_align_block_size_torch,
)
from tandem.layers.moe import _resolve_impl, grouped_experts, reference_experts  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(n, e, k, h, i, dtype, seed, used=None, device=DEV):
    """Tokens, routing (each token: k distinct experts among the first ``used``), weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, generator=g, device=device)
    w13 = torch.randn(e, 2 * i, h, generator=g, device=device) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g, device=device) * i**-0.5
    ids = torch.rand(n, e if used is None else used, generator=g, device=device).topk(k, dim=-1).indices
    w = torch.rand(n, k, generator=g, device=device)
    return x.to(dtype), ids, w, w13.to(dtype), w2.to(dtype)


def _check(got, x, ids, w, w13, w2, tight):
    want = reference_experts(x, ids, w, w13, w2)
    assert got.dtype == x.dtype and got.shape == want.shape
    tol = dict(atol=1e-5, rtol=1e-5) if tight else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("n,e,k,h,i,used", [
    (1, 4, 1, 16, 16, None),  # one token, one slot
    (7, 8, 2, 48, 40, 4),  # non-multiples of the tiles; experts 4..7 get no tokens
    (33, 16, 4, 64, 24, None),
    (20, 10, 8, 32, 40, None),  # top-8
    (64, 64, 6, 64, 48, None),  # DeepSeek-V2-Lite routing (64 experts, top-6) at toy widths
])
def test_fp32_matches_reference(n, e, k, h, i, used):
    x, ids, w, w13, w2 = _case(n, e, k, h, i, torch.float32, seed=n * 31 + e, used=used)
    _check(fused_experts_triton(x, ids, w, w13, w2), x, ids, w, w13, w2, tight=True)


@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 16, 16), (32, 32, 64)])
def test_fp32_tile_sizes_and_swizzle(block_m, block_n, block_k):
    """Several M tiles per expert, several N/K tiles, K and N tails, a partial swizzle group."""
    x, ids, w, w13, w2 = _case(40, 4, 3, 72, 40, torch.float32, seed=5)
    got = fused_experts_triton(x, ids, w, w13, w2, block_m=block_m, block_n=block_n, block_k=block_k, group_m=5)
    _check(got, x, ids, w, w13, w2, tight=True)


def test_all_tokens_on_one_expert():
    x, _, w, w13, w2 = _case(37, 8, 1, 32, 24, torch.float32, seed=3)
    ids = torch.full((37, 1), 5, device=DEV)
    _check(fused_experts_triton(x, ids, w, w13, w2, block_m=16), x, ids, w, w13, w2, tight=True)


def test_invalid_slots_and_empty_input():
    """-1 (expert on another rank) contributes nothing; a token without a valid slot gives 0."""
    x, _, w, w13, w2 = _case(5, 4, 2, 16, 16, torch.float32, seed=1)
    ids = torch.tensor([[0, -1], [-1, -1], [3, 3], [-1, 2], [1, 0]], device=DEV)
    got = fused_experts_triton(x, ids, w, w13, w2)
    _check(got, x, ids, w, w13, w2, tight=True)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(fused_experts_triton(x, torch.full_like(ids, -1), w, w13, w2), torch.zeros_like(x))
    assert fused_experts_triton(x[:0], ids[:0], w[:0], w13, w2).shape == (0, 16)


def test_addend_added_in_the_reduction():
    """The shared experts' output added in the reduction kernel == routed + addend in torch
    (bit for bit: the routed sum is rounded first, then added as torch adds two tensors);
    no valid slot or no token: the addend itself."""
    x, ids, w, w13, w2 = _case(19, 8, 3, 48, 40, torch.bfloat16, seed=9)
    ids[::4, 0] = -1
    add = torch.randn(19, 48, device=DEV).bfloat16()
    plain = fused_experts_triton(x, ids, w, w13, w2)
    assert torch.equal(fused_experts_triton(x, ids, w, w13, w2, addend=add), plain + add)
    assert torch.equal(fused_experts_triton(x, torch.full_like(ids, -1), w, w13, w2, addend=add), add)
    assert fused_experts_triton(x[:0], ids[:0], w[:0], w13, w2, addend=add[:0]).shape == (0, 48)
    with pytest.raises(ValueError, match="addend"):
        fused_experts_triton(x, ids, w, w13, w2, addend=add[:, :40])


def test_bf16_and_fp16_close_to_reference():
    for dtype in (torch.bfloat16, torch.float16):
        x, ids, w, w13, w2 = _case(24, 8, 3, 64, 48, dtype, seed=7)
        ids[::5, 1] = -1
        got = grouped_experts(x, ids, w, w13, w2, impl="triton")
        _check(got, x, ids, w, w13, w2, tight=False)


def test_align_block_size():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [1, 2]])
    sorted_ids, tile_experts, num_padded = moe_align_block_size_torch(ids, 4, 4)
    pad = ids.numel()
    assert sorted_ids.shape == (8 + 4 * 3,) and tile_experts.shape == (5,)
    assert int(num_padded) == 12  # experts 0, 1, 2: one tile of 4 each; expert 3 none
    assert sorted_ids[:12].tolist() == [1, 4, pad, pad, 6, pad, pad, pad, 0, 2, 5, 7]
    assert (sorted_ids[12:] == pad).all()
    assert tile_experts.tolist() == [0, 1, 2, 4, 4]


@pytest.mark.parametrize("one_program", [True, False], ids=["one_program", "three_kernels"])
@pytest.mark.parametrize("n,e,k,block_m", [(4, 4, 2, 4), (50, 8, 3, 16), (300, 64, 6, 16), (700, 5, 2, 32), (0, 4, 2, 16)])
def test_align_kernels_match_torch(n, e, k, block_m, one_program, monkeypatch):
    """The Triton alignment == the torch one up to the order of the rows inside an expert's
    group (the kernel places rows with atomics: a row may land in any tile of its expert).
    Both launch paths; (300, 64, 6) spans two loop steps of the single program."""
    import tandem.layers.fused_moe_triton as fmt

    monkeypatch.setattr(fmt, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 10**9 if one_program else 0)
    g = torch.Generator(device=DEV).manual_seed(n + e)
    ids = torch.rand(n, e, generator=g, device=DEV).topk(k, dim=-1).indices
    ids[::3, 0] = -1
    got = moe_align_block_size(ids, e, block_m)
    want = moe_align_block_size_torch(ids, e, block_m)
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, b)
    assert got[0].shape == want[0].shape
    used = int(want[2])
    tile_experts = want[1][: used // block_m]
    for ex in range(e):
        def group(t: torch.Tensor) -> torch.Tensor:
            return t[:used].view(-1, block_m)[tile_experts == ex].flatten().sort().values
        assert torch.equal(group(got[0]), group(want[0]))
    assert (got[0][used:] == ids.numel()).all()


def test_auto_selection(monkeypatch):
    import tandem.layers.moe as moe

    monkeypatch.delenv("TANDEM_MOE_IMPL", raising=False)  # a pinned impl (e.g. a run of the suite with =triton)
    monkeypatch.setattr(moe, "TRITON_MAX_PAIRS", 4096)
    cpu = torch.zeros(1, 8)
    assert _resolve_impl("auto", cpu, 16) != "triton"  # never the interpreter in auto mode
    assert _resolve_impl("triton", cpu, 10**6) == "triton"
    assert default_config(64 * 6, 64)["block_m"] == 16  # V2-Lite decode at batch 64
    if torch.cuda.is_available():
        g = torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)
        hopper = torch.cuda.get_device_capability() >= (9, 0)  # auto takes the kernel on sm90+ only
        assert (_resolve_impl("auto", g, 4096) == "triton") == hopper
        assert _resolve_impl("auto", g, 4097) != "triton"
        assert _resolve_impl("auto", g.float(), 16) != "triton"


def test_deterministic_mode_takes_one_config_and_the_kernel_at_every_size(monkeypatch):
    """A token's expert sums must not depend on how many rows its expert got: one tile
    configuration for any pair count, and on CUDA the kernel at every size (the grouped GEMM
    above TRITON_MAX_PAIRS picks its own kernels); on the CPU the row-blocked loop."""
    import tandem.layers.moe as moe

    monkeypatch.delenv("TANDEM_MOE_IMPL", raising=False)

    configs = {tuple(default_config(p, 64, deterministic=True).values()) for p in (1, 6, 64 * 6, 1000 * 6, 10**6)}
    assert len(configs) == 1
    assert _resolve_impl("auto", torch.zeros(1, 8), 16, deterministic=True) == "loop"
    if torch.cuda.is_available() and moe._triton_available():
        g = torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)
        impls = {_resolve_impl("auto", g, p, deterministic=True) for p in (1, moe.TRITON_MAX_PAIRS + 1, 10**6)}
        assert impls == {"triton"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_token_output_does_not_depend_on_the_batch(dtype):
    """A token's output is the same bits alone and among 2..40 other tokens at any position,
    whatever they route to (its experts' row counts and tiles change)."""
    import random

    rng = random.Random(0)
    e, k, h, i = 8, 2, 64, 48
    x, ids, w, w13, w2 = _case(41, e, k, h, i, dtype, seed=5)
    alone = fused_experts_triton(x[:1], ids[:1], w[:1], w13, w2, deterministic=True)[0]
    for n in (2, 5, 17, 40):
        pos = rng.randrange(n)
        order = [j for j in range(1, n)]
        order.insert(pos, 0)
        got = fused_experts_triton(x[order], ids[order], w[order], w13, w2, deterministic=True)
        assert torch.equal(got[pos], alone), (n, pos)


V2_LITE_TOKENS = [1, 64, 256, 1000, 4096]


def test_v2_lite_tokens_cover_every_tile_row():
    """The CUDA test below runs each row of TILE_CONFIGS at the V2-Lite shape (E=64, k=6)."""
    from tandem.layers.fused_moe_triton import TILE_CONFIGS

    rows = {tuple(default_config(6 * n, 64).values()) for n in V2_LITE_TOKENS}
    assert rows == {row[1:] for row in TILE_CONFIGS}


def test_env_pins_auto(monkeypatch):
    cpu = torch.zeros(1, 8)
    monkeypatch.setenv("TANDEM_MOE_IMPL", "padded_bmm")
    assert _resolve_impl("auto", cpu, 16) == "padded_bmm"
    assert _resolve_impl("loop", cpu, 16) == "loop"  # an explicit impl wins
    monkeypatch.setenv("TANDEM_MOE_IMPL", "fastest")
    with pytest.raises(ValueError, match="TANDEM_MOE_IMPL"):
        _resolve_impl("auto", cpu, 16)


# ----------------------------------------------------------------------------- CUDA


@cuda
@pytest.mark.parametrize("n", V2_LITE_TOKENS)  # every row of TILE_CONFIGS
def test_v2_lite_shape_bf16(n):
    """DeepSeek-V2-Lite experts (E=64, top-6, H=2048, I=1408) in bf16."""
    x, ids, w, w13, w2 = _case(n, 64, 6, 2048, 1408, torch.bfloat16, seed=n)
    ids[::9, 2] = -1
    got = fused_experts_triton(x, ids, w, w13, w2)
    want = reference_experts(x, ids, w, w13, w2)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@cuda
def test_cuda_graph_capture_and_replay_with_new_routing():
    n, e, k, h, i = 48, 16, 4, 256, 192
    x, ids, w, w13, w2 = _case(n, e, k, h, i, torch.bfloat16, seed=11)
    fn = lambda: grouped_experts(x, ids, w, w13, w2, impl="triton")  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile + warm-up off the default stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for seed in (12, 13):
        # Second replay: every token on the same k experts (several tiles each, the rest
        # idle) and some slots on another rank.
        x_new, ids_new, w_new, _, _ = _case(n, e, k, h, i, torch.bfloat16, seed=seed, used=k if seed == 13 else None)
        if seed == 13:
            ids_new[::4, 1] = -1
        x.copy_(x_new)
        ids.copy_(ids_new)
        w.copy_(w_new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference_experts(x, ids, w, w13, w2).float(), atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------- FP8 experts


def _fp8_experts(w13, w2, block):
    """FP8 expert weights with per-channel scales, or block scales over ``block`` tiles."""
    from tandem.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, quantize_weight_per_channel

    if block is None:
        (q13, s13), (q2, s2) = quantize_weight_per_channel(w13), quantize_weight_per_channel(w2)
        return q13, q2, s13, s2
    out = []
    for w in (w13, w2):
        e, n, k = w.shape
        bn, bk = block
        tiles = w.float().reshape(e, n // bn, bn, k // bk, bk)
        s = tiles.abs().amax(dim=(2, 4)) / FP8_MAX
        q = (tiles / s[:, :, None, :, None]).reshape(e, n, k).to(FP8_DTYPE)
        out.append((q, s))
    return out[0][0], out[1][0], out[0][1], out[1][1]


@pytest.mark.parametrize("impl", ["triton", "loop", "grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("block", [None, (128, 128), (64, 32)], ids=["channel", "block128", "block64x32"])
def test_fp8_experts_match_the_dequantized_reference(impl, block):
    """FP8 weights (W8A16): each implementation == the loop over the dequantized weights."""
    from tandem.layers.moe import ExpertScales
    from tandem.layers.quantization.fp8 import dequantize_weight

    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    x, ids, w, w13, w2 = _case(9, 4, 2, 256, 128, torch.float32, seed=11)
    q13, q2, s13, s2 = _fp8_experts(w13, w2, block)
    scales = ExpertScales(s13, s2, block)
    got = grouped_experts(x, ids, w, q13, q2, impl=impl, scales=scales)
    d13, d2 = (dequantize_weight(q, s, block, torch.float32) for q, s in ((q13, s13), (q2, s2)))
    _check(got, x, ids, w, d13, d2, tight=True)
    # and within the FP8 weight error of the unquantized experts
    want = reference_experts(x, ids, w, w13, w2)
    assert ((got - want).norm() / want.norm()) < 0.05


@pytest.mark.parametrize("case", ["bf16", "fp32", "fp8_channel", "fp8_block8x32"])
def test_silu_mul_epilogue_equals_gemm_then_op(case, monkeypatch):
    """SiLU-and-mul in the first GEMM's epilogue == the GEMM writing [T*k, 2I] then
    fused_ops.silu_and_mul's kernel, bit for bit (both round the products, then the
    activation, to the storage dtype); odd I (a partial column tile), all weight modes."""
    import tandem.layers.fused_moe_triton as fmt
    from tandem.layers import fused_ops
    from tandem.layers.moe import ExpertScales

    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    x, ids, w, w13, w2 = _case(21, 6, 3, 64, {"fp8_block8x32": 64, "fp8_channel": 40}.get(case, 72), dtype, seed=13)
    ids[::5, 2] = -1
    scales = None
    if case.startswith("fp8"):
        block = None if case == "fp8_channel" else (8, 32)
        w13, w2, s13, s2 = _fp8_experts(w13, w2, block)
        scales = ExpertScales(s13, s2, block)
    got = {}
    launched = []
    kernel = fused_ops._kernel
    monkeypatch.setattr(fused_ops, "_kernel", lambda name: launched.append(name) or kernel(name))
    for fuse in (True, False):
        monkeypatch.setattr(fmt, "FUSE_SILU_MUL", fuse)
        got[fuse] = fused_experts_triton(x, ids, w, w13, w2, scales=scales)
    assert launched == ["_silu_and_mul_kernel"]  # the op's kernel, on the CPU too (as on CUDA)
    if dtype == torch.bfloat16:
        assert torch.equal(got[True], got[False])
    else:  # the interpreter's fp32 dot is a BLAS matmul: its summation order follows the tile width
        torch.testing.assert_close(got[True], got[False], atol=1e-6, rtol=1e-6)


def test_fp8_experts_auto_takes_triton_on_cuda_at_any_size(monkeypatch):
    monkeypatch.delenv("TANDEM_MOE_IMPL", raising=False)
    x = torch.empty(1, 8)
    assert _resolve_impl("auto", x, 10**6, fp8=True) in ("grouped_mm", "padded_bmm")  # CPU: dequantize
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        assert _resolve_impl("auto", x.cuda().bfloat16(), 10**6, fp8=True) == "triton"


@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs sm89+")
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block128"])
@pytest.mark.parametrize("n", [16, 256, 2048])
def test_cuda_fp8_experts_v2_lite_shape(block, n):
    """DeepSeek-V2-Lite experts (E=64, k=6, H=2048, I=1408) in FP8, bf16 activations."""
    from tandem.layers.moe import ExpertScales
    from tandem.layers.quantization.fp8 import dequantize_weight

    i = 1408 if block is None else 1536  # block scales: I a multiple of 128
    x, ids, w, w13, w2 = _case(n, 64, 6, 2048, i, torch.bfloat16, seed=n)
    q13, q2, s13, s2 = _fp8_experts(w13, w2, block)
    got = fused_experts_triton(x, ids, w, q13, q2, scales=ExpertScales(s13, s2, block))
    # fp32 reference from the exact dequantized weights: weights rounded to bf16 would add
    # their own error (the kernel applies the scales in fp32 after the dot product)
    d13, d2 = (dequantize_weight(q, s, block, torch.float32) for q, s in ((q13, s13), (q2, s2)))
    want = reference_experts(x.float(), ids, w, d13, d2)
    assert got.dtype == x.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
