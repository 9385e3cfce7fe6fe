"""The CPU decode step's small ops as C++ kernels (``tandem/csrc/cpu``): the RMSNorms, the
rotary embedding, SiLU-and-mul, and decode attention over the paged cache (and, built from
them, a whole decoder layer of a plain decode step: :mod:`tandem.models.cpu_decode`).

At decode sizes a CPU step is bound by per-op overhead, not arithmetic: ``F.rms_norm``
dispatches several ops, and each one that enters an OpenMP region wakes the pool's other
threads, ~30 us per norm of 576 values inside a step of the embedded model; the rotary
embedding is five such ops per layer, decode attention ~15 (a gather, views, SDPA). Each
kernel here is one op that runs a decode step's few rows on the calling thread (and spreads a
prompt's rows, or a large batch's attention, over torch's pool).

The sources are built on first use by ``torch.utils.cpp_extension.load`` (g++ and ninja,
~20 s) into torch's extensions folder (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) and loaded from there afterwards (a rebuild only when a source
or torch changes), for the vector instructions torch itself uses on this CPU (AVX2 or AVX-512, and
AVX512-VNNI where the CPU has it, for the GGUF block kernel: the extension's name carries them,
so a folder shared by machines of several kinds keeps one build per kind), with OpenMP (torch's
own runtime: ``at::parallel_for`` spreads work over torch's pool). FMA contraction is off, so the norms and the rotary embedding round as their
torch references do. Where the build fails (no compiler), :func:`available` says so once in
the log and the callers keep their torch code: :func:`tandem.layers.fused_ops.resolve_mode`
decides it once per model (fused-ops mode ``cpu``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from tandem.progress import Progress

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).resolve().parent.parent / "csrc" / "cpu").glob("*.cpp"))
HEADERS = sorted((Path(__file__).resolve().parent.parent / "csrc" / "cpu").glob("*.h"))
# Vector extensions by torch's own CPU capability (which ATEN_CPU_CAPABILITY may lower).
_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-mprefer-vector-width=256"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}

_lock = threading.Lock()
_loaded: bool | None = None


def available() -> bool:
    """Whether the kernels are loaded in this process, building them on the first call
    (thread-safe; later calls return the first answer). A failed build is logged once as a
    warning with its first line, and answered False."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    try:
        from torch.utils.cpp_extension import load  # imports setuptools: only when building

        isa = torch.backends.cpu.get_cpu_capability().lower()
        # load() rebuilds when a source or a flag changed, not a header: the headers' hash is a flag.
        headers = hashlib.sha256(b"".join(p.read_bytes() for p in HEADERS)).hexdigest()[:16]
        flags = ["-O3", "-ffp-contract=off", "-fopenmp", f"-DTANDEM_CPU_HEADERS={headers}", *_ISA_FLAGS.get(isa, [])]
        if isa == "avx512" and _cpu_has("avx512_vnni"):
            isa += "_vnni"
            flags.append("-mavx512vnni")
        name = f"tandem_cpu_ops_{isa}"
        build = lambda: load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=flags,  # noqa: E731
                             extra_ldflags=["-fopenmp"], is_python_module=False)
        if _built(name):
            build()
        else:  # a minute of silence on a small machine otherwise: say what runs
            with Progress("Building the CPU's C++ kernels (once per machine)", logger):
                build()
    except Exception as e:  # noqa: BLE001 - any build failure falls back to the torch ops
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        logger.warning("the C++ CPU kernels (tandem/csrc/cpu) could not be built (%s): the decode step's "
                       "norms, RoPE, attention and SiLU run as torch ops", first)
        return False
    return True


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (False where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def _built(name: str) -> bool:
    """Whether torch's extensions folder holds a build of ``name`` (``load`` still rebuilds
    it if a source changed)."""
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.exists(os.path.join(_get_build_directory(name, False), f"{name}.so"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * round(x * rsqrt(mean(x^2) + eps))`` over the last dim of ``x [..., N]``
    (fp32/fp16/bf16, any strides) -> a new contiguous tensor of x's shape and dtype.

    Raises:
        RuntimeError: :func:`available` is False, a tensor not on the CPU, or a ``weight``
            that is not ``[N]`` of x's dtype.
    """
    return torch.ops.tandem_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (rounded to the dtype), ``(rms_norm(r, weight, eps), r)``, new
    contiguous tensors.

    Raises:
        RuntimeError: as :func:`rms_norm`, or a ``residual`` of another shape or dtype.
    """
    return torch.ops.tandem_cpu.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding_neox(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style RoPE (rotate-half) of ``x [T, H, D]`` (fp32/fp16/bf16; the last dim
    contiguous, any other strides) at ``positions [T]`` int64, from ``cos`` and ``sin``
    ``[max_positions, D/2]`` float32 (:class:`tandem.layers.rotary.RotaryEmbedding`'s
    tables): ``x1 cos - x2 sin`` and ``x2 cos + x1 sin`` of the two halves, each product and
    sum rounded to fp32, cast to x's dtype -> a new contiguous ``[T, H, D]`` tensor, the same
    bits as :class:`~tandem.layers.rotary.RotaryEmbedding`'s torch path.

    Raises:
        RuntimeError: :func:`available` is False, a tensor not on the CPU, shapes or dtypes
            other than the above, a position outside the tables.
    """
    return torch.ops.tandem_cpu.rotary_embedding_neox(positions, x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2I]`` (fp32/fp16/bf16; gate the first half) ->
    a new contiguous ``[..., I]``: silu in fp32 with an exp by a fixed polynomial (relative
    error ~2e-7; the loop vectorizes), rounded to the dtype, times up in fp32, rounded again
    (:func:`tandem.layers.fused_ops.silu_and_mul_ref`'s roundings: 16-bit results equal
    its bits but for rare one-step roundings, fp32 within a few ulps).

    Raises:
        RuntimeError: :func:`available` is False, not a CPU tensor, an odd last dim.
    """
    return torch.ops.tandem_cpu.silu_and_mul(gate_up)


def gguf_repack(blocks: torch.Tensor, segments: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks as a file stores them repacked into the tiles :func:`gguf_repacked_linear`
    multiplies from (``tandem/csrc/cpu/gguf_repacked.cpp`` has the layout): 16 weight rows per
    tile laid out for AVX512-VNNI's dot product, each weight at the file's bits, the scales as
    the file has them (a tile of 16 rows pads a segment's last rows with zeros).

    Args:
        blocks: ``[bytes]`` uint8, the segments' rows one after another.
        segments: ``[S, 3]`` int64: per segment its GGML type id (Q4_0 2, Q4_1 3, Q5_0 6,
            Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14), row count and byte offset in ``blocks``;
            the output holds the segments' rows in order.
        in_features: the width, a multiple of 32 (and of 256 for a K-quant).

    Returns:
        ``(repacked [bytes] uint8, segments [S, 3] int64)``: the tiles and their table (type,
        rows, byte offset in ``repacked``). Multi-threaded over tiles.

    Raises:
        RuntimeError: :func:`available` is False, an unsupported type, a segment past the end
            of ``blocks``, a width the type's block does not divide.
    """
    return torch.ops.tandem_cpu.gguf_repack(blocks, segments, in_features)


def gguf_repacked_linear(x: torch.Tensor, repacked: torch.Tensor, segments: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + bias`` with ``W`` the tiles of :func:`gguf_repack`, any number of rows.

    Args:
        x: ``[T, in]`` fp32/fp16/bf16.
        repacked, segments: :func:`gguf_repack`'s output for this ``in``.
        bias: ``[out]`` or None.

    Returns ``[T, out]`` in x's dtype: llama.cpp's CPU arithmetic per 32 (each row of x rounded
    to int8 per 32 values, as its Q8_0; integer dot products with AVX512-VNNI per group of 32
    columns, 16 for Q6_K; fp32 scaling in a fixed order; the source's header): each output row a
    function of its input row only, whatever the row count (batch-invariant), the same bits
    with and without VNNI (scalar code, slow). Multi-threaded over tiles of 16 output rows.

    Raises:
        RuntimeError: :func:`available` is False, a tensor of another shape or dtype, a table
            that does not describe ``repacked`` at this width, a bias of another length.
    """
    return torch.ops.tandem_cpu.gguf_repacked_linear(x, repacked, segments, bias)


def gguf_repacked_width(repacked: torch.Tensor, segments: torch.Tensor) -> int:
    """The ``in_features`` of :func:`gguf_repack`'s output (the tiles' bytes are linear in it).

    Raises:
        RuntimeError: :func:`available` is False, or no width fits the bytes and the table.
    """
    return torch.ops.tandem_cpu.gguf_repacked_width(repacked, segments)


def gguf_repacked_get_rows(repacked: torch.Tensor, segments: torch.Tensor, ids: torch.Tensor, cols: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a repacked GGUF tensor (:func:`gguf_repack`'s output), dequantized
    (llama.cpp's get_rows: a token embedding that keeps the file's bits).

    Args:
        repacked, segments: :func:`gguf_repack`'s output (the tensor's rows, ``cols`` values each).
        ids: ``[T]`` integer row indices.
        cols: values per row, a multiple of 32 (and of 256 for a K-quant).
        dtype: of the result.

    Returns ``[T, cols]`` in ``dtype``: the values gguf's own dequantization gives (in fp32,
    then cast).

    Raises:
        RuntimeError: :func:`available` is False, an id outside the rows, a table that does not
            describe ``repacked`` at ``cols``.
    """
    return torch.ops.tandem_cpu.gguf_repacked_get_rows(repacked, segments, ids, cols, dtype)


def paged_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query token per request over its keys in the paged cache.

    Args:
        q: ``[N, Hq, D]`` fp32/fp16/bf16 (the last dim contiguous), request ``r``'s token.
        kv_cache: ``[2, num_blocks, block_size, Hk, D]`` contiguous, q's dtype (an FP8 cache
            is not read here), ``Hq`` a multiple of ``Hk`` (grouped-query attention).
        block_tables: ``[>= N, max_blocks]`` int32, request ``r``'s blocks in order.
        seq_lens: ``[>= N]`` int32: request ``r`` attends to its first ``seq_lens[r]`` keys
            (its token's own included).
        scale: softmax scale.

    Returns ``[N, Hq, D]`` in q's dtype: ``softmax(q k^T * scale) v`` per request and head,
    in fp32 (exp by a fixed polynomial, relative error ~2e-7), each (request, KV head)
    computed the same way whatever the batch and threads (batch-invariant). Runs on the
    calling thread below ~0.5 M multiply-adds, over torch's pool above.

    Raises:
        RuntimeError: :func:`available` is False, tensors not on the CPU or of other shapes
            or dtypes, a ``seq_lens`` entry outside ``[1, max_blocks * block_size]``, a block
            id outside the cache.
    """
    return torch.ops.tandem_cpu.paged_attention_decode(q, kv_cache, block_tables, seq_lens, scale)


__all__ = ["HEADERS", "SOURCES", "available", "fused_add_rms_norm", "gguf_repack", "gguf_repacked_get_rows",
           "gguf_repacked_linear", "gguf_repacked_width", "paged_attention_decode", "rms_norm", "rotary_embedding_neox", "silu_and_mul"]
