"""Fused routing kernel (tandem.layers.fused_router) == the torch routing of
tandem.layers.moe (softmax_topk, deepseek_v2_topk), ties to the lowest expert index.

On the CPU the kernel runs in the Triton interpreter; the sm90 test compiles it (and the
fused-MoE kernels changed with it: single-program alignment, reduction with the shared
experts' addend, SiLU-and-mul in the first GEMM) for an H100/H200 without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

DEV, INTERPRET = triton_test_setup("tandem.layers.fused_router", bf16_rounding=True)

from tandem.layers.fused_router import fused_router  # noqa: E402
from tandem.layers.moe import TopKRouter, deepseek_v2_topk, softmax_topk  # noqa: E402


def _check(got, want, atol=1e-6):
    """Same experts with the same weights (compared in expert order), the kernel's slots
    largest first."""
    ids, w = got
    want_ids, want_w = want
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == want_ids.shape
    assert (w[:, 1:] <= w[:, :-1]).all()
    oa, ob = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(-1, oa), want_ids.gather(-1, ob))
    torch.testing.assert_close(w.gather(-1, oa), want_w.detach().float().gather(-1, ob), atol=atol, rtol=1e-5)


def _case(t, h, e, x_dtype, w_dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=DEV).to(x_dtype)
    w = (torch.randn(e, h, generator=g, device=DEV) * h**-0.5).to(w_dtype)
    return x, w


@pytest.mark.parametrize("t,h,e,k", [(1, 16, 4, 1), (37, 72, 64, 6), (16, 130, 10, 3), (5, 48, 160, 6)])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float32)], ids=["fp32", "bf16_x", "fp16_x"])
@pytest.mark.parametrize("norm", [False, True])
def test_deepseek_greedy_matches_torch(t, h, e, k, x_dtype, w_dtype, norm):
    """fp32 logits of an fp32 weight (DeepSeek), odd H / E / T, k = 1, renormalisation."""
    x, w = _case(t, h, e, x_dtype, w_dtype, seed=t + h + e)
    want = deepseek_v2_topk(x.float() @ w.float().T, k, routed_scaling_factor=2.5, norm_topk_prob=norm)
    got = fused_router(x, w, k, renormalize=norm and k > 1, renorm_eps=1e-20, scale=2.5)
    _check(got, want)


@pytest.mark.parametrize("e,n_group,topk_group,k", [(16, 4, 2, 3), (160, 8, 3, 6), (12, 3, 1, 4), (8, 8, 8, 8)])
def test_deepseek_group_limited_matches_torch(e, n_group, topk_group, k):
    x, w = _case(29, 40, e, torch.bfloat16, torch.float32, seed=e)
    want = deepseek_v2_topk(x.float() @ w.T, k, "group_limited_greedy", n_group, topk_group, 16.0, True)
    got = fused_router(x, w, k, renormalize=k > 1, renorm_eps=1e-20, scale=16.0, n_group=n_group,
                       topk_group=topk_group)
    _check(got, want)


@pytest.mark.parametrize("renorm", [False, True])
def test_model_dtype_logits_match_torch(renorm):
    """Mixtral / Qwen3-MoE: logits in the model dtype (rounded), softmax in fp32."""
    x, w = _case(45, 64, 8, torch.bfloat16, torch.bfloat16, seed=3)
    want = softmax_topk((x @ w.T), 2, renorm)
    _check(fused_router(x, w, 2, round_logits=True, renormalize=renorm), want)


def test_split_fp32_weight_is_exact():
    """bf16 x with an fp32 weight that is not bf16-representable: the logits must be the
    fp32 product (the kernel splits the weight in three bf16 parts), not the bf16 one; the
    weights match a float64 reference to fp32 rounding."""
    x, w = _case(32, 256, 16, torch.bfloat16, torch.float32, seed=11)
    w = w * 7.0  # sharp softmax: logit errors show in the weights
    assert not torch.equal(w, w.bfloat16().float())
    ids, got = fused_router(x, w, 4)
    ref = (x.double() @ w.double().T).softmax(-1)
    torch.testing.assert_close(got.double(), ref.gather(-1, ids), atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(ids, ref.topk(4, dim=-1).indices)
    coarse = (x.double() @ w.bfloat16().double().T).softmax(-1).gather(-1, ids)
    assert (got.double() - coarse).abs().max() > 1e-4  # the test can tell the split from the bf16 weight


def test_ties_go_to_the_lowest_expert_index():
    """Equal logits (identical router rows): the lowest expert index wins, as CUDA
    torch.topk does, in the top-k and in the group choice."""
    h, e = 32, 16
    x, w = _case(20, h, e, torch.float32, torch.float32, seed=5)
    w[[3, 7, 12]] = w[3] * 0 + 1.0  # three identical rows, larger logits than the others for x > 0
    x = x.abs()
    ids, weights = fused_router(x, w, 2)
    assert (ids == torch.tensor([3, 7])).all()
    assert torch.equal(weights[:, 0], weights[:, 1])
    zeros = torch.zeros(4, h)
    ids, weights = fused_router(zeros, torch.randn(e, h), 5)  # all logits equal
    assert (ids == torch.arange(5)).all() and torch.allclose(weights, torch.full_like(weights, 1 / e))
    # Groups of 4: group 2 best, groups 1 and 3 tie for the second place: keep 2 and 1. In
    # them, 9 then 5, then the ties at -1 between experts 4, 6, 7, 8, 10, 11: 4.
    w = torch.full((e, h), -1.0)
    w[[5, 13]] = 1.0
    w[9] = 2.0
    ids, _ = fused_router(torch.ones(3, h), w, 3, n_group=4, topk_group=2)
    assert (ids == torch.tensor([9, 5, 4])).all()
    ids, _ = fused_router(torch.ones(3, h), w, 3, n_group=4, topk_group=1)
    assert (ids == torch.tensor([9, 8, 10])).all()


def test_zero_tokens_and_bad_arguments():
    x, w = _case(3, 16, 8, torch.float32, torch.float32, seed=1)
    ids, weights = fused_router(x[:0], w, 2)
    assert ids.shape == (0, 2) and weights.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        fused_router(x, w, 9)
    with pytest.raises(ValueError, match="n_group"):
        fused_router(x, w, 2, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="shapes"):
        fused_router(x, w[:, :8], 2)


@pytest.mark.parametrize("router_kw", [
    dict(method="softmax_topk", renormalize=True),
    dict(method="deepseek_v2", fp32_logits=True, routed_scaling_factor=1.5),
    dict(method="deepseek_v2", fp32_logits=True, topk_method="group_limited_greedy", n_group=4, topk_group=2,
         renormalize=True),
])
def test_router_module_triton_equals_torch(router_kw, monkeypatch):
    """TopKRouter with $TANDEM_MOE_ROUTER=triton == its torch path; DeepSeek's weight is fp32."""
    torch.manual_seed(0)
    router = TopKRouter(48, 16, 4, **router_kw).to(DEV)
    with torch.no_grad():
        router.weight.normal_()
    assert (router.weight.dtype == torch.float32) or not router_kw.get("fp32_logits")
    x = torch.randn(33, 48, device=DEV)
    with torch.no_grad():
        monkeypatch.setenv("TANDEM_MOE_ROUTER", "torch")
        want = router(x)
        monkeypatch.setenv("TANDEM_MOE_ROUTER", "triton")
        _check(router(x), want)


