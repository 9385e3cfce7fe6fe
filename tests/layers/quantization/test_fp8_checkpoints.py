"""FP8 checkpoints in each published layout (tests/layers/quantization/fp8_checkpoints.py)
load into a tiny Llama and a tiny Qwen3-MoE: the weights equal the dequantized checkpoint
exactly, and the logits are those of transformers running the dequantized weights within
the FP8 activation tolerance below. Online quantization (``--quantization fp8``) of a
bf16/fp32 or dummy model, and the errors for missing scales and unsupported schemes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.layers.linear import ColumnShardedLinear, RowParallelLinear
from tandem.layers.moe import FusedMoE
from tandem.layers.quantization.config import Fp8Config, get_quantization_config
from tandem.layers.quantization.fp8 import FP8_DTYPE, dequantize_weight
from tandem.model_loader.loader import build_model, load_hf_config
from tests.layers.quantization.fp8_checkpoints import FORMATS, fake_quantize_activations, write_fp8_checkpoint
from tests.models.paged_parity import step_metadata

COMMON = dict(vocab_size=300, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-6)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, intermediate_size=384, tie_word_embeddings=False),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=384, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[0]),
}
# Logits vs transformers on the dequantized weights, as a fraction of the logit range:
# with the activations rounded as the FP8 GEMM rounds them (fake_quantize_activations:
# the exact W8A8 reference) within 1% (measured <= 0.25%: fp32 summation order can flip
# an activation's FP8 rounding); without (the FP8 activation error itself: e4m3 keeps 3
# mantissa bits) within 10% (measured 4-7% on these 2-layer models).
W8A8_TOL = 0.01
DEQUANT_TOL = 0.1


def _reference(name: str):
    cfg = CONFIGS[name]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if "norm" not in pname:
                p.normal_(0, 0.05)
    return ref


def _load_dequantized(ref, deq: dict[str, torch.Tensor]):
    """transformers' model holding the dequantized checkpoint weights (experts restacked)."""
    state = ref.state_dict()
    for key in state:
        if key.endswith("experts.gate_up_proj"):
            base, e = key.removesuffix("gate_up_proj"), state[key].shape[0]
            state[key] = torch.stack([torch.cat([deq[f"{base}{i}.gate_proj.weight"], deq[f"{base}{i}.up_proj.weight"]])
                                      for i in range(e)])
        elif key.endswith("experts.down_proj"):
            base = key.removesuffix("down_proj")
            state[key] = torch.stack([deq[f"{base}{i}.down_proj.weight"] for i in range(state[key].shape[0])])
        else:
            state[key] = deq[key]
    ref.load_state_dict(state)
    return ref


def _tandem(folder: str, quantization: str | None = None, load_format: str = "auto", dtype=torch.float32):
    cfg = load_hf_config(folder)
    quant = get_quantization_config(cfg, quantization, load_format)
    return build_model(cfg, folder, load_format, TorchAttentionBackend(), dtype, torch.device("cpu"),
                       max_positions=128, quant_config=quant)


def _prefill_logits(model, prompts: list[list[int]], kv_dtype=torch.float32) -> torch.Tensor:
    heads, dim = model.kv_cache_shape_per_block
    bs = 8
    kv = [torch.zeros(2, 32, bs, heads, dim, dtype=kv_dtype) for _ in model.layers]
    tables, nxt = [], 1
    for p in prompts:
        n = -(-len(p) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    meta = step_metadata([len(p) for p in prompts], [0] * len(prompts), tables, bs)
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, kv, meta))


def _assert_close_logits(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    span = (want.max() - want.min()).item()
    err = (got - want).abs().max().item()
    assert err <= tol * span, f"max |logit error| {err:.4f} > {tol} x logit range {span:.3f}"


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (13, 7, 20)]


