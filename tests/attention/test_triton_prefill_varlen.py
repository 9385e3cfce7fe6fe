"""Triton variable-length causal flash attention vs per-request SDPA in fp32.

Without CUDA the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1`` is set here,
before anything imports it). Lengths mix fresh prompts (q_len == k_len), chunks and
prefix-cache tails (q_len < k_len), single queries and lengths on either side of the tile
edges; widths are odd (padded in the kernel) and, once, DeepSeek-V2's 128 + 64 / 128.
Tolerances: fp32 2e-5 (interpreter; 2e-4 compiled, TF32-free "ieee" dots), bf16 2e-2
against the fp32 reference over the same bf16 inputs (p is rounded to bf16 before P V).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import triton_test_setup

DEVICE, INTERPRET = triton_test_setup("tandem.attention.triton_prefill_varlen")

from tandem.attention import triton_prefill_varlen  # noqa: E402
from tandem.attention.triton_prefill_varlen import flash_attn_varlen_func  # noqa: E402

TOL = {torch.float32: 2e-5 if INTERPRET else 2e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SENTINEL = 7.0
# (q_len, k_len): a fresh prompt, a chunk on a cached prefix, a decode-like single query on
# a long context, a prefix-cache tail of one token, a sequence without queries, lengths one
# off the 16 / 32-wide tiles, first queries two keys short of a tile edge (the last unmasked
# tile ends right before them), a single-token prompt.
MIXED = [(5, 5), (17, 40), (1, 33), (1, 1), (0, 12), (33, 33), (15, 47), (32, 64), (3, 17), (3, 33), (2, 2)]


def make_case(lens, heads, d, dr, dv, dtype, shared_rope=True, q_offset=3, k_offset=2, seed=0):
    """Packed random inputs for ``lens = [(q_len, k_len), ...]``; ``q_offset`` / ``k_offset``
    unused rows before the first sequence (offsets need not start at 0) and after the last."""
    g = torch.Generator().manual_seed(seed)
    num_q = q_offset + sum(q for q, _ in lens) + 2
    num_k = k_offset + sum(k for _, k in lens) + 2
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    q, k, v = rnd(num_q, heads, d), rnd(num_k, heads, d), rnd(num_k, heads, dv)
    q_rope = rnd(num_q, heads, dr) if dr else None
    k_rope = (rnd(num_k, 1 if shared_rope else heads, dr)) if dr else None
    cu_q = torch.tensor([q_offset] + [q_offset + sum(q for q, _ in lens[: i + 1]) for i in range(len(lens))],
                        dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([k_offset] + [k_offset + sum(k for _, k in lens[: i + 1]) for i in range(len(lens))],
                        dtype=torch.int32, device=DEVICE)
    return q, k, v, q_rope, k_rope, cu_q, cu_k


def reference(q, k, v, q_rope, k_rope, cu_q, cu_k, scale, out_rows):
    """fp32 SDPA per sequence, bottom-right causal; rows outside every sequence: SENTINEL."""
    heads = q.shape[1]
    out = torch.full((out_rows, heads, v.shape[2]), SENTINEL)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        m, n = q1 - q0, k1 - k0
        if m == 0:
            continue
        qq, kk = q[q0:q1].float().cpu(), k[k0:k1].float().cpu()
        if q_rope is not None:
            qq = torch.cat((qq, q_rope[q0:q1].float().cpu()), -1)
            kk = torch.cat((kk, k_rope[k0:k1].float().cpu().expand(-1, heads, -1)), -1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
        vv = v[k0:k1].float().cpu()
        o = F.scaled_dot_product_attention(qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                           attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


def check(lens, heads=3, d=24, dr=16, dv=20, dtype=torch.float32, shared_rope=True, **kw):
    q, k, v, q_rope, k_rope, cu_q, cu_k = make_case(lens, heads, d, dr, dv, dtype, shared_rope)
    scale = (d + dr) ** -0.5
    out = torch.full((q.shape[0], heads, dv), SENTINEL, dtype=dtype, device=DEVICE)
    inputs = [t.clone() for t in (q, k, v)]
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(m for m, _ in lens), scale, q_rope=q_rope, k_rope=k_rope,
                                 out=out, **kw)
    assert got is out
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v)))
    want = reference(q, k, v, q_rope, k_rope, cu_q, cu_k, scale, q.shape[0])
    torch.testing.assert_close(out.float().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


DTYPES = [torch.float32, torch.bfloat16]
SMALL_TILES = dict(block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tiles", [SMALL_TILES, dict(block_m=32, block_n=16), dict(block_m=16, block_n=32)],
                         ids=["16x16", "32x16", "16x32"])
def test_mixed_lengths(dtype, tiles):
    check(MIXED, dtype=dtype, **tiles)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_tiles(dtype):
    check(MIXED, dtype=dtype)


def test_per_head_rope_keys():
    check(MIXED, shared_rope=False, **SMALL_TILES)


@pytest.mark.parametrize("d,dv", [(40, 20), (16, 16), (64, 48)])
def test_without_rope_term(d, dv):
    """One score term of any width (40 pads to 64, v 20 to 32)."""
    check(MIXED, d=d, dr=0, dv=dv, **SMALL_TILES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deepseek_v2_widths(dtype):
    """qk 128 + rope 64, v 128: the MLA prefill shape (no padding)."""
    check([(3, 20), (17, 17), (1, 5)], heads=2, d=128, dr=64, dv=128, dtype=dtype, **SMALL_TILES)


def test_strided_views_and_fp16():
    """q / q_rope as views of one [Q, H, d + dr] tensor, k / v as views of one [K, H, d + dv]
    tensor (as MLA passes them), out a view of a wider buffer."""
    lens = [(4, 9), (11, 11)]
    for dtype in (torch.float16, torch.float32):
        q, k, v, _, k_rope, cu_q, cu_k = make_case(lens, 2, 24, 16, 20, dtype)
        qcat = torch.randn(q.shape[0], 2, 40).to(dtype).to(DEVICE)
        kv = torch.randn(k.shape[0], 2, 44).to(dtype).to(DEVICE)
        q, q_rope, k, v = qcat[..., :24], qcat[..., 24:], kv[..., :24], kv[..., 24:]
        buf = torch.full((q.shape[0], 2, 30), SENTINEL, dtype=dtype, device=DEVICE)
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 0.2, q_rope=q_rope, k_rope=k_rope, out=buf[..., 5:25],
                               **SMALL_TILES)
        want = reference(q, k, v, q_rope, k_rope, cu_q, cu_k, 0.2, q.shape[0])
        torch.testing.assert_close(buf[..., 5:25].float().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])
        assert (buf[..., :5] == SENTINEL).all() and (buf[..., 25:] == SENTINEL).all()


def test_long_chunks_many_tiles():
    """Several full (unmasked) key tiles before the diagonal, and query tiles that start
    past the first one."""
    check([(70, 150), (40, 40), (1, 129)], **SMALL_TILES)


def test_empty_batch_and_max_seqlen_bound():
    q, k, v, q_rope, k_rope, _, _ = make_case([(3, 3)], 2, 16, 16, 16, torch.float32)
    out = torch.full((q.shape[0], 2, 16), SENTINEL, device=DEVICE)
    empty = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    flash_attn_varlen_func(q, k, v, empty, empty, 5, 1.0, q_rope=q_rope, k_rope=k_rope, out=out)
    assert (out == SENTINEL).all()
    # A loose max_seqlen_q (an upper bound) only adds programs that exit at once.
    check([(3, 8), (5, 5)], block_m=16, block_n=16)


def test_rejects_bad_inputs():
    q, k, v, q_rope, k_rope, cu_q, cu_k = make_case([(3, 5)], 2, 16, 16, 16, torch.float32)
    call = lambda **kw: flash_attn_varlen_func(  # noqa: E731
        **{**dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, softmax_scale=1.0,
                  q_rope=q_rope, k_rope=k_rope), **kw})
    cases = [
        (dict(q=q.to(torch.float64)), "dtype"),
        (dict(k=k[:, :1]), "k: expected"),
        (dict(k=k[..., :8]), "width"),
        (dict(v=v[1:]), "v: expected"),
        (dict(k=k.to(torch.float16)), "k: expected"),
        (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (dict(k_rope=None), "both or neither"),
        (dict(k_rope=k_rope.expand(-1, 3, -1)), "k_rope"),
        (dict(cu_seqlens_q=cu_q.long()), "cu_seqlens_q"),
        (dict(cu_seqlens_k=cu_k[:1]), "same"),
        (dict(block_m=24), "block_m"),
        (dict(block_n=8), "block_n"),
        (dict(out=torch.empty(q.shape[0], 2, 8, device=DEVICE)), "out"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**kw)


# Compiles the kernel for sm_90 (Triton's bundled ptxas, no GPU needed) the way a CUDA launch
# specializes it: pointers and strides divisible by 16, as MLA's are.
_COMPILE_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tandem.attention.triton_prefill_varlen import LAUNCH_DEFAULTS, _pad, _varlen_prefill_kernel as kernel
    import torch

    for dtype, name, (d, dr, dv, rope) in [(torch.bfloat16, "bf16", (128, 64, 128, True)),
                                          (torch.float16, "fp16", (192, 16, 128, False)),
                                          (torch.float32, "fp32", (24, 16, 20, True))]:
        block_m, block_n, warps, stages = LAUNCH_DEFAULTS[dtype]
        const = dict(D=d, D_PAD=_pad(d), DR=dr, DR_PAD=_pad(dr), DV=dv, DV_PAD=_pad(dv), HAS_ROPE=rope,
                     BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if name == "fp32" else "tf32", UPCAST=False)
        names = kernel.arg_names
        sig = {n: "constexpr" if n in const else "fp32" if n == "qk_scale" else
               ("*i32" if n.startswith("cu_") else "*" + name) if n.endswith("_ptr") else "i32" for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] not in ("constexpr", "fp32")}
        src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        assert compiled.asm["cubin"], name
        print(name, "shared", compiled.metadata.shared)
""")


def test_compiles_for_sm90():
    """The interpreter accepts what the compiler may not (dot shapes, power-of-two blocks):
    compile the default launches for an H100/H200 in a process without the interpreter."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("shared") == 3


@pytest.mark.skipif(INTERPRET, reason="large case: compiled CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_deepseek_v2_lite_prefill(dtype):
    """16 heads, 128 + 64 / 128, default tiles; a 16k-token style step of mixed requests."""
    lens = [(128, 128)] * 24 + [(512, 2048), (1, 700), (2000, 2000), (37, 1000)]
    check(lens, heads=16, d=128, dr=64, dv=128, dtype=dtype)
