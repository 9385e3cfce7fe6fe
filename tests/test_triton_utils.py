import triton

from tandem.triton_utils import record_jit_compiles


def _fire(repr_: str, compile_: dict | None = None):
    """What Triton's JIT does on an in-memory cache miss, before compiling."""
    hook = triton.knobs.runtime.jit_cache_hook
    return hook(key="k", repr=repr_, fn=None, compile=compile_ or {}, is_manual_warmup=False, already_compiled=False)


def test_record_jit_compiles_collects_misses_chains_and_restores_the_previous_hook():
    outer = []

    def previous(*args, **kwargs):
        outer.append(kwargs["repr"])
        return False

    triton.knobs.runtime.jit_cache_hook = previous
    try:
        with record_jit_compiles() as seen:
            assert not _fire("_paged_decode_kernel[num_warps=4](q_ptr: *bf16)")
            _fire("_moe_sum_kernel[num_warps=4](H: i32)")
        assert seen == ["_paged_decode_kernel()", "_moe_sum_kernel()"]
        assert outer == ["_paged_decode_kernel[num_warps=4](q_ptr: *bf16)", "_moe_sum_kernel[num_warps=4](H: i32)"]
        assert triton.knobs.runtime.jit_cache_hook is previous
    finally:
        triton.knobs.runtime.jit_cache_hook = None


def test_record_jit_compiles_restores_no_hook_after_an_error():
    try:
        with record_jit_compiles():
            raise RuntimeError("step failed")
    except RuntimeError:
        pass
    assert triton.knobs.runtime.jit_cache_hook is None


def test_record_jit_compiles_names_the_specialised_arguments():
    """The description names the arguments a variant was specialised on (a value such as 1,
    16-divisibility), which is what tells a warm-up gap apart."""
    compile_ = {"signature": {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"},
                "constants": {(1,): 1, "BLOCK": 64}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    with record_jit_compiles() as seen:
        _fire("_k[num_warps=4](x_ptr: *bf16)", compile_)
    assert seen == ["_k(n=1; x_ptr=[['tt.divisibility', 16]])"]


def test_the_interpreters_dot_rounds_a_row_the_same_at_any_position():
    """numpy's matmul (the interpreter's tl.dot) gives a row the same bits wherever it sits in
    the tile, as a GPU's dot does: the batch-invariance tests of the Triton kernels rely on it
    (tests/conftest.py picks an OpenBLAS kernel for which it holds)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for rows in (16, 64):
        a = rng.standard_normal((rows, 64)).astype(np.float32)
        b = rng.standard_normal((64, 32)).astype(np.float32)
        full = a @ b
        for i in range(rows):
            alone = np.zeros_like(a)
            alone[0] = a[i]
            assert np.array_equal((alone @ b)[0], full[i]), (rows, i)