cuda = pytest.mark.skipif(INTERPRET, reason="needs CUDA (compiled kernels, CUDA torch.topk)")


@cuda
@pytest.mark.parametrize("t", [1, 256, 1000])
def test_cuda_v2_lite_shape_against_torch_and_in_a_graph(t):
    """DeepSeek-V2-Lite routing (bf16 x [T, 2048], fp32 weight [64, 2048], top-6) == the
    torch path on the GPU, where the 6th and 7th probabilities are not within fp32 noise
    of each other; replayed in a CUDA graph with new tokens."""
    x, w = _case(t, 2048, 64, torch.bfloat16, torch.float32, seed=t)
    w = w.bfloat16().float()  # a bf16 checkpoint's values, kept in fp32

    def check(ids, weights):
        probs = (x.float() @ w.T).softmax(-1)
        want_ids, want_w = deepseek_v2_topk(x.float() @ w.T, 6, routed_scaling_factor=1.0)
        top7 = probs.topk(7, dim=-1).values
        clear = (top7[:, 5] - top7[:, 6]) > 1e-5 * top7[:, 5]
        assert clear.float().mean() > 0.9
        _check((ids[clear], weights[clear]), (want_ids[clear], want_w[clear]), atol=1e-6)

    check(*fused_router(x, w, 6))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_router(x, w, 6)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_router(x, w, 6)
    x.copy_(_case(t, 2048, 64, torch.bfloat16, torch.float32, seed=t + 1)[0])
    graph.replay()
    torch.cuda.synchronize()
    check(*out)