def _dequantized_weights(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnShardedLinear, RowParallelLinear)):
            assert mod.weight.dtype == FP8_DTYPE, name
            out[name] = dequantize_weight(mod.weight, mod.weight_scale, mod.weight_block, torch.float32)
        elif isinstance(mod, FusedMoE):
            assert mod.w13.dtype == FP8_DTYPE and mod.w2.dtype == FP8_DTYPE, name
            out[name + ".w13"] = dequantize_weight(mod.w13, mod.w13_weight_scale, mod.weight_block, torch.float32)
            out[name + ".w2"] = dequantize_weight(mod.w2, mod.w2_weight_scale, mod.weight_block, torch.float32)
    return out


def _expected_weights(model, deq: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dequantized checkpoint fused the way Tandem's layers hold it."""
    out = {}
    for name, mod in model.named_modules():
        ck = "model." + name
        if name.endswith("qkv_proj"):
            out[name] = torch.cat([deq[ck.replace("qkv_proj", p) + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])
        elif name.endswith("gate_up_proj"):
            out[name] = torch.cat([deq[ck.replace("gate_up_proj", p) + ".weight"] for p in ("gate_proj", "up_proj")])
        elif isinstance(mod, (ColumnShardedLinear, RowParallelLinear)):
            out[name] = deq[ck + ".weight"]
        elif isinstance(mod, FusedMoE):
            e = mod.num_experts
            out[name + ".w13"] = torch.stack([torch.cat([deq[f"{ck}.{i}.gate_proj.weight"],
                                                         deq[f"{ck}.{i}.up_proj.weight"]]) for i in range(e)])
            out[name + ".w2"] = torch.stack([deq[f"{ck}.{i}.down_proj.weight"] for i in range(e)])
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_checkpoint_loads_dequantized_weights_and_logits(arch, fmt, tmp_path):
    ref = _reference(arch)
    deq = write_fp8_checkpoint(ref, str(tmp_path), fmt)
    model = _tandem(str(tmp_path))
    got, want = _dequantized_weights(model), _expected_weights(model, deq)
    assert got.keys() == want.keys() and got
    for name in got:
        assert torch.equal(got[name], want[name]), name
    if fmt.endswith("static"):
        assert all(m.input_scale is not None for m in model.modules() if isinstance(m, ColumnShardedLinear))
    # Only per-channel layers with dynamic activation scales take their input quantized by
    # the norm / SiLU-and-mul kernel producing it.
    linears = [m for m in model.modules() if isinstance(m, (ColumnShardedLinear, RowParallelLinear))]
    assert all(m.takes_quantized_input == (fmt == "ct-channel-dynamic") for m in linears)
    ref = _load_dequantized(ref, deq)
    prompts = _prompts(ref.config.vocab_size)
    got = _prefill_logits(model, prompts)
    _assert_close_logits(got, _hf_logits(ref, prompts), DEQUANT_TOL)
    hooks = fake_quantize_activations(ref, fmt, deq)
    _assert_close_logits(got, _hf_logits(ref, prompts), W8A8_TOL)
    for h in hooks:
        h.remove()


def _hf_logits(ref, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts])


def test_tolerance_is_tight_enough_to_catch_a_wrong_scale(tmp_path):
    """The W8A8 tolerance rejects a model whose one layer's scales are off by 2x."""
    ref = _reference("llama")
    deq = write_fp8_checkpoint(ref, str(tmp_path), "ct-channel-dynamic")
    model = _tandem(str(tmp_path))
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight_scale.mul_(2.0)
    ref = _load_dequantized(ref, deq)
    fake_quantize_activations(ref, "ct-channel-dynamic", deq)
    prompts = _prompts(ref.config.vocab_size)
    with pytest.raises(AssertionError):
        _assert_close_logits(_prefill_logits(model, prompts), _hf_logits(ref, prompts), W8A8_TOL)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_online_quantization_of_a_full_precision_checkpoint(arch, tmp_path):
    ref = _reference(arch)
    ref.save_pretrained(tmp_path)
    model = _tandem(str(tmp_path), quantization="fp8")
    full = _tandem(str(tmp_path))
    w = _dequantized_weights(model)
    for name, mod in full.named_modules():  # per-channel: within half an e4m3 ulp of the original
        if isinstance(mod, (ColumnShardedLinear, RowParallelLinear)):
            orig = mod.weight.float()
            assert (w[name] - orig).abs().le(orig.abs() * 2**-4 + 1e-6).all(), name
    prompts = _prompts(ref.config.vocab_size)
    _assert_close_logits(_prefill_logits(model, prompts), _prefill_logits(full, prompts), DEQUANT_TOL)


def test_online_quantization_of_dummy_weights(tmp_path):
    ref = _reference("qwen3_moe")
    ref.config.save_pretrained(tmp_path)
    model = _tandem(str(tmp_path / "config.json"), quantization="fp8", load_format="dummy")
    full = _tandem(str(tmp_path / "config.json"), load_format="dummy")
    assert model.layers[1].mlp.experts.w13.dtype == FP8_DTYPE
    prompts = _prompts(ref.config.vocab_size)
    _assert_close_logits(_prefill_logits(model, prompts), _prefill_logits(full, prompts), DEQUANT_TOL)


def test_missing_scale_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    write_fp8_checkpoint(_reference("llama"), str(tmp_path), "fp8-block")
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, f)
    with pytest.raises(ValueError, match="lacks .*o_proj"):
        _tandem(str(tmp_path))


