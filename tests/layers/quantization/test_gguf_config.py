"""--quantization gguf / none: when a GGUF file runs quantized, the errors naming the
field, and the weights mode of the speed line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.layers.quantization.config import GGUFQuantConfig, get_gguf_config, get_quantization_config, weights_mode

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


@pytest.mark.parametrize("kwargs, expected", [
    ({}, "gguf int4 + {auto}"),
    ({"dtype": "float32"}, "float32"),
    ({"quantization": "none", "dtype": "bfloat16"}, "bfloat16"),
    ({"quantization": "gguf", "dtype": "float32"}, "gguf int4 + float32"),
    ({"deterministic": True}, "{auto}"),
])
def test_weights_mode(embedded_model_path, kwargs, expected):
    import torch

    from tandem.engine.arg_utils import EngineArgs
    from tandem.platform import auto_dtype

    cfg = EngineArgs(model=embedded_model_path, device="cpu", **kwargs).create_engine_config()
    auto = str(auto_dtype(torch.device("cpu"), embedded_model_path)).removeprefix("torch.")
    assert weights_mode(cfg) == expected.format(auto=auto)


def test_weights_mode_names_a_checkpoints_fp8_scheme(tmp_path):
    import json

    from tandem.engine.arg_utils import EngineArgs
    from tests.layers.quantization.fp8_checkpoints import QUANTIZATION_CONFIGS

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 128,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
              "quantization_config": QUANTIZATION_CONFIGS["ct-channel-dynamic"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = EngineArgs(model=str(tmp_path), device="cpu", load_format="dummy", tokenizer=None).create_engine_config()
    assert weights_mode(cfg) == "compressed-tensors"
