"""Launch shapes of the FP8 activation-quantization kernels (issue 52): candidate variants of
:func:`tandem.layers.fused_ops.silu_and_mul_dynamic_per_token_quant` and launch configs of
:func:`~tandem.layers.fused_ops.rms_norm_dynamic_per_token_quant`, at the Llama-3.1-8B sizes
(hidden 4096, intermediate 14336, bf16), per call, replayed from a CUDA graph
(``triton.testing.do_bench_cudagraph``, as the decode steps run).

Every candidate is first checked against today's kernel on fresh random inputs, its outputs
poisoned beforehand: FP8 bytes and fp32 scales equal bit for bit ("same" column; a count of
differing rows otherwise). The table gives microseconds per call and, in brackets, the
bandwidth of reading the inputs and writing the outputs once against the GPU's HBM peak
(small batches' inputs stay in the 50 MB L2 between replays, so those can pass 100 %).

SiLU-and-mul + quant candidates (``silu/<layout>/<y>/w<warps>``), one program per row:

* ``pad``: the row as one block of ``next_power_of_2(I)`` lanes (16,384 for 14,336: 12.5 %
  of the lanes masked), as today; ``seg``: the row as up to three power-of-two segments
  (8192 + 4096 + 2048), no masked lanes at 14,336;
* ``f32``: the SiLU-and-mul result held in fp32 registers until the division, as today;
  ``16b``: held in the activation dtype it was rounded to (exact, half the registers);
* ``r<n>``: registers capped at ``n`` per thread (``maxnreg``);
* ``2pass/c<chunk>``: a loop of chunks computing the amax, then a second loop recomputing each
  chunk from the input (read twice: the second read should hit L2) and storing it.

RMSNorm + quant (``norm+res``: with the residual add, bf16 input, the qkv/gate_up input at
decode batches above 384; ``norm+res scaled``: the input an FP8 GEMM's unscaled fp32 sums,
batches up to 384): today's kernel at ``w<warps>`` (today: ``hidden // 512``, 8 at 4096).
A sum over another number of warps may round the variance differently: the check then
counts differing rows (the unfused norm would change with it, keeping fused == unfused).

    python benchmarks/fp8_quant_kernels_sweep.py [--batches 1,16,64,256,1000,4096] [--ops silu,norm]

Without CUDA (``TRITON_INTERPRET=1``) it only checks the candidates' outputs at a few rows.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.triton_interpreter import patch_interpreter_for_numpy_2_4

    patch_interpreter_for_numpy_2_4()  # range() over a kernel argument

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tandem.layers import fused_ops  # noqa: E402
from tandem.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, UnscaledProduct  # noqa: E402

HIDDEN, INTER = 4096, 14336
HBM_PEAK = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s, SXM datasheets


@triton.jit
def _silu_mul(x_row, I, start, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """``silu(g) * u`` of columns ``start + [0, BLOCK)`` of one row, rounded to OUT_DTYPE as
    fused_ops._silu_and_mul_quant_kernel rounds it (masked lanes 0)."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32)
    return (s * u).to(OUT_DTYPE)


@triton.jit
def _store_q(q_row, I, start, y, scale, BLOCK: tl.constexpr, FMAX: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    q = tl.clamp(tl.math.div_rn(y.to(tl.float32), scale), -FMAX, FMAX)
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=cols < I)


@triton.jit
def _silu_quant_segments_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, I,
    OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr, MIN_S: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,  # segments; 0: none
    Y_F32: tl.constexpr,  # hold y in fp32 registers (today) instead of OUT_DTYPE
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * I
    ya = _silu_mul(x_row, I, 0, BLOCK_A, OUT_DTYPE)
    if Y_F32:
        ya = ya.to(tl.float32)
    amax = tl.max(tl.abs(ya), axis=0).to(tl.float32)
    if BLOCK_B:
        yb = _silu_mul(x_row, I, BLOCK_A, BLOCK_B, OUT_DTYPE)
        if Y_F32:
            yb = yb.to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(yb), axis=0).to(tl.float32))
    if BLOCK_C:
        yc = _silu_mul(x_row, I, BLOCK_A + BLOCK_B, BLOCK_C, OUT_DTYPE)
        if Y_F32:
            yc = yc.to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(yc), axis=0).to(tl.float32))
    scale = tl.maximum(tl.math.div_rn(amax, FMAX), MIN_S)
    _store_q(q_row, I, 0, ya, scale, BLOCK_A, FMAX)
    if BLOCK_B:
        _store_q(q_row, I, BLOCK_A, yb, scale, BLOCK_B, FMAX)
    if BLOCK_C:
        _store_q(q_row, I, BLOCK_A + BLOCK_B, yc, scale, BLOCK_C, FMAX)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _silu_quant_two_pass_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, I,
    OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr, MIN_S: tl.constexpr, CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, I, CHUNK):
        amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, I, start, CHUNK, OUT_DTYPE).to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FMAX), MIN_S)
    for start in range(0, I, CHUNK):
        _store_q(q_ptr + row * I, I, start, _silu_mul(x_row, I, start, CHUNK, OUT_DTYPE), scale, CHUNK, FMAX)
    tl.store(scale_ptr + row, scale)