def test_fp8_weights_without_fp8_config_are_an_error(tmp_path):
    """An FP8 checkpoint whose config lost its quantization_config: the scale tensors match
    no parameter (never a silent cast of the FP8 bytes)."""
    import json

    write_fp8_checkpoint(_reference("llama"), str(tmp_path), "ct-channel-dynamic")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_hf_config.cache_clear()
    with pytest.raises(ValueError, match="weight_scale"):
        _tandem(str(tmp_path))


@pytest.mark.parametrize("fmt", ["ct-channel-dynamic", "fp8-block"])
def test_ignored_layers_stay_in_model_dtype(fmt, tmp_path):
    ref = _reference("llama")
    deq = write_fp8_checkpoint(ref, str(tmp_path), fmt, keep=r"model\.layers\.0\.mlp\.")
    model = _tandem(str(tmp_path))
    mlp = model.layers[0].mlp
    assert mlp.gate_up_proj.weight.dtype == torch.float32 and mlp.down_proj.weight.dtype == torch.float32
    assert torch.equal(mlp.down_proj.weight, deq["model.layers.0.mlp.down_proj.weight"])
    assert model.layers[1].mlp.down_proj.weight.dtype == FP8_DTYPE


def test_kv_cache_scales_from_the_checkpoint(tmp_path):
    """Per-layer k_scale / v_scale tensors (compressed-tensors kv_cache_scheme, and the older
    k_proj.output_scale names) set the attention layers' FP8 KV cache scales; layers
    without them keep 1.0."""
    import json

    from safetensors.torch import load_file, save_file

    write_fp8_checkpoint(_reference("llama"), str(tmp_path), "ct-channel-dynamic")
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([2.0])
    save_file(tensors, f)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_hf_config.cache_clear()
    model = _tandem(str(tmp_path))
    a0, a1 = model.layers[0].self_attn, model.layers[1].self_attn
    assert (a0.k_scale, a0.v_scale, a1.k_scale, a1.v_scale) == (0.5, 0.25, 2.0, 1.0)
    # An FP8 cache run with these scales stays close to the full-precision cache.
    prompts = _prompts(300)
    _assert_close_logits(_prefill_logits(model, prompts, torch.float8_e4m3fn), _prefill_logits(model, prompts),
                         DEQUANT_TOL)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_unquantized_layer_missing_from_ignore_is_an_error(arch, tmp_path):
    """A layer left in bf16 by the checkpoint but not listed in ``ignore`` is never cast
    into FP8 weights."""
    import json

    keep = r"model\.layers\.1\.mlp\." if arch == "llama" else r"model\.layers\.1\.mlp\.experts\.0\."
    write_fp8_checkpoint(_reference(arch), str(tmp_path), "ct-channel-dynamic", keep=keep)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_hf_config.cache_clear()
    with pytest.raises(ValueError, match="expects float8_e4m3fn"):
        _tandem(str(tmp_path))
