"""Which FP8 scheme a model runs, from --quantization and its quantization_config; the
errors that name an unsupported method, format or scheme."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from tandem.layers.quantization.config import Fp8Config, get_quantization_config
from tests.layers.quantization.fp8_checkpoints import QUANTIZATION_CONFIGS


def _cfg(qc=None):
    return SimpleNamespace(quantization_config=copy.deepcopy(qc)) if qc is not None else SimpleNamespace()


def test_unquantized_and_online():
    assert get_quantization_config(_cfg(), None) is None
    assert get_quantization_config(_cfg(), "fp8") == Fp8Config()
    # Dummy weights are quantized online whatever the config says.
    assert get_quantization_config(_cfg(QUANTIZATION_CONFIGS["fp8-block"]), "fp8", "dummy") == Fp8Config()
    assert get_quantization_config(_cfg(QUANTIZATION_CONFIGS["fp8-block"]), None, "dummy") is None


@pytest.mark.parametrize("qc, quantization", [(None, "fp8"), ("fp8-block", None), ("ct-channel-dynamic", None)])
def test_fp8_weights_are_refused_in_deterministic_mode(qc, quantization):
    """The FP8 GEMMs are not batch-invariant: an FP8 scheme, asked for or the checkpoint's,
    is refused with one line; an unquantized run is not."""
    cfg = _cfg(QUANTIZATION_CONFIGS[qc] if qc else None)
    with pytest.raises(ValueError, match="deterministic=True is not supported with FP8 weights"):
        get_quantization_config(cfg, quantization, deterministic=True)
    assert get_quantization_config(_cfg(), None, deterministic=True) is None


@pytest.mark.parametrize("fmt, block, static, scale_name, method", [
    ("ct-channel-dynamic", None, False, "weight_scale", "compressed-tensors"),
    ("ct-tensor-static", None, True, "weight_scale", "compressed-tensors"),
    ("ct-block", (128, 128), False, "weight_scale", "compressed-tensors"),
    ("fp8-block", (128, 128), False, "weight_scale_inv", "fp8"),
    ("fp8-tensor-static", None, True, "weight_scale", "fp8"),
])
def test_checkpoint_formats(fmt, block, static, scale_name, method):
    for quantization in (None, "fp8", method):
        cfg = get_quantization_config(_cfg(QUANTIZATION_CONFIGS[fmt]), quantization)
        assert cfg.checkpoint_is_fp8 and cfg.weight_block == block and cfg.static_input_scale == static
        assert cfg.weight_scale_name == scale_name and cfg.method == method


def _ct(**changes):
    qc = copy.deepcopy(QUANTIZATION_CONFIGS["ct-channel-dynamic"])
    group = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        where, _, field = key.partition("__")
        if field:
            group[where][field] = value
        elif where in group:
            group[where] = value
        else:
            qc[where] = value
    return qc


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    (_ct(format="pack-quantized"), "format 'pack-quantized'"),
    (_ct(weights__type="int"), "weights"),
    (_ct(weights__num_bits=4), "weights"),
    (_ct(input_activations=None), "weight-only"),
    (_ct(weights__strategy="group", weights__group_size=128), "weight strategy 'group'"),
    (_ct(targets=["Attention"]), "targets"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False,
                          "symmetric": True}), "kv_cache_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "dynamic"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
])
def test_unsupported_schemes_name_the_field(qc, match):
    with pytest.raises(ValueError, match=match):
        get_quantization_config(_cfg(qc), None)


def test_bad_quantization_argument():
    with pytest.raises(ValueError, match="quantization must be one of"):
        get_quantization_config(_cfg(), "awq")
    with pytest.raises(ValueError, match="needs a checkpoint with a compressed-tensors"):
        get_quantization_config(_cfg(), "compressed-tensors")
    with pytest.raises(ValueError, match="quant_method='awq'"):
        get_quantization_config(_cfg({"quant_method": "awq"}), "fp8")


def test_ignore_patterns():
    cfg = Fp8Config(ignore=("lm_head", "re:.*layers\\.3\\..*"))
    assert cfg.is_ignored(["layers.3.mlp.down_proj"]) and cfg.is_ignored(["lm_head"])
    assert not cfg.is_ignored(["layers.2.mlp.down_proj"])
    partial = Fp8Config(ignore=("model.layers.0.self_attn.q_proj",))
    with pytest.raises(ValueError, match="part of the fused layer"):
        partial.is_ignored(["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj"])


def test_static_fp8_kv_cache_scheme_is_accepted():
    qc = _ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                              "symmetric": True})
    assert get_quantization_config(_cfg(qc), None).method == "compressed-tensors"
