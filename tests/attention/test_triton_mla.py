"""Triton paged MLA decode kernel vs a direct fp32 computation over the gathered latents.

Without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` is set
here, before anything imports the kernels). Mostly small latent widths (R=64, P=16) to keep
the interpreter fast, plus DeepSeek-V2's real 512 / 64 at short lengths.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

DEVICE, INTERPRET = triton_test_setup("tandem.attention.triton_mla")

from tandem import triton_utils  # noqa: E402
from tandem.attention import triton_mla  # noqa: E402
from tandem.attention.triton_mla import mla_decode_attention, mla_num_splits  # noqa: E402

cuda_only = pytest.mark.skipif(INTERPRET, reason="large case: compiled CUDA only")

TOL = {torch.float32: 2e-5 if INTERPRET else 2e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_case(lens: list[int], num_heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype,
              seed: int = 0, extra_rows: int = 2, num_blocks: int | None = None, max_blocks: int | None = None):
    """Random decode batch over a cache of random latents (every slot filled, so reading a
    key past a sequence's end or through a wrong block would change the result).

    Blocks are shuffled; unused block-table entries and the ``extra_rows`` rows past the
    batch point at random real blocks, and the extra rows' lengths are random.
    Returns ``q_lat, q_pe, kv_cache, block_tables, seq_lens, scale``.
    """
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in lens]
    max_blocks = max_blocks or max(nbs, default=0) + 2
    num_blocks = num_blocks or 1 + sum(nbs) + 3  # block 0: the null block; a few spare
    assert num_blocks > sum(nbs) and max_blocks >= max(nbs, default=0)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    rows = len(lens) + extra_rows
    block_tables = torch.randint(1, num_blocks, (rows, max_blocks), generator=g, dtype=torch.int32)
    for r, nb in enumerate(nbs):
        block_tables[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    seq_lens = torch.cat([torch.tensor(lens, dtype=torch.int32),
                          torch.randint(1, max_blocks * block_size + 1, (extra_rows,), generator=g, dtype=torch.int32)])
    kv_cache = torch.randn(1, num_blocks, block_size, 1, rank + rope, generator=g).to(dtype)
    q_lat = torch.randn(len(lens), num_heads, rank, generator=g).to(dtype)
    q_pe = torch.randn(len(lens), num_heads, rope, generator=g).to(dtype)
    scale = (rank // 4 + rope) ** -0.5
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q_lat), to(q_pe), to(kv_cache), to(block_tables), to(seq_lens), scale


def reference(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """fp32 softmax(q_lat c_kv^T + q_pe k_pe^T) c_kv per request over its gathered latents."""
    nd, num_heads, rank = q_lat.shape
    bs = kv_cache.shape[2]
    out = torch.zeros(nd, num_heads, rank, dtype=torch.float32)
    for i in range(nd):
        n = int(seq_lens[i])
        if n == 0:
            continue
        nb = -(-n // bs)
        lat = kv_cache[0, block_tables[i, :nb].long(), :, 0].reshape(nb * bs, -1)[:n].float().cpu()
        c_kv, k_pe = lat[:, :rank], lat[:, rank:]
        s = (q_lat[i].float().cpu() @ c_kv.T + q_pe[i].float().cpu() @ k_pe.T) * scale
        out[i] = torch.softmax(s, dim=-1) @ c_kv
    return out


def check(lens, num_heads=16, rank=64, rope=16, block_size=16, dtype=torch.float32, seed=0, case_kw=None, **kw):
    q_lat, q_pe, kv_cache, bt, seq_lens, scale = make_case(lens, num_heads, rank, rope, block_size, dtype, seed,
                                                           **(case_kw or {}))
    cache_before = kv_cache.clone()
    if "num_splits" in kw:  # a forced split count splits even short contexts unless told otherwise
        kw.setdefault("min_tokens_per_split", 1)
    out = mla_decode_attention(q_lat, q_pe, kv_cache, bt, seq_lens, scale, **kw)
    assert out.shape == q_lat.shape and out.dtype == dtype
    assert torch.equal(kv_cache, cache_before)
    want = reference(q_lat, q_pe, kv_cache, bt, seq_lens, scale)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)
    return out


DTYPES = [torch.float32, torch.bfloat16]
# Lengths at, one below and one above block / tile multiples, and 1.
EDGE_LENS = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_ragged_block_edges(dtype, block_size, num_splits):
    check(EDGE_LENS, block_size=block_size, dtype=dtype, num_splits=num_splits, block_n=16, seed=block_size)


@pytest.mark.parametrize("block_size", [1, 8, 64])
def test_other_block_sizes(block_size):
    """Tiles of keys span several blocks (and blocks several tiles)."""
    check([1, 9, 64, 65, 100], block_size=block_size, num_splits=2, block_n=32, seed=block_size)


@pytest.mark.parametrize("num_splits", [2, 5, 8])
def test_split_kv_long_contexts(num_splits):
    """Several segments per request, trailing segments empty for the short ones."""
    check([700, 1, 129, 300, 48], num_splits=num_splits, block_n=32, seed=num_splits)


def test_long_contexts_default_splits():
    """Default launch (the table's row; split count from the block-table width)."""
    row = triton_mla.decode_launch(3)
    assert row.num_splits is None
    assert mla_num_splits(3, 16, 129 * 16, DEVICE, heads_per_program=row.heads_per_program,
                          min_tokens_per_split=row.min_tokens_per_split) == triton_mla.MAX_NUM_SPLITS
    check([2000, 1, 1500], case_kw=dict(max_blocks=129, extra_rows=1), seed=11)


def test_fp16():
    check([1, 33, 200], num_heads=8, dtype=torch.float16, num_splits=3, block_n=16, seed=5)


@pytest.mark.parametrize("num_heads", [1, 5, 20, 33])
def test_heads_not_multiple_of_16(num_heads):
    check([1, 40, 17], num_heads=num_heads, num_splits=2, block_n=16, seed=num_heads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_deepseek_v2_dims(dtype, num_splits):
    """kv_lora_rank 512, rope 64 (no padding: two dots of 512 and 64)."""
    check([1, 33, 70], num_heads=16, rank=512, rope=64, dtype=dtype, num_splits=num_splits, seed=7)


@pytest.mark.parametrize("rank,rope", [(48, 8), (40, 24)])
def test_padded_latent_widths(rank, rope):
    check([1, 20, 50], num_heads=3, rank=rank, rope=rope, num_splits=2, block_n=16, seed=rank)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_sequence_gives_zeros(num_splits):
    """A padding decode row with seq_len 0 yields 0, not NaN."""
    q_lat, q_pe, kv_cache, bt, seq_lens, scale = make_case([40, 5, 70], 4, 32, 16, 16, torch.float32)
    seq_lens[1] = 0
    out = mla_decode_attention(q_lat, q_pe, kv_cache, bt, seq_lens, scale, num_splits=num_splits, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out.cpu(), reference(q_lat, q_pe, kv_cache, bt, seq_lens, scale),
                               atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_default_splits_and_strided_views():
    """Default split heuristic (capped by max_seq_len); q_lat and out as transposed
    ``[H, nd, R]`` tensors (the bmm layout the MLA layer uses)."""
    lens = [600, 3, 257]
    num_heads, rank, rope = 4, 32, 16
    q_lat, q_pe, kv_cache, bt, seq_lens, scale = make_case(lens, num_heads, rank, rope, 16, torch.float32, seed=3)
    assert mla_num_splits(len(lens), num_heads, 600, DEVICE, heads_per_program=16, min_tokens_per_split=256) == 3
    q_hnr = q_lat.transpose(0, 1).contiguous()
    out_hnr = torch.full((num_heads, len(lens), rank), float("nan"), device=DEVICE)
    got = mla_decode_attention(q_hnr.transpose(0, 1), q_pe, kv_cache, bt, seq_lens, scale, out=out_hnr.transpose(0, 1),
                               max_seq_len=600)
    assert got.data_ptr() == out_hnr.data_ptr()
    torch.testing.assert_close(out_hnr.transpose(0, 1).cpu(), reference(q_lat, q_pe, kv_cache, bt, seq_lens, scale),
                               atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_num_splits_heuristic():
    cpu = torch.device("cpu")  # 256 program slots off CUDA
    kw = dict(heads_per_program=16, min_tokens_per_split=256)
    assert mla_num_splits(1, 16, 100_000, cpu, **kw) == triton_mla.MAX_NUM_SPLITS
    assert mla_num_splits(1, 16, 1000, cpu, **kw) == 4  # one split per 256 keys
    assert mla_num_splits(64, 16, 100_000, cpu, **kw) == 4
    assert mla_num_splits(64, 128, 100_000, cpu, **kw) == 1
    assert mla_num_splits(1, 16, 1, cpu, **kw) == 1
    # A given split count is kept, capped by the context bound only.
    assert mla_num_splits(1024, 16, 100_000, cpu, num_splits=3, **kw) == 3
    assert mla_num_splits(1024, 16, 300, cpu, num_splits=3, **kw) == 2


@pytest.mark.parametrize("heads_per_program", [16, 8])
def test_num_splits_heuristic_fills_one_wave(heads_per_program):
    """The heuristic's grid never exceeds the program slots once it splits (a few
    programs more would run a second wave), and one more split would exceed them."""
    cpu = torch.device("cpu")  # 256 slots off CUDA
    groups = 16 // heads_per_program
    for nd in range(1, 300):
        s = mla_num_splits(nd, 16, 100_000, cpu, heads_per_program=heads_per_program, min_tokens_per_split=32)
        programs = nd * groups
        assert s == 1 or programs * s <= 256, (nd, s)
        assert s == triton_mla.MAX_NUM_SPLITS or programs * (s + 1) > 256, (nd, s)


def test_num_splits_heuristic_on_an_h200(monkeypatch):
    """On CUDA the slots are PROGRAMS_PER_SM per SM: an H200's 132 SMs give 264, so 64
    requests get 4 segments (5 would be 320 programs, a second wave) and 112 get 2."""
    monkeypatch.setattr(triton_utils, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # no GPU needed: only the device type is read
    kw = dict(heads_per_program=16, min_tokens_per_split=32)
    assert mla_num_splits(64, 16, 100_000, cuda, **kw) == 4
    assert mla_num_splits(112, 16, 100_000, cuda, **kw) == 2
    assert mla_num_splits(133, 16, 100_000, cuda, **kw) == 1
    assert mla_num_splits(8, 16, 100_000, cuda, **kw) == triton_mla.MAX_NUM_SPLITS


def test_launch_table_rows():
    """Rows cover growing batch ranges with valid launch parameters; lookup picks the first
    row that covers the batch and the last one past the end."""
    table = triton_mla.DECODE_LAUNCH_TABLE
    assert [r.max_batch for r in table] == sorted(r.max_batch for r in table)
    for r in table:
        assert r.num_splits is None or r.num_splits >= 1
        assert r.min_tokens_per_split >= 1 and r.num_warps >= 1 and r.num_stages >= 1
        assert 1 <= r.heads_per_program <= r.block_h
        assert r.maxnreg == 0 or 64 <= r.maxnreg <= 255
        # The heuristic's slot count (PROGRAMS_PER_SM) is that of the uncapped 4-warp program.
        assert r.num_splits is not None or (r.num_warps == 4 and r.maxnreg == 0)
        for v in (r.block_n, r.block_h):
            assert v >= 16 and v & (v - 1) == 0
    assert triton_mla.decode_launch(1) is table[0]
    assert triton_mla.decode_launch(table[0].max_batch + 1) is table[1]
    assert triton_mla.decode_launch(table[-1].max_batch + 1) is table[-1]


@pytest.mark.parametrize("heads_per_program", [1, 3, 8])
@pytest.mark.parametrize("num_heads", [5, 16])
def test_heads_per_program(num_heads, heads_per_program):
    """Programs serving fewer heads than their tile's rows (the rest masked), with and
    without KV splits."""
    check([1, 33, 70], num_heads=num_heads, num_splits=1, heads_per_program=heads_per_program, block_n=16,
          seed=heads_per_program)
    check([1, 33, 70], num_heads=num_heads, num_splits=3, heads_per_program=heads_per_program, block_n=16,
          seed=num_heads)


def test_register_cap_launch():
    """A register cap is a launch option only: same results."""
    check([1, 33, 70], num_heads=16, rank=512, rope=64, dtype=torch.bfloat16, num_splits=2, block_n=16, maxnreg=168,
          seed=9)


@pytest.mark.parametrize("min_tokens", [16, 40, 100])
def test_min_tokens_per_split(min_tokens):
    """Segments of at least min_tokens keys (whole tiles): short requests use fewer of the
    grid's segments, long ones all of them; the reduce combines exactly the non-empty ones."""
    check([1, 15, 16, 60, 130, 333, 700], num_splits=6, min_tokens_per_split=min_tokens, block_n=16,
          seed=min_tokens)


def test_rejects_bad_inputs():
    q_lat, q_pe, kv_cache, bt, seq_lens, scale = make_case([5], 2, 32, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="dtypes"):
        mla_decode_attention(q_lat.double(), q_pe.double(), kv_cache.double(), bt, seq_lens, scale)
    with pytest.raises(ValueError, match="dtypes"):
        mla_decode_attention(q_lat, q_pe, kv_cache.to(torch.bfloat16), bt, seq_lens, scale)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode_attention(q_lat, q_pe[..., :8], kv_cache, bt, seq_lens, scale)
    with pytest.raises(ValueError, match="block_n"):
        mla_decode_attention(q_lat, q_pe, kv_cache, bt, seq_lens, scale, block_n=24)
    q2, p2 = q_lat.expand(3, -1, -1), q_pe.expand(3, -1, -1)  # 3 requests; bt / seq_lens have 3 rows
    with pytest.raises(ValueError, match="rows"):
        mla_decode_attention(q2, p2, kv_cache, bt[:2], seq_lens, scale)
    with pytest.raises(ValueError, match="rows"):
        mla_decode_attention(q2, p2, kv_cache, bt, seq_lens[:2], scale)


# --------------------------------------------------------------------------- CUDA only


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_large(dtype):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 9000, (40,), generator=g).tolist() + [1, 16, 4096]
    check(lens, num_heads=16, rank=512, rope=64, block_size=16, dtype=dtype, max_seq_len=max(lens))
    check(lens[:3], num_heads=128, rank=512, rope=64, block_size=64, dtype=dtype)


@cuda_only
def test_cuda_graph_replay():
    """A captured decode call replays correctly for other lengths and block tables: the
    grid (split count) must not depend on the captured lengths."""
    H, R, P, bs, dtype = 16, 512, 64, 16, torch.bfloat16
    kw = dict(num_blocks=1200, max_blocks=512, extra_rows=0)
    q_lat, q_pe, kv_cache, bt, seq_lens, scale = make_case([100, 20, 17, 47], H, R, P, bs, dtype, **kw)
    out = torch.empty_like(q_lat)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture (same split count: no max_seq_len)
        mla_decode_attention(q_lat, q_pe, kv_cache, bt, seq_lens, scale, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_attention(q_lat, q_pe, kv_cache, bt, seq_lens, scale, out=out, max_seq_len=100)
    for seed, lens in enumerate([[6000, 1, 300, 8000], [15, 16, 31, 32]], start=4):
        case = make_case(lens, H, R, P, bs, dtype, seed=seed, **kw)
        for dst, src in zip((q_lat, q_pe, kv_cache, bt, seq_lens), case[:5]):
            dst.copy_(src)
        graph.replay()
        want = reference(q_lat, q_pe, kv_cache, bt, seq_lens, scale)
        torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)


@cuda_only
def test_cuda_split_counts_share_one_variant():
    """After one direct and one split-KV launch of a launch row, other split counts (and
    the partial-output strides that follow them) and block-table widths build no new
    kernel variant."""
    from tandem.triton_utils import record_jit_compiles

    lens = [3000, 700, 1, 4096]
    for num_splits in (1, 2):
        check(lens, rank=512, rope=64, dtype=torch.bfloat16, num_splits=num_splits)
    with record_jit_compiles() as built:
        for num_splits in (3, 5, 16, 32):
            check(lens, rank=512, rope=64, dtype=torch.bfloat16, num_splits=num_splits,
                  case_kw=dict(max_blocks=256 + num_splits))
    assert built == []


_COMPILE_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tandem.attention.triton_mla import DECODE_LAUNCH_TABLE, _mla_decode_kernel
    from tandem.attention.triton_backend import _decode_reduce_kernel

    # The engine's integer arguments that the JIT specialises as multiples of 16 (the
    # DeepSeek-V2-Lite shape): without them the latent loads' alignment is unknown, Triton
    # does not pipeline them, and the variant built here is not the one the GPU runs.
    DIV16 = {"num_heads", "heads_per_program", "stride_qlt", "stride_qlh", "stride_qpt", "stride_qph",
             "stride_cb", "stride_cs", "stride_or", "stride_oh", "stride_os"}

    def compile(kernel, const, types, options):
        names = kernel.arg_names
        sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if sig[n].startswith("*") or n in DIV16}
        src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm["cubin"]
        return compiled

    ptrs = dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", cache_ptr="*bf16", seq_lens_ptr="*i32",
                block_tables_ptr="*i32", qk_scale="fp32")
    for row in DECODE_LAUNCH_TABLE:
        for direct in (True, False):
            const = dict(BLOCK_SIZE=16, BLOCK_H=row.block_h, BLOCK_N=row.block_n, KV_RANK=512, ROPE_DIM=64,
                         BLOCK_R=512, BLOCK_P=64, DIRECT=direct, PRECISION="tf32", UPCAST=False,
                         stride_btb=1)  # a contiguous block table: the JIT makes 1 a constant
            types = dict(ptrs, out_ptr="*bf16" if direct else "*fp32", lse_ptr="*fp32")
            options = dict(num_warps=row.num_warps, num_stages=row.num_stages)
            if row.maxnreg:
                options["maxnreg"] = row.maxnreg
            c = compile(_mla_decode_kernel, const, types, options)
            ttgir = c.asm["ttgir"]
            print("decode", row.max_batch, direct, "async_copies", ttgir.count("async_copy_global_to_local"),
                  "shared", c.metadata.shared)
    const = dict(BLOCK_N=32, BLOCK_S=4, DIM=512, BLOCK_D=512)
    types = dict(part_out_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", seq_lens_ptr="*i32")
    compile(_decode_reduce_kernel, const, types, dict(num_warps=4, num_stages=2))
    print("reduce ok")
""")


def test_compiles_for_sm90():
    """Every row of the launch table (direct and split) and the reduce compile for an
    H100/H200, in a process without the interpreter, specialised as the JIT specialises
    the engine's calls: within the SM's shared memory, with the latent loads pipelined."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("decode")]
    assert len(lines) == 2 * len(triton_mla.DECODE_LAUNCH_TABLE)
    assert all(int(ln[-1]) <= 227 * 1024 for ln in lines)  # sm_90's shared memory per block
    assert all(int(ln[-3]) > 0 for ln in lines)  # the latent loads are pipelined (cp.async), as on the GPU
    assert "reduce ok" in res.stdout
