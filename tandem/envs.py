"""Every ``TANDEM_*`` environment variable, read here and nowhere else.

Attributes are read from the environment at each access (``tandem.envs.TANDEM_MOE_IMPL``),
as vLLM's ``envs.py`` does, so a variable set after import (a test's ``monkeypatch``, a
spawned rank) takes effect. A value outside its choices raises ``ValueError`` naming the
variable.

==================================  =========  ==================================================
variable                            default    meaning
==================================  =========  ==================================================
TANDEM_LOGGING_LEVEL                unset      log level of the CLI and of spawned rank processes
                                               (unset: WARNING; INFO for ``tandem serve``)
TANDEM_MOE_IMPL                     auto       pins what the MoE expert compute's ``auto`` means
                                               (auto, grouped_mm, padded_bmm, triton, loop)
TANDEM_MOE_ROUTER                   auto       MoE routing (logits, softmax, top-k): auto (one
                                               Triton kernel on CUDA, torch on the CPU),
                                               triton, torch
TANDEM_FUSED_OPS                    auto       fused norm/activation/RoPE kernels: auto (Triton
                                               on CUDA; on the CPU the C++ kernels of the
                                               decode step where they build, torch
                                               otherwise), triton, torch, cpu; read when a
                                               model loads
TANDEM_FP8_FUSED_QUANT              on         FP8 layers with dynamic per-token activation
                                               scales get their input quantized by the norm /
                                               SiLU-and-mul kernel producing it (on), or by a
                                               separate kernel (off); read when a model loads
TANDEM_FP8_FAST_ACCUM               on         FP8 per-channel GEMMs accumulate in the FP8
                                               MMA's own precision (on, as vLLM's sm90 kernels)
                                               or promote to fp32 periodically (off); read
                                               when a model loads
TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS 384        FP8 products of o_proj / down_proj with at most
                                               this many rows (decode batches) leave their
                                               per-token x per-channel scales to the RMSNorm
                                               kernel that consumes them, so the GEMM runs
                                               cuBLASLt's faster unit-scale kernel (0: off);
                                               read when a model loads
TANDEM_CPU_STEP_THREAD              on         CPU steps run on a worker thread, overlapping
                                               the caller's output processing (on), or inline
                                               (off); read when a worker is built
TANDEM_MLA_PREFILL                  auto       MLA prefill attention: auto (the Triton flash-
                                               attention kernel on CUDA), triton, torch (the
                                               masked-SDPA reference); read when a layer is built
TANDEM_PP_LAYER_PARTITION           unset      decoder layers per pipeline stage, comma-separated
                                               (e.g. ``12,10,10``; they must sum to the model's
                                               layers); unset: as even as can be, the extra
                                               layers on the stages before the last (vLLM's
                                               VLLM_PP_LAYER_PARTITION)
TANDEM_STARTUP_TIMEOUT_S            1800       seconds spawned ranks may take to build engines
TANDEM_HOST_JOIN_TIMEOUT_S          600        seconds the head waits for every --headless host
                                               to join (and a headless host for the head)
TANDEM_HOST_HEARTBEAT_TIMEOUT_S     4          seconds of silence after which the head and a
                                               headless host take each other for gone
TANDEM_DUMP_STACKS_AFTER_S          unset      every spawned rank prints its stacks after this
                                               many seconds (debugging a hang)
TANDEM_STRUCTURED_OUTPUT_THREADS    min(8,     threads xgrammar uses in an engine core to fill
                                    CPUs / 2)  each step's grammar bitmask and to compile
                                               grammars (a positive integer)
TANDEM_CACHE_ROOT                   see        folder of Tandem's caches (converted GGUF files,
                                    meaning    evaluation data): ``$XDG_CACHE_HOME/tandem``, else
                                               ``~/.cache/tandem`` (vLLM's VLLM_CACHE_ROOT)
TANDEM_EVAL_CACHE                   unset      folder for downloaded evaluation data
                                               (unset: ``$TANDEM_CACHE_ROOT/eval``)
TANDEM_MMLU_FILE                    unset      an MMLU jsonl file to use instead of downloading
TANDEM_ASDIV_FILE                   unset      an ASDiv jsonl file to use instead of downloading
TANDEM_API_KEY                      unset      the key ``tandem serve`` requires on its /v1
                                               routes when no --api-key is given (vLLM's
                                               VLLM_API_KEY)
TANDEM_QWEN_GGUF                    unset      (tests) a Qwen GGUF file for the opt-in
                                               real-weights tests
==================================  =========  ==================================================

Variables of other libraries that an engine sets in its process when they are unset
(:func:`set_library_cache_limits`; a value set by the user wins):

==================================  =========  ==================================================
ONEDNN_PRIMITIVE_CACHE_CAPACITY     64         oneDNN's cache of created primitives (its
                                               default: 1024)
LRU_CACHE_CAPACITY                  64         PyTorch's ideep cache of oneDNN computations (its
                                               default: 1024)
MALLOC_ARENA_MAX                    2          glibc's malloc arenas of an engine-core process
                                               (its default: 8 per CPU); applied with
                                               ``mallopt`` (:func:`core_malloc_arena_max`),
                                               glibc reads the variable only at process start
GOMP_SPINCOUNT                      10000      spins of an idle OpenMP (libgomp) worker before
                                               it sleeps (its default: 300000); set when
                                               ``tandem`` is imported, read by libgomp when
                                               torch loads (:func:`set_openmp_spin_count`)
==================================  =========  ==================================================

Both oneDNN caches are keyed by shape: a CPU bfloat16 GEMM gets one entry per row count and
weight shape, so a server whose steps vary in token count (every prompt length) fills them
to their capacity and churns the heap. Each thread of a core that allocates (the loop, the
step thread, the grammar threads) otherwise gets an arena of its own, which keeps the free
memory of its largest step (the measurements: benchmarks/RESULTS.md, "engine core memory").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

MOE_IMPLS = ("auto", "grouped_mm", "padded_bmm", "triton", "loop")
FUSED_OPS_MODES = ("auto", "triton", "torch", "cpu")
ON_OFF = ("on", "off")
MOE_ROUTER_IMPLS = ("auto", "triton", "torch")
MLA_PREFILL_MODES = ("auto", "triton", "torch")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        raw = os.environ.get(name, default).strip()
        value = raw.lower() or default
        if value not in choices:
            raise ValueError(f"{name}={raw!r}: expected one of {choices}")
        return value

    return read


def _log_level() -> str | None:
    level = os.environ.get("TANDEM_LOGGING_LEVEL", "").strip().upper()
    if not level:
        return None
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"TANDEM_LOGGING_LEVEL must be a logging level (DEBUG, INFO, WARNING, ERROR), got {level!r}")
    return level


def _float(name: str, default: float | None) -> Callable[[], float | None]:
    def read() -> float | None:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return default
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None

    return read


def _int_at_least(name: str, default: Callable[[], int], minimum: int) -> Callable[[], int]:
    def read() -> int:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return default()
        try:
            value = int(raw)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
        return value

    return read


def _half_the_cpus_up_to_8() -> int:
    """vLLM's default for its structured-output fill pool: the mask fill shares the host
    with the engine loop, the front end and the tokenizer."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def _layer_partition() -> tuple[int, ...] | None:
    raw = os.environ.get("TANDEM_PP_LAYER_PARTITION", "").strip()
    if not raw:
        return None
    try:
        counts = tuple(int(c) for c in raw.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"TANDEM_PP_LAYER_PARTITION={raw!r}: give positive layer counts per stage, "
                         f"comma-separated (e.g. 12,10,10)")
    return counts


