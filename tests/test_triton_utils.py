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