def _segments(n: int, split: bool) -> tuple[int, int, int]:
    """Block sizes covering ``n`` lanes: one padded power of two, or up to three (the two
    largest powers of two that fit, then the remainder padded)."""
    if not split:
        return triton.next_power_of_2(n), 0, 0
    a = 1 << (n.bit_length() - 1)
    rest = n - a
    b = 1 << (rest.bit_length() - 1) if rest else 0
    rest -= b
    return a, b, triton.next_power_of_2(rest) if rest else 0


def silu_candidates() -> dict[str, object]:
    """name -> fn(x [M, 2I], q [M, I] fp8, scale [M, 1] fp32) writing the outputs, returning
    the launched kernel (its registers and spills are printed)."""
    out: dict[str, object] = {}

    def segments(split: bool, y_f32: bool, warps: int, maxnreg: int | None = None):
        def fn(x, q, scale):
            inter = x.shape[1] // 2
            a, b, c = _segments(inter, split)
            return _silu_quant_segments_kernel[(x.shape[0],)](
                x, q, scale, x.stride(0), inter, OUT_DTYPE=fused_ops._tl_dtype(x.dtype), FMAX=FP8_MAX,
                MIN_S=MIN_SCALE, BLOCK_A=a, BLOCK_B=b, BLOCK_C=c, Y_F32=y_f32, num_warps=warps, maxnreg=maxnreg)
        return fn

    def two_pass(chunk: int, warps: int):
        def fn(x, q, scale):
            return _silu_quant_two_pass_kernel[(x.shape[0],)](
                x, q, scale, x.stride(0), x.shape[1] // 2, OUT_DTYPE=fused_ops._tl_dtype(x.dtype), FMAX=FP8_MAX,
                MIN_S=MIN_SCALE, CHUNK=chunk, num_warps=warps)
        return fn

    for layout in ("pad", "seg"):
        for y in ("f32", "16b"):
            for warps in (8, 16, 32):
                out[f"silu/{layout}/{y}/w{warps}"] = segments(layout == "seg", y == "f32", warps)
    # Registers capped (spilling a few values) for more programs per SM: 3 of 16 warps, 2 of 32.
    out["silu/seg/f32/w16/r40"] = segments(True, True, 16, 40)
    out["silu/pad/f32/w32/r32"] = segments(False, True, 32, 32)
    for chunk, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
        out[f"silu/2pass/c{chunk}/w{warps}"] = two_pass(chunk, warps)
    return out


def norm_fn(warps: int | None):
    """fn(x, res, w) -> (q, scale, new residual): today's op, its kernel at ``warps`` (None:
    today's choice)."""
    def fn(x, res, w):
        if warps is None:
            return fused_ops.rms_norm_dynamic_per_token_quant(x, w, 1e-5, res, mode="triton")
        today = fused_ops._num_warps
        fused_ops._num_warps = lambda block: warps  # the launch reads it per call
        try:
            return fused_ops.rms_norm_dynamic_per_token_quant(x, w, 1e-5, res, mode="triton")
        finally:
            fused_ops._num_warps = today
    return fn


