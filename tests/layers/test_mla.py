"""MLA pieces: interleaved RoPE == transformers' DeepSeek-V2 rotary; absorbed-weight decode
(torch reference and the Triton kernel) == decompressed attention, whatever the
block-table width; the batched prefill (masked SDPA or the flash-attention kernel, however
it is grouped) == per-request attention; the whole layer / model with the Triton kernels ==
the torch path / transformers; in deterministic mode on the CPU a token's output is the
same bits alone or batched, prefilled whole, chunked, on a cached prefix or decoded (the
layer, and a tiny DeepSeek-V2 through ``LLM``). Without CUDA the Triton kernels run in the
interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV2Config

from tandem.attention.metadata import AttentionMetadata
from tandem.layers import fused_ops
from tandem.layers import mla as mla_module
from tandem.layers.fused_ops import apply_rotary
from tandem.layers import batch_invariant
from tandem.layers.mla import MLAAttention, absorb_per_head, gather_latent, prefill_groups
from tandem.layers.mla_latent import write_latent_cache
from tandem.layers.rotary import RotaryEmbedding
from tests.models.paged_parity import assert_paged_parity, random_hf_reference, step_metadata

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
BACKENDS = ["torch", "triton"]


@pytest.fixture
def triton_decode():
    """Skip unless the Triton MLA kernel can run here (compiled on CUDA or interpreted)."""
    pytest.importorskip("triton")
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from tests.triton_interpreter import patch_interpreter_for_numpy_2_4
    from tandem.attention import triton_mla

    if INTERPRET:
        if not triton_mla._INTERPRET:
            pytest.skip("tandem.attention.triton_mla was imported before TRITON_INTERPRET was set")
        patch_interpreter_for_numpy_2_4()


@pytest.fixture
def triton_decode_cpu(triton_decode):
    """For tests on CPU tensors: the kernel must run in the interpreter."""
    if not INTERPRET:
        pytest.skip("CPU tensors: needs TRITON_INTERPRET=1")


@pytest.fixture
def triton_prefill(triton_decode):
    """The prefill kernel as well (compiled on CUDA or interpreted)."""
    from tandem.attention import triton_prefill_varlen

    if INTERPRET and not triton_prefill_varlen._INTERPRET:
        pytest.skip("tandem.attention.triton_prefill_varlen was imported before TRITON_INTERPRET was set")


@pytest.fixture
def triton_prefill_cpu(triton_prefill, triton_decode_cpu):
    """For tests on CPU tensors: both kernels run in the interpreter."""


def _cfg():
    return DeepseekV2Config(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None,
                            qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, max_position_embeddings=128)


def test_interleaved_rope_matches_transformers():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb

    cfg = _cfg()
    pos = torch.tensor([[0, 3, 7, 100]])
    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 1, 4, 16)
    want_q, want_k = apply_rotary_emb(q, k, DeepseekV2RotaryEmbedding(cfg)(q, pos))
    rot = RotaryEmbedding(cfg, 16, 128)
    # [B, H, T, D] (transformers) -> [T, H, D] (Tandem)
    got_q, got_k = apply_rotary(q[0].transpose(0, 1), k[0].transpose(0, 1), rot.cos, rot.sin, pos[0], interleaved=True)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("decode_backend", BACKENDS)
def test_absorbed_decode_equals_decompressed(decode_backend, request):
    if decode_backend == "triton":
        request.getfixturevalue("triton_decode_cpu")
    torch.manual_seed(0)
    cfg = _cfg()
    attn = MLAAttention(cfg, RotaryEmbedding(cfg, 16, 128))
    attn.decode_backend = decode_backend
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    bs, nblocks = 4, 20
    cache = torch.zeros(1, nblocks, bs, 1, 48)
    lens = [5, 11, 1]
    tables = [[3, 7], [1, 9, 12], [15]]
    lat = {i: torch.randn(n, 48) for i, n in enumerate(lens)}
    for i, n in enumerate(lens):
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        write_latent_cache(lat[i], cache, slots)
    width = 6  # wider than any request needs: the extra (null) blocks must be masked out
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(4, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.tensor([n - 1 for n in lens], dtype=torch.int32), bt, torch.zeros(3, dtype=torch.long),
                             1, max(lens), [0, 1, 2, 3], lens, 3)
    q_nope, q_pe = torch.randn(3, 4, 24), torch.randn(3, 4, 16)
    got = torch.full((3, 4, cfg.v_head_dim), float("nan"))
    attn._decode_absorbed(q_nope, q_pe, cache, meta, got)
    for i, n in enumerate(lens):
        assert torch.equal(gather_latent(cache, bt[i: i + 1], 3)[0, :n], lat[i])
        k, v = attn.expand_latent(lat[i])
        q = torch.cat((q_nope[i], q_pe[i]), -1)[:, None]  # [h, 1, qk]
        want = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)[:, 0]
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_prefill_groups():
    qsl = [0, 1, 2, 19, 20, 60, 63, 127]  # q_lens 1, 1 | 17, 1, 40, 3, 64
    seqs = [14, 31, 17, 10, 61, 3, 69]
    assert prefill_groups(qsl, seqs, 2, 7, 1 << 26) == [(2, 7)]
    assert prefill_groups(qsl, seqs, 2, 7, 1) == [(2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    # 17*17 + the 1-token chunk fits; 40x61 and 3x3 fit together; 64x69 alone is over the bound.
    assert prefill_groups(qsl, seqs, 2, 7, 3000) == [(2, 4), (4, 6), (6, 7)]
    assert prefill_groups(qsl, seqs, 7, 7, 1 << 26) == []
    # Requests without queries end a group and join none.
    assert prefill_groups([0, 4, 4, 9, 9], [4, 6, 9, 2], 0, 4, 1 << 26) == [(0, 1), (2, 3)]
    assert prefill_groups([0, 0, 3], [5, 3], 0, 2, 1 << 26) == [(1, 2)]
    # The key bound: 17+10 keys fit under 30, +61 does not; 61 alone is over it and runs alone.
    assert prefill_groups(qsl, seqs, 2, 7, 1 << 26, max_keys=30) == [(2, 4), (4, 5), (5, 6), (6, 7)]
    assert prefill_groups(qsl, seqs, 2, 7, 1 << 26, max_keys=10**6) == [(2, 7)]
    # No Q x K bound (the flash-attention path): only the keys split.
    assert prefill_groups(qsl, seqs, 2, 7, None, max_keys=30) == [(2, 4), (4, 5), (5, 6), (6, 7)]
    assert prefill_groups(qsl, seqs, 2, 7, None, max_keys=None) == [(2, 7)]


@pytest.mark.parametrize("backend,bound_name,bound,num_groups", [
    ("torch", "MLA_PREFILL_MASK_ELEMENTS", 1 << 26, 1), ("torch", "MLA_PREFILL_MASK_ELEMENTS", 3000, 3),
    ("torch", "MLA_PREFILL_MASK_ELEMENTS", 1, 5), ("triton", "MLA_PREFILL_MAX_KEYS", 1 << 15, 1),
    ("triton", "MLA_PREFILL_MAX_KEYS", 30, 4)])
def test_batched_prefill_equals_per_request(backend, bound_name, bound, num_groups, monkeypatch, request):
    """Two decodes and five prefill rows (1-64 queries, some on a cached prefix, contexts
    across 8-token blocks in shuffled order) through ``_attend``: every row equals
    attention over that request's own decompressed latents with the causal-prefix mask,
    whether the prefill rows run as one pass or split into groups, through the masked SDPA
    or the flash-attention kernel (the key budget alone groups the kernel's passes)."""
    if backend == "triton":
        request.getfixturevalue("triton_prefill_cpu")
    torch.manual_seed(2)
    cfg = _cfg()
    attn = MLAAttention(cfg, RotaryEmbedding(cfg, 16, 128))
    attn.decode_backend, attn.prefill_backend = "torch", backend
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    bs, nblocks = 8, 40
    computed, q_lens = [13, 30, 0, 9, 21, 0, 5], [1, 1, 17, 1, 40, 3, 64]
    perm = (torch.randperm(nblocks - 1) + 1).tolist()
    tables, i = [], 0
    for c, q in zip(computed, q_lens):
        nb = -(-(c + q) // bs)
        tables.append(perm[i: i + nb])
        i += nb
    meta = step_metadata(q_lens, computed, tables, bs)
    assert meta.num_decode_reqs == 2
    bounds = dict(max_elements=None, max_keys=bound) if backend == "triton" else dict(max_elements=bound)
    assert prefill_groups(meta.query_start_loc_cpu, meta.seq_lens_cpu, 2, 7, **bounds) == prefill_groups(
        [0, 1, 2, 19, 20, 60, 63, 127], [14, 31, 17, 10, 61, 3, 69], 2, 7, **bounds)
    cache = torch.randn(1, nblocks, bs, 1, 48)
    q_nope, q_pe = torch.randn(sum(q_lens), 4, 24), torch.randn(sum(q_lens), 4, 16)

    calls = {"sdpa": 0, "flash": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(mla_module, bound_name, bound)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting("sdpa", F.scaled_dot_product_attention))
    if backend == "triton":
        from tandem.attention import triton_prefill_varlen

        monkeypatch.setattr(triton_prefill_varlen, "flash_attn_varlen_func",
                            counting("flash", triton_prefill_varlen.flash_attn_varlen_func))
    got = attn._attend(q_nope, q_pe, cache, meta)
    monkeypatch.undo()
    # The decode batch, then one pass per group.
    assert calls == ({"sdpa": 1, "flash": num_groups} if backend == "triton" else {"sdpa": 1 + num_groups, "flash": 0})

    flat = cache[0].view(-1, 48)
    qsl = meta.query_start_loc_cpu
    for r, (c, q) in enumerate(zip(computed, q_lens)):
        n = c + q
        lat = flat[[tables[r][p // bs] * bs + p % bs for p in range(n)]]
        k, v = attn.expand_latent(lat)  # [h, n, *]
        qr = torch.cat((q_nope, q_pe), -1)[qsl[r]: qsl[r + 1]].transpose(0, 1)  # [h, q, qk]
        mask = torch.arange(n)[None, :] <= torch.arange(c, n)[:, None]
        want = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=attn.scale).transpose(0, 1)
        torch.testing.assert_close(got[qsl[r]: qsl[r + 1]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_default_backends_follow_attention_backend(stage):
    """Triton kernels wherever get_attention_backend picks the Triton backend (CUDA)."""
    from tandem.attention.selector import get_attention_backend

    cfg = _cfg()
    attn = MLAAttention(cfg, RotaryEmbedding(cfg, 16, 128))
    uses_triton = getattr(attn, f"_{stage}_uses_triton")
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for dev in devices:
        assert uses_triton(dev) == (get_attention_backend(dev).name == "triton")
    assert not uses_triton(torch.device("cpu"))
    setattr(attn, f"{stage}_backend", "triton")
    if INTERPRET:
        assert uses_triton(torch.device("cpu"))
    else:  # compiled Triton kernels need CUDA
        with pytest.raises(ValueError, match=f"{stage}_backend='triton' needs a CUDA device"):
            uses_triton(torch.device("cpu"))
    setattr(attn, f"{stage}_backend", "flash")
    with pytest.raises(ValueError, match=f"{stage}_backend"):
        uses_triton(torch.device("cpu"))


def test_prefill_backend_from_environment(monkeypatch):
    cfg = _cfg()
    make = lambda: MLAAttention(cfg, RotaryEmbedding(cfg, 16, 128))  # noqa: E731
    assert make().prefill_backend is None
    for mode in ("torch", "triton"):
        monkeypatch.setenv("TANDEM_MLA_PREFILL", mode)
        assert make().prefill_backend == mode
    monkeypatch.setenv("TANDEM_MLA_PREFILL", "auto")
    assert make().prefill_backend is None
    monkeypatch.setenv("TANDEM_MLA_PREFILL", "flash")
    with pytest.raises(ValueError, match="TANDEM_MLA_PREFILL"):
        make()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_triton_equals_torch(dtype, triton_prefill):
    """A mixed step (decodes at block edges, one of them length 1, then a chunk on a cached
    prefix and a fresh prompt) through the whole layer, decode, prefill and the fused ops
    (the latent write among them) all on the Triton kernels or all on the torch
    references: same output and cache either way."""
    torch.manual_seed(1)
    cfg = DeepseekV2Config(hidden_size=80, num_attention_heads=5, kv_lora_rank=64, q_lora_rank=24, qk_rope_head_dim=16,
                           qk_nope_head_dim=32, v_head_dim=24, max_position_embeddings=256)
    layers = {}
    for backend in BACKENDS:  # the same weights, the fused ops built on each path
        with fused_ops.building(backend):
            layers[backend] = MLAAttention(cfg, RotaryEmbedding(cfg, 16, 256)).to(DEVICE)
    for p in layers["torch"].parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    layers["triton"].load_state_dict(layers["torch"].state_dict())
    for backend, attn in layers.items():
        attn.decode_backend = attn.prefill_backend = backend
        attn.to(dtype)
    bs, nblocks = 16, 40
    perm = (torch.randperm(nblocks - 1) + 1).tolist()
    computed, q_lens = [31, 0, 47, 100, 20, 0], [1, 1, 1, 1, 7, 9]
    tables, i = [], 0
    for c, q in zip(computed, q_lens):
        nb = -(-(c + q) // bs)
        tables.append(perm[i: i + nb])
        i += nb
    meta = step_metadata(q_lens, computed, tables, bs, DEVICE)
    cache = torch.randn(1, nblocks, bs, 1, 64 + 16, device=DEVICE).to(dtype)  # the cached prefixes
    x = torch.randn(sum(q_lens), 80, device=DEVICE).to(dtype)
    pos = torch.tensor([p for c, q in zip(computed, q_lens) for p in range(c, c + q)], device=DEVICE)
    outs, caches = {}, {}
    with torch.no_grad():
        for backend, attn in layers.items():
            caches[backend] = cache.clone()
            outs[backend] = attn(x, pos, caches[backend], meta)
    assert meta.num_decode_reqs == 4
    tol = (1e-5 if INTERPRET else 1e-4) if dtype == torch.float32 else 3e-2
    # The latents agree to the rounding of the kernels' fp32 sums (bf16: one ulp).
    torch.testing.assert_close(caches["triton"], caches["torch"], atol=tol, rtol=tol)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=tol, rtol=tol)


def test_fp8_latent_cache(triton_prefill):
    """An FP8 (e4m3, scale 1.0) latent cache through the whole layer: the Triton and torch
    paths (decode and prefill) agree on it and write the same bytes, and the output stays
    within the FP8 rounding of the run over an fp32 cache."""
    torch.manual_seed(2)
    cfg = DeepseekV2Config(hidden_size=80, num_attention_heads=5, kv_lora_rank=64, q_lora_rank=None,
                           qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, max_position_embeddings=256)
    attn = MLAAttention(cfg, RotaryEmbedding(cfg, 16, 256)).to(DEVICE)
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    bs, computed, q_lens = 16, [31, 47, 20, 0], [1, 1, 7, 9]
    tables = [[1, 2], [3, 4, 5], [6, 7], [8]]
    meta = step_metadata(q_lens, computed, tables, bs, DEVICE)
    full = torch.randn(1, 10, bs, 1, 64 + 16, device=DEVICE)
    fp8 = full.to(torch.float8_e4m3fn)
    x = torch.randn(sum(q_lens), 80, device=DEVICE)
    pos = torch.tensor([p for c, q in zip(computed, q_lens) for p in range(c, c + q)], device=DEVICE)
    outs, caches = {}, {}
    with torch.no_grad():
        for backend in BACKENDS:
            attn.decode_backend = attn.prefill_backend = backend
            caches[backend] = fp8.clone()
            outs[backend] = attn(x, pos, caches[backend], meta)
        exact = attn(x, pos, fp8.float(), meta)
    assert torch.equal(caches["triton"].view(torch.uint8), caches["torch"].view(torch.uint8))
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-4, rtol=1e-4)
    assert ((outs["torch"] - exact).norm() / exact.norm()) < 0.05


def test_model_with_triton_kernels_matches_transformers(triton_prefill_cpu):
    """Tiny random DeepSeek-V2 with the Triton decode and prefill and the fused ops (the
    latent write among them) in every layer: transformers' logits for a ragged prefill,
    decode steps and a chunked step (fp32, 1e-4)."""
    from tandem.models.registry import get_model_class

    cfg = DeepseekV2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=256, rms_norm_eps=1e-6, intermediate_size=96, n_routed_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                           kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=24)
    ref = random_hf_reference(cfg)
    with fused_ops.building("triton"):
        model = get_model_class(cfg)(cfg).eval()
    model.load_weights(ref.state_dict().items())
    mla = [m for m in model.modules() if isinstance(m, MLAAttention)]
    assert len(mla) == 2
    for m in mla:
        m.decode_backend = m.prefill_backend = "triton"
    bs = 8
    kv = [torch.zeros(1, 64, bs, 1, 32 + 16) for _ in range(2)]
    assert_paged_parity(model, ref, cfg.vocab_size, kv, bs, decode_steps=2)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (compiled kernels)")
def test_cuda_prefill_makes_no_host_sync(triton_prefill):
    """A prefill-only step (fresh prompts, a chunk on a cached prefix, a one-token prefix
    tail) through the layer on the flash-attention path under torch's sync debug mode
    "error": nothing reads the device back (the metadata's host lists size everything)."""
    torch.manual_seed(3)
    cfg = DeepseekV2Config(hidden_size=256, num_attention_heads=4, kv_lora_rank=128, q_lora_rank=None,
                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=1024)
    attn = MLAAttention(cfg, RotaryEmbedding(cfg, 64, 1024)).cuda()
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.05)
    attn = attn.to(torch.bfloat16)
    attn.prefill_backend = "triton"
    bs, computed, q_lens = 16, [0, 100, 63, 0], [40, 60, 1, 200]
    tables, nxt = [], 1
    for c, q in zip(computed, q_lens):
        nb = -(-(c + q) // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    meta = step_metadata(q_lens, computed, tables, bs, "cuda")
    cache = torch.randn(1, nxt, bs, 1, 128 + 64, device="cuda").to(torch.bfloat16)
    x = torch.randn(sum(q_lens), 256, device="cuda").to(torch.bfloat16)
    pos = torch.tensor([p for c, q in zip(computed, q_lens) for p in range(c, c + q)], device="cuda")
    with torch.no_grad():
        want = attn(x, pos, cache.clone(), meta)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = attn(x, pos, cache.clone(), meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        attn.prefill_backend = "torch"
        ref = attn(x, pos, cache.clone(), meta)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


def test_triton_on_a_cpu_without_the_interpreter_names_the_setting(monkeypatch):
    from tandem.layers import mla

    monkeypatch.setattr(mla, "_triton_interpreting", lambda: False)
    with pytest.raises(ValueError, match="prefill_backend='triton' needs a CUDA device"):
        mla._uses_triton("prefill_backend", "triton", torch.device("cpu"))
    assert mla._uses_triton("prefill_backend", "torch", torch.device("cpu")) is False


class _Request:
    """One request's hidden states and consecutive blocks, replayed in any split of steps."""

    def __init__(self, length: int, hidden: int, dtype: torch.dtype, seed: int, first_block: int, block_size: int = 16):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, hidden, generator=g).to(dtype)
        self.blocks = list(range(first_block, first_block + -(-length // block_size)))


def _layer(num_heads: int, dtype: torch.dtype, deterministic: bool = True) -> MLAAttention:
    """A random layer (the same weights for the same arguments), built in deterministic mode
    unless told otherwise."""
    g = torch.Generator().manual_seed(4)
    cfg = DeepseekV2Config(hidden_size=64, num_attention_heads=num_heads, kv_lora_rank=32, q_lora_rank=24,
                           qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, max_position_embeddings=512)
    with batch_invariant.building(deterministic):
        attn = MLAAttention(cfg, RotaryEmbedding(cfg, 16, 512))
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.2, generator=g)
    return attn.to(dtype)


def _run_steps(attn: MLAAttention, steps: list[list[tuple[_Request, int, int]]],
               cache_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """``steps`` (each a list of ``(request, computed, new)``, query-length-1 entries first)
    through the layer over one fresh cache; each step's output."""
    dtype = attn.o_proj.weight.dtype
    cache = torch.zeros(1, 120, 16, 1, attn.latent_dim, dtype=cache_dtype or dtype)
    outs = []
    with torch.no_grad():
        for step in steps:
            meta = step_metadata([n for _, _, n in step], [c for _, c, _ in step], [r.blocks for r, _, _ in step], 16)
            x = torch.cat([r.x[c: c + n] for r, c, n in step])
            pos = torch.cat([torch.arange(c, c + n) for _, c, n in step])
            outs.append(attn(x, pos, cache, meta))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads", [4, 16])
def test_deterministic_token_bits_do_not_depend_on_the_step(dtype, num_heads):
    """Deterministic mode: a 150-token prompt's outputs (two key splits) are the same bits
    prefilled alone, beside other prompts at random places, in chunks of 16 or 64 (beside
    another prompt), after a 16- or 32-token prefix-cache hit; its last token the same bits
    decoded alone and among 1 to 6 other decodes (shorter, and longer by a key split) at
    random places.
    Before: the prefill's decompressed form vs the decode's absorbed one, the masked SDPA
    over a group's packed keys and the decode's bmms all changed bits (4 and 16 heads: a
    decode's query padded to 4 tokens, and not at all)."""
    rng = random.Random(num_heads)
    attn = _layer(num_heads, dtype)
    length = 150
    req = _Request(length, 64, dtype, 0, 1)
    others = [_Request(n, 64, dtype, 1 + i, 11 + 20 * i) for i, n in enumerate((5, 300, 17, 1, 60, 129))]
    whole = _run_steps(attn, [[(req, 0, length)]])[0]
    for n in (2, 3, 5):
        batch = [(o, 0, o.x.shape[0]) for o in rng.sample(others, n - 1)]
        at = rng.randrange(n)
        batch.insert(at, (req, 0, length))
        start = sum(m for _, _, m in batch[:at])
        assert torch.equal(_run_steps(attn, [batch])[0][start: start + length], whole), (n, at)
    for size in (16, 64):
        chunks = [(c, min(size, length - c)) for c in range(0, length, size)]
        steps = [[(req, c, m), (others[2], 0, 17)] if not i else [(req, c, m)] for i, (c, m) in enumerate(chunks)]
        got = torch.cat([o[:m] for o, (_, m) in zip(_run_steps(attn, steps), chunks)])
        assert torch.equal(got, whole), size
    for cached in (16, 32):
        hit = _run_steps(attn, [[(req, 0, cached)], [(req, cached, length - cached)]])[1]
        assert torch.equal(hit, whole[cached:]), cached
    assert torch.equal(_run_steps(attn, [[(req, 0, length - 1)], [(req, length - 1, 1)]])[1][0], whole[-1])
    for n in (2, 4, 7):
        decoders = rng.sample(others, n - 1)
        prefill = [(o, 0, o.x.shape[0] - 1) for o in decoders if o.x.shape[0] > 1] + [(req, 0, length - 1)]
        decode = [(o, o.x.shape[0] - 1, 1) for o in decoders]
        at = rng.randrange(n)
        decode.insert(at, (req, length - 1, 1))
        assert torch.equal(_run_steps(attn, [prefill, decode])[1][at], whole[-1]), (n, at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_triton_path_token_bits_do_not_depend_on_the_step(triton_decode_cpu, dtype):
    """The Triton path of deterministic mode (CUDA's; here in the interpreter): every token
    through the paged decode kernel as a one-query request, the per-head GEMMs through the
    batch-invariant Triton GEMM. A 40-token prompt's outputs are the same bits prefilled
    alone, beside another prompt, in chunks of 16, after a 16-token prefix-cache hit; its
    last token decoded alone and beside two other decodes."""
    attn = _layer(4, dtype)
    attn.decode_backend = "triton"
    length = 40
    req, a, b = _Request(length, 64, dtype, 0, 1), _Request(9, 64, dtype, 1, 11), _Request(21, 64, dtype, 2, 21)
    whole = _run_steps(attn, [[(req, 0, length)]])[0]
    assert torch.equal(_run_steps(attn, [[(a, 0, 9), (req, 0, length)]])[0][9:], whole)
    chunks = [(c, min(16, length - c)) for c in range(0, length, 16)]
    got = torch.cat(_run_steps(attn, [[(req, c, m)] for c, m in chunks]))
    assert torch.equal(got, whole)
    assert torch.equal(_run_steps(attn, [[(req, 0, 16)], [(req, 16, length - 16)]])[1], whole[16:])
    decode = _run_steps(attn, [[(a, 0, 8), (b, 0, 20), (req, 0, length - 1)], [(a, 8, 1), (req, length - 1, 1),
                                                                                (b, 20, 1)]])[1]
    assert torch.equal(decode[1], whole[-1])
    default = _layer(4, dtype, deterministic=False)  # what the default paths compute, to the dtype's tolerance
    default.decode_backend = "triton"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(_run_steps(default, [[(req, 0, length)]])[0].float(), whole.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_deterministic_mode_matches_the_default_paths(cache_dtype):
    """The deterministic (absorbed, split) attention computes what the default paths do: a
    mixed step of decodes, chunks on cached prefixes, a request without queries and fresh
    prompts, over an fp32 or FP8 latent cache (fp32 model, 1e-5)."""
    attn = _layer(4, torch.float32)
    reqs = [_Request(n, 64, torch.float32, i, 1 + 12 * i) for i, n in enumerate((40, 131, 2, 70, 20, 9, 150))]
    prefix = [[(reqs[0], 0, 39), (reqs[1], 0, 130), (reqs[2], 0, 1), (reqs[3], 0, 30), (reqs[4], 0, 20)]]
    step = [(reqs[0], 39, 1), (reqs[1], 130, 1), (reqs[2], 1, 1), (reqs[3], 30, 40), (reqs[4], 20, 0),
            (reqs[5], 0, 9), (reqs[6], 0, 150)]
    got = _run_steps(attn, prefix + [step], cache_dtype)[1]
    want = _run_steps(_layer(4, torch.float32, deterministic=False), prefix + [step], cache_dtype)[1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_absorb_per_head_rows_do_not_depend_on_the_token_count(dtype):
    """Each token's per-head product is the same bits among 1 to 300 tokens at any place
    (one bmm over the tokens: other bits for 5, 8, 12 and 17 rows than for one in fp32)."""
    g, rng = torch.Generator().manual_seed(5), random.Random(5)
    w = torch.randn(16, 128, 512, generator=g).to(dtype)
    row = torch.randn(16, 128, generator=g).to(dtype)
    alone = absorb_per_head(row[None], w)[0]
    torch.testing.assert_close(alone.float(), torch.bmm(row[:, None], w)[:, 0].float(), atol=1e-3, rtol=1e-2)
    for m in (2, 3, 5, 8, 12, 16, 17, 33, 300):
        x = torch.randn(m, 16, 128, generator=g).to(dtype)
        at = rng.randrange(m)
        x[at] = row
        assert torch.equal(absorb_per_head(x, w)[at], alone), (m, at)
    assert absorb_per_head(row[None][:0], w).shape == (0, 16, 512)


def test_deterministic_deepseek_v2_end_to_end(tmp_path):
    """A tiny random DeepSeek-V2 through ``LLM(deterministic=True)``: one prompt's greedy
    token ids and logprobs are the same bits alone, among 2 to 9 other prompts at random
    places, after a prefix-cache hit, and with its prompt chunked at 16 tokens."""
    from tandem.config import embedded_default_model
    from tandem.entrypoints.llm import LLM
    from tandem.sampling_params import SamplingParams
    from tests.distributed.conftest import CONFIGS, ENGINE

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["deepseek_v2"]))
    vocab, rng = CONFIGS["deepseek_v2"]["vocab_size"], random.Random(7)
    target = [rng.randrange(2, vocab) for _ in range(45)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)

    def make(**kwargs) -> LLM:
        return LLM(model=str(tmp_path), tokenizer=embedded_default_model(),
                   **{**ENGINE, "num_kv_blocks": 256, "max_model_len": 256, "deterministic": True, **kwargs})

    def bits(llm: LLM, prompts: list[list[int]], at: int, cached: int = 0) -> tuple:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)[at]
        assert out.num_cached_tokens >= cached
        c = out.outputs[0]
        return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)

    def others(n: int) -> list[list[int]]:
        return [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 70))] for _ in range(n)]

    llm = make()
    try:
        alone = bits(llm, [target], 0)
        for n in (2, 5, 9):
            batch, at = others(n - 1), rng.randrange(n)
            assert bits(llm, batch[:at] + [target] + batch[at:], at) == alone, (n, at)
        bits(llm, [target[:40] + [5, 6, 7]], 0)
        assert bits(llm, others(3) + [target], 3, cached=32) == alone
    finally:
        llm.engine.shutdown()
    chunked = make(max_num_batched_tokens=16, enable_chunked_prefill=True, enable_prefix_caching=False)
    try:
        assert bits(chunked, others(4) + [target], 4) == alone
    finally:
        chunked.engine.shutdown()