def _cache_root() -> str:
    root = os.environ.get("TANDEM_CACHE_ROOT")
    if root:
        return os.path.expanduser(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tandem")


def _path(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


_READERS: dict[str, Callable[[], Any]] = {
    "TANDEM_LOGGING_LEVEL": _log_level,
    "TANDEM_MOE_IMPL": _choice("TANDEM_MOE_IMPL", "auto", MOE_IMPLS),
    "TANDEM_MOE_ROUTER": _choice("TANDEM_MOE_ROUTER", "auto", MOE_ROUTER_IMPLS),
    "TANDEM_FUSED_OPS": _choice("TANDEM_FUSED_OPS", "auto", FUSED_OPS_MODES),
    "TANDEM_FP8_FUSED_QUANT": _choice("TANDEM_FP8_FUSED_QUANT", "on", ON_OFF),
    "TANDEM_FP8_FAST_ACCUM": _choice("TANDEM_FP8_FAST_ACCUM", "on", ON_OFF),
    "TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS": _int_at_least("TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS", lambda: 384, 0),
    "TANDEM_CPU_STEP_THREAD": _choice("TANDEM_CPU_STEP_THREAD", "on", ON_OFF),
    "TANDEM_MLA_PREFILL": _choice("TANDEM_MLA_PREFILL", "auto", MLA_PREFILL_MODES),
    "TANDEM_PP_LAYER_PARTITION": _layer_partition,
    "TANDEM_STARTUP_TIMEOUT_S": _float("TANDEM_STARTUP_TIMEOUT_S", 1800.0),
    "TANDEM_HOST_JOIN_TIMEOUT_S": _float("TANDEM_HOST_JOIN_TIMEOUT_S", 600.0),
    "TANDEM_HOST_HEARTBEAT_TIMEOUT_S": _float("TANDEM_HOST_HEARTBEAT_TIMEOUT_S", 4.0),
    "TANDEM_DUMP_STACKS_AFTER_S": _float("TANDEM_DUMP_STACKS_AFTER_S", None),
    "TANDEM_STRUCTURED_OUTPUT_THREADS": _int_at_least("TANDEM_STRUCTURED_OUTPUT_THREADS", _half_the_cpus_up_to_8, 1),
    "TANDEM_CACHE_ROOT": _cache_root,
    "TANDEM_EVAL_CACHE": _path("TANDEM_EVAL_CACHE"),
    "TANDEM_MMLU_FILE": _path("TANDEM_MMLU_FILE"),
    "TANDEM_ASDIV_FILE": _path("TANDEM_ASDIV_FILE"),
    # Stripped as --api-key's keys are: a header value cannot carry surrounding whitespace.
    "TANDEM_API_KEY": lambda: os.environ.get("TANDEM_API_KEY", "").strip() or None,
    "TANDEM_QWEN_GGUF": _path("TANDEM_QWEN_GGUF"),
}


# Entries of each shape-keyed oneDNN cache. A step uses about five (the distinct weight
# shapes of its GEMMs for one row count), so 64 keeps the last dozen row counts; a miss
# costs one primitive creation (RESULTS, "engine core memory").
LIBRARY_CACHE_LIMITS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def set_library_cache_limits() -> None:
    """Bound oneDNN's shape-keyed caches in this process (:data:`LIBRARY_CACHE_LIMITS`,
    where unset). The libraries read them when they first create a primitive, so this
    must run before the process's first CPU GEMM in bfloat16 (an engine calls it before
    loading its model); later it changes nothing."""
    for name, value in LIBRARY_CACHE_LIMITS.items():
        os.environ.setdefault(name, value)


# Decode steps run thousands of small parallel kernels a few microseconds apart: a worker
# that sleeps between them costs a wake-up each (~100 spins: 0.65x the tokens/s of 10^4),
# one that spins ~3 ms (libgomp's default) starves the other processes of a loaded machine
# and stalls its own team when they preempt it (RESULTS, "one OpenMP team").
OPENMP_SPIN_COUNT = "10000"


def set_openmp_spin_count() -> None:
    """Set ``GOMP_SPINCOUNT`` to :data:`OPENMP_SPIN_COUNT` where unset (``tandem`` does on
    import). libgomp reads it when it loads, with torch: a process that imported torch
    before keeps libgomp's default, the processes it spawns (engine cores, ranks) get this."""
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


# An engine core's arenas: its threads allocate in turn (the step thread between the loop's
# waits), so two arenas cost no contention while bounding the free memory they keep.
CORE_MALLOC_ARENA_MAX = 2


def core_malloc_arena_max() -> int | None:
    """The malloc arena limit an engine-core process sets at its start; None when the user
    set ``MALLOC_ARENA_MAX`` (glibc applied it when the process started)."""
    return None if os.environ.get("MALLOC_ARENA_MAX", "").strip() else CORE_MALLOC_ARENA_MAX


def __getattr__(name: str) -> Any:
    reader = _READERS.get(name)
    if reader is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return reader()


def __dir__() -> list[str]:
    return sorted(_READERS)