@cuda
def test_cuda_ties_match_cuda_torch_topk():
    """Equal probabilities: the kernel picks the experts CUDA torch.topk picks."""
    x, w = _case(64, 256, 64, torch.bfloat16, torch.float32, seed=2)
    w[40:] = w[40]  # 24 identical rows
    w[40:] += 0.5 * w[40].sign()  # make them the largest logits for most tokens
    x = (x.abs() * w[40].sign()).bfloat16()
    ids, _ = fused_router(x, w, 6)
    want = (x.float() @ w.T).softmax(-1).topk(6, dim=-1).indices
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)
    assert (ids == torch.arange(40, 46, device=ids.device)).all()


_COMPILE_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tandem.layers import fused_router as fr, fused_moe_triton as fmt

    def compile(kernel, const, types, warps):
        names = kernel.arg_names
        sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
        src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        assert out.asm["cubin"]
        print("compiled", kernel.__name__)

    # DeepSeek-V2-Lite (bf16 x, fp32 weight, 64 experts, greedy top-6) and DeepSeek-V2
    # (160 experts, group-limited 8/3), Mixtral-style bf16 logits.
    for x_t, w_t, e, k, mode, groups in [("*bf16", "*fp32", 64, 6, 1, (0, 0)), ("*bf16", "*fp32", 160, 6, 1, (8, 3)),
                                         ("*bf16", "*bf16", 8, 2, 0, (0, 0))]:
        e_pad = triton.next_power_of_2(e)
        const = dict(H=2048, E=e, E_PAD=e_pad, TOP_K=k, K_PAD=triton.next_power_of_2(k), N_GROUP=groups[0],
                     TOPK_GROUP=groups[1], G_PAD=triton.next_power_of_2(max(groups[0], 1)), MODE=mode,
                     ROUND_LOGITS=mode == 0, RENORMALIZE=False, UPCAST=False, BLOCK_T=fr.BLOCK_T,
                     BLOCK_K=max(16, min(128, 4096 // e_pad)))
        types = dict(x_ptr=x_t, w_ptr=w_t, ids_ptr="*i64", weights_ptr="*fp32", scale="fp32", renorm_eps="fp32")
        compile(fr._fused_router_kernel, const, types, 4 if e_pad <= 128 else 8)
    const = dict(NUM_BINS=128, BLOCK_M=16, BLOCK=fmt.ALIGN_BLOCK, BLOCK_T=fmt._tiles_per_program(128))
    types = dict(ids_ptr="*i64", cursor_ptr="*i32", sorted_ids_ptr="*i32", tile_experts_ptr="*i32",
                 num_padded_ptr="*i32")
    compile(fmt._align_one_program_kernel, const, types, 8)
    types = dict(y_ptr="*bf16", ids_ptr="*i64", out_ptr="*bf16", addend_ptr="*bf16")
    compile(fmt._moe_sum_kernel, dict(TOP_K=6, HAS_ADDEND=True, BLOCK=fmt.SUM_BLOCK), types, 4)
    # The first expert GEMM with SiLU-and-mul in its epilogue: every default tile row at the
    # V2-Lite shape (N = I = 1408, K = 2048, block_n halved as fused_experts_triton does),
    # and FP8 experts with 128x128 block scales.
    for _, bm, bn, bk, gm, warps, stages in fmt.TILE_CONFIGS:
        for b_t, mode in (("*bf16", 0), ("*fp8e4nv", 2)):
            const = dict(N=1408, K=2048, A_ROW_DIV=6, MUL_WEIGHT=False, EVEN_K=True, BLOCK_M=bm, BLOCK_N=bn // 2,
                         BLOCK_K=bk, GROUP_M=gm, PRECISION="tf32", UPCAST=False, SCALE_MODE=mode, SILU_MUL=True)
            types = dict(a_ptr="*bf16", b_ptr=b_t, c_ptr="*bf16", topk_w_ptr="*fp32", sorted_ids_ptr="*i32",
                         tile_experts_ptr="*i32", num_padded_ptr="*i32", s_ptr="*fp32")
            compile(fmt._fused_moe_gemm_kernel, const, types, warps)
""")


def test_compiles_for_sm90():
    """The interpreter accepts what the compiler may not: compile the router, the
    single-program alignment, the reduction-with-addend and the GEMM-with-SiLU-and-mul
    kernels for an H100/H200 in a process without the interpreter."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("compiled") == 5 + 2 * 4
