"""Shared fixtures: the embedded model's engine is loaded once per test session."""

from __future__ import annotations

import os
import platform
import sys

# The Triton interpreter's tl.dot is numpy's matmul. OpenBLAS's FMA kernels for Haswell and Zen
# CPUs round an output row differently by its position in the tile, so in the interpreter a
# token's bits would depend on its neighbours in a batch (on a GPU they do not); its AVX kernel
# does not (tests/test_triton_utils.py checks it). It is read when numpy loads: set before torch.
if platform.machine() == "x86_64" and "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402

import tandem  # noqa: F401 - before torch, as in a user's process: sets GOMP_SPINCOUNT (tandem.envs)
import torch  # noqa: E402


def pytest_sessionstart(session) -> None:
    """Build the CPU's C++ kernels once, in this process, before any test: the first engine
    would build them otherwise, possibly in a rank process a test then kills mid-build, which
    leaves torch's build lock behind for every later engine to wait on."""
    from tandem.layers import cpu_ops

    cpu_ops.available()


@pytest.fixture(autouse=True, scope="module")
def _unfreeze_heap_after_module():
    """Engine cores freeze the heap (tandem.engine.core.freeze_startup_heap) and unfreeze it
    when the last one shuts down; tests that drop an engine without shutting it down would
    keep every later engine's reference cycles frozen, so memory would grow over the run."""
    yield
    import gc

    gc.unfreeze()


_GUARDED_ENV_PREFIXES = ("TANDEM_", "TRITON_")


def _guarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_GUARDED_ENV_PREFIXES)}


@pytest.fixture(autouse=True)
def _no_leaked_settings():
    """A test (or the code it runs in this process) that changes a Tandem or Triton
    environment variable without restoring it fails here, and the variable is put back:
    every process started later inherits the environment (a leaked
    ``TANDEM_FUSED_OPS=triton`` once ran every later server's norms in the Triton
    interpreter)."""
    env = _guarded_env()
    yield
    after = _guarded_env()
    changed = {k: (env.get(k), after.get(k)) for k in env.keys() | after.keys() if env.get(k) != after.get(k)}
    for k, (before, _) in changed.items():
        if before is None:
            os.environ.pop(k)
        else:
            os.environ[k] = before
    assert not changed, f"the test left environment variables changed (before, after): {changed}"


if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on the CPU; it is chosen when a kernel is
    # defined, so it must be set before any test module imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def embedded_model_path() -> str:
    from tandem.config import embedded_default_model

    return embedded_default_model()


@pytest.fixture(scope="session")
def smol_tokenizer(embedded_model_path):
    from tandem.model_loader.loader import load_tokenizer

    return load_tokenizer(embedded_model_path)


@pytest.fixture(scope="session")
def moe_fixture_path(tmp_path_factory):
    """The real-text Mixtral whose experts copy the embedded SmolLM2's MLP
    (tests/models/moe_fixture.py), built once a session; removed at its end (1.4 GB)."""
    import shutil

    from tests.models.moe_fixture import build_moe_fixture

    path = build_moe_fixture(str(tmp_path_factory.mktemp("moe_fixture")))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def assert_all_blocks_free(engine) -> None:
    """Every KV block is back in the free queue (block 0 is the reserved null block)."""
    pool = engine.kv_manager.pool
    assert not engine.scheduler.requests, "requests left in the scheduler"
    assert not engine.kv_manager.req_blocks, "sequences still hold blocks"
    assert pool.num_free_blocks == pool.num_blocks - 1


def make_llm(**kwargs):
    """The embedded model with a small KV cache, in fp32, unless told otherwise.

    fp32 because these tests compare token ids exactly: against transformers' fp32
    reference and across batch shapes (bf16 GEMMs round differently per row count). The
    bf16 default of CPUs with native bf16 is tested in tests/test_platform.py.
    """
    from tandem.entrypoints.llm import LLM

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("max_model_len", 1024)
    return LLM(**kwargs)


PROMPTS = [
    "The capital of France is",
    "Here is the English alphabet: ABC",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Translate to French: I like cheese. ->",
    "The three primary colors are",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
]
