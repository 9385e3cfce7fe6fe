"""--quantization gguf / none: when a GGUF file runs quantized, and the errors naming the
field (the weights mode of the speed line: tests/config/test_resolved.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.layers.quantization.config import GGUFQuantConfig, get_gguf_config, get_quantization_config

GGUF = "/models/x.Q4_K_M.gguf"


def test_default_is_gguf_for_a_gguf_on_the_cpu_at_dtype_auto():
    assert get_gguf_config(GGUF, None, "cpu") == GGUFQuantConfig(GGUF)
    assert get_gguf_config(GGUF, "gguf", "cpu", dtype="float32") == GGUFQuantConfig(GGUF)
    # An explicit dtype, CUDA, dummy weights, another format or "none": the dequantized path.
    assert get_gguf_config(GGUF, None, "cpu", dtype="float32") is None
    assert get_gguf_config(GGUF, None, "cuda") is None
    assert get_gguf_config(GGUF, None, "cpu", load_format="dummy") is None
    assert get_gguf_config("/models/folder", None, "cpu") is None
    assert get_gguf_config(GGUF, "none", "cpu") is None
    assert get_gguf_config(GGUF, "fp8", "cpu") is None
    assert get_gguf_config(GGUF, None, "cpu", deterministic=True) is None
    assert get_gguf_config(GGUF, None, "cpu", one_rank=False) is None  # tensor / pipeline / expert parallel


def test_gguf_where_it_cannot_run_is_a_value_error():
    with pytest.raises(ValueError, match="quantization='gguf' runs a GGUF file's weights"):
        get_gguf_config("/models/folder", "gguf", "cpu")
    with pytest.raises(ValueError, match="quantization='gguf' runs a GGUF file's weights"):
        get_gguf_config(GGUF, "gguf", "cpu", load_format="dummy")
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_gguf_config(GGUF, "gguf", "cuda")
    with pytest.raises(ValueError, match="not batch-invariant"):
        get_gguf_config(GGUF, "gguf", "cpu", deterministic=True)
    with pytest.raises(ValueError, match="runs on one rank; use quantization='none' with tensor/pipeline/expert"):
        get_gguf_config(GGUF, "gguf", "cpu", one_rank=False)


def test_gguf_and_none_are_not_fp8_schemes():
    plain = SimpleNamespace()
    assert get_quantization_config(plain, "gguf") is None
    assert get_quantization_config(plain, "none") is None
    fp8 = SimpleNamespace(quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(ValueError, match="quantization='none': the checkpoint is quantized"):
        get_quantization_config(fp8, "none")
