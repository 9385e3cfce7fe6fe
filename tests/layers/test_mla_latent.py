"""The fused MLA latent write (RMSNorm + RoPE of q_pe / k_pe + concat + cache write in one
Triton kernel) vs the separate torch ops it replaces.

Without CUDA the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1`` is set here,
before the kernel is jit-ed on first use).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

# The interpreter truncates fp32 -> bf16 / e4m3; GPUs round to nearest even.
DEVICE, INTERPRET = triton_test_setup(bf16_rounding=True, fp8_rounding=True)

from tandem.layers import mla_latent  # noqa: E402
from tandem.layers.mla_latent import write_latents  # noqa: E402
from tandem.layers.norm import RMSNorm  # noqa: E402

mla_latent._kernel.cache_clear()  # jit again now that TRITON_INTERPRET is settled


def make_case(t: int, heads: int, rank: int, rope: int, dtype: torch.dtype, cache_dtype: torch.dtype, seed: int = 0):
    """A q_proj-like output whose rope part is a strided view, a kv_a_proj output, a cache
    with random contents and distinct random slots (the last token padding: -1)."""
    g = torch.Generator().manual_seed(seed)
    nope, bs, num_blocks, max_pos = 24, 16, 6, 64
    to = lambda x: x.to(DEVICE)  # noqa: E731
    q = to((torch.randn(t, heads, nope + rope, generator=g) * 2).to(dtype))
    kv = to((torch.randn(t, rank + rope, generator=g) * 3).to(dtype))
    norm = RMSNorm(rank, 1e-6).to(device=DEVICE, dtype=dtype)
    norm.weight.data.copy_(torch.randn(rank, generator=g) + 1)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(rope // 2, generator=g))
    cos, sin = to(freqs.cos()), to(freqs.sin())
    positions = to(torch.randint(0, max_pos, (t,), generator=g))
    slots = torch.randperm(num_blocks * bs - bs, generator=g)[:t] + bs  # not in the null block
    if t:
        slots[-1] = -1
    cache = to((torch.randn(1, num_blocks, bs, 1, rank + rope, generator=g) * 10).to(cache_dtype))
    return q, nope, kv, norm, cos, sin, positions, to(slots), cache


def run(mode: str, case):
    q, nope, kv, norm, cos, sin, positions, slots, cache = case
    q, cache = q.clone(), cache.clone()
    q_pe = write_latents(q[..., nope:], kv, norm, cos, sin, positions, cache, slots, mode=mode)
    return q, q_pe, cache


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float8_e4m3fn)], ids=str)
@pytest.mark.parametrize("t,heads,rank,rope", [(0, 4, 32, 16), (1, 16, 512, 64), (9, 5, 48, 16), (33, 16, 64, 8)])
def test_kernel_equals_torch_ops(t, heads, rank, rope, dtype, cache_dtype):
    case = make_case(t, heads, rank, rope, dtype, cache_dtype, seed=t + heads)
    q_ref, q_pe_ref, cache_ref = run("torch", case)
    q_got, q_pe_got, cache_got = run("triton", case)
    nope = case[1]
    # The kernel rotates the view in place; the query's nope part is untouched.
    assert q_pe_got.data_ptr() == q_got[..., nope:].data_ptr()
    assert torch.equal(q_got[..., :nope], q_ref[..., :nope])
    if INTERPRET and dtype != torch.float32:
        # Same fp32 math, same roundings (the interpreter patched to round as the GPU does):
        # the same bits. fp32 sums of the norm may differ in order (one ulp); the GPU may
        # contract products into FMAs (one bf16 ulp).
        assert torch.equal(q_pe_got, q_pe_ref)
        assert torch.equal(cache_got.view(torch.uint8), cache_ref.view(torch.uint8))
    else:
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(q_pe_got, q_pe_ref, **tol)
        if cache_dtype == torch.float8_e4m3fn:  # one e4m3 step where the bf16 inputs round apart
            tol = dict(atol=0.0, rtol=0.13)
        torch.testing.assert_close(cache_got.float(), cache_ref.float(), **tol)
    if t:  # the padding token wrote the null block's slot 0, as the reference does
        assert not torch.equal(cache_got[0, 0, 0], case[-1][0, 0, 0])


def test_fp8_saturates():
    case = list(make_case(4, 2, 32, 16, torch.bfloat16, torch.float8_e4m3fn))
    case[2] = case[2] * 1000  # k_pe far beyond e4m3's range (c_kv is normalised)
    _, _, got = run("triton", case)
    _, _, want = run("torch", case)
    assert got.float().abs().max() == 448.0
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), atol=0.0, rtol=0.13)


def test_rejects_bad_inputs():
    q, nope, kv, norm, cos, sin, positions, slots, cache = make_case(3, 2, 32, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        write_latents(q[..., nope:], kv[:, :40], norm, cos, sin, positions, cache, slots, mode="triton")
    with pytest.raises(ValueError, match="dtypes"):
        write_latents(q[..., nope:], kv.double(), norm, cos, sin, positions, cache, slots, mode="triton")
    with pytest.raises(ValueError, match="unit last stride"):
        write_latents(q[..., nope:], kv, norm, cos, sin, positions, cache.transpose(1, 2), slots, mode="triton")


_COMPILE_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tandem.layers.mla_latent import _kernel

    kernel = _kernel()
    names = kernel.arg_names
    for cache in ("bf16", "fp8e4nv"):
        const = dict(NUM_HEADS=16, BLOCK_H=16, RANK=512, BLOCK_R=512, HALF=32, BLOCK_HALF=32,
                     FP8_MAX=448.0 if cache != "bf16" else 0.0)
        types = dict(q_pe_ptr="*bf16", kv_ptr="*bf16", w_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32",
                     pos_ptr="*i64", slot_ptr="*i64", cache_ptr="*" + cache, eps="fp32")
        sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
        src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        assert compiled.asm["cubin"]
        print(cache, "ok")
""")


def test_compiles_for_sm90():
    """The DeepSeek-V2-Lite launch (bf16 and FP8 caches) compiles for an H100/H200."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.split() == ["bf16", "ok", "fp8e4nv", "ok"]