def _differing_rows(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> int:
    """Rows where any output differs in any bit (FP8 bytes, fp32 scales, bf16 residual)."""
    bad = None
    for g, e in zip(got, want):
        g, e = g.reshape(g.shape[0], -1).view(torch.uint8), e.reshape(e.shape[0], -1).view(torch.uint8)
        rows = (g != e).any(dim=1)
        bad = rows if bad is None else bad | rows
    return int(bad.sum())


def _bench(fn) -> float:
    """Microseconds per call, median of CUDA-graph replays."""
    fn()  # compile outside the graph
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def sweep_silu(batches: list[int], dev: torch.device, bench: bool, regs: dict[str, str]
               ) -> dict[str, dict[int, tuple[int, float]]]:
    """{candidate: {batch: (differing rows, us)}}; "today" is timed first and last. Fills
    ``regs`` with each candidate's "registers / spilled bytes" per thread."""
    cands = silu_candidates()
    res: dict[str, dict[int, tuple[int, float]]] = {}
    for m in batches:
        gen = torch.Generator().manual_seed(m)
        x = (torch.randn(m, 2 * INTER, generator=gen) * 4).to(dev, torch.bfloat16)
        want = fused_ops.silu_and_mul_dynamic_per_token_quant(x, mode="triton")
        res.setdefault("today", {})[m] = (0, _bench(lambda: fused_ops.silu_and_mul_dynamic_per_token_quant(x))
                                          if bench else 0.0)
        for name, fn in cands.items():
            q = torch.full((m, INTER), float("nan"), device=dev).to(FP8_DTYPE)  # poison: every byte must be written
            scale = torch.full((m, 1), float("nan"), device=dev)
            kernel = fn(x, q, scale)
            if hasattr(kernel, "n_regs"):
                regs[name] = f"{kernel.n_regs} / {kernel.n_spills}"
            bad = _differing_rows((q, scale), want)
            res.setdefault(name, {})[m] = (bad, _bench(lambda: fn(x, q, scale)) if bench else 0.0)
        res.setdefault("today (again)", {})[m] = (
            0, _bench(lambda: fused_ops.silu_and_mul_dynamic_per_token_quant(x)) if bench else 0.0)
    return res


def sweep_norm(batches: list[int], dev: torch.device, bench: bool) -> dict[str, dict[int, tuple[int, float]]]:
    """{case/launch: {batch: (differing rows, us)}}; "today" is timed first and last."""
    res: dict[str, dict[int, tuple[int, float]]] = {}
    w = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)
    for m in batches:
        gen = torch.Generator().manual_seed(m)
        res_in = (torch.randn(m, HIDDEN, generator=gen) * 30).to(dev, torch.bfloat16)
        cases = {"norm+res": (torch.randn(m, HIDDEN, generator=gen) * 3).to(dev, torch.bfloat16)}
        if m <= 384:  # where o_proj / down_proj hand over their unscaled sums (the engine's default)
            cases["norm+res scaled"] = UnscaledProduct(
                (torch.randn(m, HIDDEN, generator=gen) * 3e4).to(dev), (torch.rand(m, 1, generator=gen) * 1e-3).to(dev),
                (torch.rand(HIDDEN, generator=gen) * 1e-2).to(dev), torch.bfloat16)
        for case, x in cases.items():
            want = norm_fn(None)(x, res_in, w)
            for warps in (None, 2, 4, 8, 16, None):
                name = f"{case}/today" if warps is None else f"{case}/w{warps}"
                if name in res and m in res[name]:
                    name += " (again)"
                fn = norm_fn(warps)
                bad = _differing_rows(fn(x, res_in, w), want)
                res.setdefault(name, {})[m] = (bad, _bench(lambda: fn(x, res_in, w)) if bench else 0.0)
    return res


def table(res: dict[str, dict[int, tuple[int, float]]], batches: list[int], row_bytes, peak: float,
          regs: dict[str, str]) -> str:
    lines = ["| candidate | regs / spills | same | " + " | ".join(f"batch {m}: us (% peak)" for m in batches) + " |",
             "|---|---|---|" + "---|" * len(batches)]
    for name, per in res.items():
        ms = [m for m in batches if m in per]
        bad = sum(per[m][0] for m in ms)
        cells = []
        for m in batches:
            if m not in per:
                cells.append("")
                continue
            us = per[m][1]
            cells.append(f"{us:.1f} ({100 * m * row_bytes(name) / (us * 1e-6) / peak:.0f} %)" if us else "-")
        lines.append(f"| {name} | {regs.get(name, '')} | {'yes' if bad == 0 else f'{bad} rows differ'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=None, help="default 1,16,64,256,1000,4096 (1,3 without CUDA)")
    ap.add_argument("--ops", default="silu,norm")
    args = ap.parse_args()
    bench = torch.cuda.is_available()
    dev = torch.device("cuda" if bench else "cpu")
    batches = [int(b) for b in (args.batches or ("1,16,64,256,1000,4096" if bench else "1,3")).split(",")]
    name = torch.cuda.get_device_name() if bench else "CPU (Triton interpreter: outputs checked, nothing timed)"
    peak = next((v for k, v in HBM_PEAK.items() if k in name), HBM_PEAK["H200"])
    print(f"device: {name}; HBM peak taken as {peak / 1e12:.2f} TB/s; triton {triton.__version__}, torch {torch.__version__}")
    ops = args.ops.split(",")
    if "silu" in ops:
        regs: dict[str, str] = {}
        res = sweep_silu(batches, dev, bench, regs)
        # gate_up read (bf16), q written (1 byte) and the scale.
        print("\nSiLU-and-mul + FP8 quant, I = 14336\n")
        print(table(res, batches, lambda _: INTER * 2 * 2 + INTER + 4, peak, regs))
    if "norm" in ops:
        res = sweep_norm(batches, dev, bench)
        # x (bf16, or the fp32 sums) and the residual read; the new residual and q written.
        print("\nRMSNorm + residual add + FP8 quant, hidden 4096\n")
        print(table(res, batches, lambda n: HIDDEN * ((4 if "scaled" in n else 2) + 2 + 2 + 1) + 4, peak, {}))


if __name__ == "__main__":
    main()
