"""The CPU decode fast path (tandem.models.cpu_decode): on the embedded SmolLM2 GGUF (int4
layers, as CPUs without AVX512-VNNI load it; a layer's linears dense or GGUF blocks too; and
every layer GGUF blocks, the default with VNNI), its decode steps give the Python forward's hidden states and KV cache bit for bit,
a step of several generated tokens per request (speculative verification) gives the bits of
those tokens decoded one by one, it stands aside for steps it does not cover (prompt rows,
multi-token queries of unknown phase), the loader attaches it only to models it covers, and
inside the engine it runs and changes no token or logprob."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.distributed.forward_context import ForwardContext, RowPhases, forward_context
from tandem.layers.linear import QKVParallelLinear, RowParallelLinear
from tandem.layers.quantization import gguf_blocks
from tandem.layers.quantization.config import GGUFQuantConfig
from tandem.model_loader import loader
from tandem.models.cpu_decode import CpuDecode, build_cpu_decode
from tests.models.paged_parity import step_metadata

BLOCK = 16


def _build(path: str, mode: str = "cpu", deterministic: bool = False, load_format: str = "auto", int4: bool = True):
    """The model as the loader builds it; ``int4``: its GGUF layers int4 planes, as where the
    block kernel does not run."""
    backend = TorchAttentionBackend(deterministic, cpu_kernels=mode == "cpu")
    quant = GGUFQuantConfig(path) if load_format == "auto" else None
    with pytest.MonkeyPatch.context() as m:
        if int4:
            m.setattr(gguf_blocks, "available", lambda: False)
        return loader.build_model(loader.load_hf_config(path), path, load_format, backend, torch.bfloat16,
                                  torch.device("cpu"), max_positions=256, quant_config=quant, fused_ops_mode=mode)


@pytest.fixture(scope="module")
def model(embedded_model_path):
    return _build(embedded_model_path)


@pytest.fixture(scope="module")
def all_blocks_model(embedded_model_path):
    """The embedded model as CPUs with AVX512-VNNI load it: every layer GGUF blocks."""
    if not gguf_blocks.available():
        pytest.skip("the GGUF block kernel needs AVX512-VNNI")
    model = _build(embedded_model_path, int4=False)
    assert all(isinstance(m, gguf_blocks.GGUFBlockLinear) for m in _linears(model))
    return model


@pytest.fixture(scope="module")
def mixed_model(embedded_model_path):
    """The embedded model with one layer's qkv_proj (a column layer, given a bias) and
    down_proj (a row layer) dense, as GGUF types without int4 planes load (Q6_K)."""
    model = _build(embedded_model_path)
    layer, spec = model.layers[1], model.spec
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    dense_qkv = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, bias=True)
    dense_down = RowParallelLinear(down.in_features, down.out_features, bias=False)
    with torch.no_grad():
        dense_qkv.weight.copy_(qkv.dequantized_weight())
        dense_qkv.bias.copy_(torch.randn(qkv.out_features) * 0.1)
        dense_down.weight.copy_(down.dequantized_weight())
    layer.self_attn.qkv_proj, layer.mlp.down_proj = dense_qkv.to(torch.bfloat16), dense_down.to(torch.bfloat16)
    model.cpu_decode = build_cpu_decode(model)
    return model


@pytest.fixture(scope="module")
def blocks_model(embedded_model_path):
    """The embedded model with one layer's qkv_proj (given a bias) and down_proj as GGUF
    block layers (Q8_0 q and k, Q5_0 v; Q5_1), as the 5- and 8-bit types load where the block
    kernel runs."""
    import gguf

    from tandem.model_loader.gguf_weights import RawWeight

    if not gguf_blocks.available():
        pytest.skip("the GGUF block kernel needs AVX512-VNNI")
    model = _build(embedded_model_path)
    layer, spec = model.layers[1], model.spec
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj

    def raw(w: torch.Tensor, qtype) -> RawWeight:
        data = gguf.quants.quantize(w.float().numpy(), qtype)
        return RawWeight(data, qtype.name, w.shape[0], w.shape[1], None)

    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    w = qkv.dequantized_weight()
    T = gguf.GGMLQuantizationType
    parts = [raw(w[:q_size], T.Q8_0), raw(w[q_size:q_size + kv_size], T.Q8_0), raw(w[q_size + kv_size:], T.Q5_0)]
    bias = (torch.randn(qkv.out_features) * 0.1).to(torch.bfloat16)
    layer.self_attn.qkv_proj = gguf_blocks.GGUFBlockLinear.from_parts(parts, bias)
    dw = down.dequantized_weight()
    layer.mlp.down_proj = gguf_blocks.GGUFBlockLinear.from_parts([raw(dw, T.Q5_1)])
    model.cpu_decode = build_cpu_decode(model)
    return model


_MODELS = {"int4": "model", "int4-and-dense": "mixed_model", "int4-and-blocks": "blocks_model",
           "blocks": "all_blocks_model"}


def _linears(model) -> list[torch.nn.Module]:
    return [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _caches(model) -> list[torch.Tensor]:
    hk, d = model.kv_cache_shape_per_block
    return [torch.zeros(2, 40, BLOCK, hk, d, dtype=torch.bfloat16) for _ in range(model.num_stage_layers)]


def test_the_loader_attaches_it_to_an_int4_model_on_the_cpu_kernels(model):
    assert isinstance(model.cpu_decode, CpuDecode)


@pytest.mark.parametrize("which", list(_MODELS))
def test_decode_steps_give_the_python_forwards_bits(which, request, monkeypatch):
    model = request.getfixturevalue(_MODELS[which])
    fast = model.cpu_decode
    assert isinstance(fast, CpuDecode)
    runs = []
    forward = fast.forward
    monkeypatch.setattr(fast, "forward", lambda *a: runs.append(1) or forward(*a))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g) for n in (13, 8, 21)]
    tables = [[7, 3, 30], [12, 5, 1], [20, 9, 33]]  # scattered blocks
    kv = _caches(model)
    with torch.no_grad():
        meta = step_metadata([len(p) for p in prompts], [0, 0, 0], tables, BLOCK)
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        hidden = model(torch.cat(prompts), pos, kv, meta)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        ids = model.compute_logits(hidden[ends]).argmax(-1)
        kv_fast, kv_python = kv, [c.clone() for c in kv]
        computed = [len(p) for p in prompts]
        for _ in range(6):
            meta = step_metadata([1, 1, 1], computed, tables, BLOCK)
            pos = torch.tensor(computed)
            got = model(ids, pos, kv_fast, meta)
            model.cpu_decode = None
            try:
                want = model(ids, pos, kv_python, meta)
            finally:
                model.cpu_decode = fast
            assert torch.equal(got, want)
            assert all(torch.equal(a, b) for a, b in zip(kv_fast, kv_python))
            ids = model.compute_logits(got).argmax(-1)
            computed = [c + 1 for c in computed]
    assert len(runs) == 6


@pytest.mark.parametrize("which", list(_MODELS))
def test_verification_steps_give_the_bits_of_decoding_their_tokens_one_by_one(which, request):
    """Three requests each verifying 1 + 4 generated tokens in one step: the op's hidden
    states and cache are those of plain decode steps of the same tokens, and within bf16
    rounding of the Python forward's (which attends with SDPA, so not its bits)."""
    model = request.getfixturevalue(_MODELS[which])
    fast, (n, q) = model.cpu_decode, (3, 5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (m,), generator=g) for m in (13, 8, 21)][:n]
    tables = [[7, 3, 30], [12, 5, 1], [20, 9, 33]][:n]
    kv = _caches(model)
    with torch.no_grad():
        model(torch.cat(prompts), torch.cat([torch.arange(len(p)) for p in prompts]), kv,
              step_metadata([len(p) for p in prompts], [0] * n, tables, BLOCK))
        computed = [len(p) for p in prompts]
        ids = torch.randint(0, 49152, (n, q), generator=g)
        meta = step_metadata([q] * n, computed, tables, BLOCK)
        pos = torch.cat([torch.arange(c, c + q) for c in computed])
        kv_step, kv_python, kv_one_by_one = kv, [c.clone() for c in kv], [c.clone() for c in kv]
        phases = RowPhases.from_mask(np.ones(n * q, dtype=bool), torch.device("cpu"))
        with forward_context(ForwardContext(n * q, row_phases=phases)):
            assert fast.applies(torch.zeros(n * q, 576, dtype=torch.bfloat16), kv, meta)
            got = model(ids.flatten(), pos, kv_step, meta)
            model.cpu_decode = None
            try:
                python = model(ids.flatten(), pos, kv_python, meta)
            finally:
                model.cpu_decode = fast
        one_by_one = torch.stack([model(ids[:, i], torch.tensor(computed) + i, kv_one_by_one,
                                        step_metadata([1] * n, [c + i for c in computed], tables, BLOCK))
                                  for i in range(q)], dim=1).flatten(0, 1)
        assert torch.equal(got, one_by_one)
        assert all(torch.equal(a, b) for a, b in zip(kv_step, kv_one_by_one))
        rel = ((got.float() - python.float()).norm() / python.float().norm()).item()
        assert rel < 0.04, rel  # bf16 rounding of 30 layers' attention done two ways


def test_it_stands_aside_for_steps_it_does_not_cover(model):
    fast = model.cpu_decode
    kv = _caches(model)
    hidden = torch.zeros(2, 576, dtype=torch.bfloat16)
    decodes = step_metadata([1, 1], [4, 9], [[1], [2]], BLOCK)
    assert fast.applies(hidden, kv, decodes)
    # A one-token query that is a prompt's token (its last chunk): the int4 layers run it dense.
    phases = RowPhases.from_mask(np.array([True, False]), torch.device("cpu"))
    with forward_context(ForwardContext(2, row_phases=phases)):
        assert not fast.applies(hidden, kv, decodes)
    # Multi-token queries: a prefill chunk (or rows of unknown phase) no, generated tokens yes.
    mixed, four = step_metadata([1, 3], [4, 9], [[1], [2]], BLOCK), torch.zeros(4, 576, dtype=torch.bfloat16)
    assert not fast.applies(four, kv, mixed)
    for generated, covered in (([True] * 4, True), ([True, True, True, False], False)):
        phases = RowPhases.from_mask(np.array(generated), torch.device("cpu"))
        with forward_context(ForwardContext(4, row_phases=phases)):
            assert fast.applies(four, kv, mixed) == covered
    # Another dtype (an FP8 cache, a float32 forward).
    assert not fast.applies(hidden, [c.to(torch.float32) for c in kv], decodes)
    assert not fast.applies(hidden.float(), kv, decodes)


@pytest.mark.parametrize("kind", ["torch-mode", "deterministic", "dense-weights"])
def test_models_it_does_not_cover_keep_the_python_forward(embedded_model_path, kind):
    model = _build(embedded_model_path, mode="torch" if kind == "torch-mode" else "cpu",
                   deterministic=kind == "deterministic", load_format="dummy" if kind == "dense-weights" else "auto")
    assert model.cpu_decode is None
    assert build_cpu_decode(model) is None


def test_the_engine_runs_it_and_no_token_or_logprob_changes(embedded_model_path, monkeypatch):
    from tandem import LLM, SamplingParams

    llm = LLM(embedded_model_path, enable_prefix_caching=False, max_model_len=256)
    try:
        model = llm.engine.client.core.runner.model
        fast = model.cpu_decode
        assert isinstance(fast, CpuDecode)
        runs = []
        forward = fast.forward
        monkeypatch.setattr(fast, "forward", lambda *a: runs.append(1) or forward(*a))
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
        prompts = ["Write a short story about a robot.", "What is 2+2?", "List three colors."]

        def generate():
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                    for o in outs]

        with_op = generate()
        assert runs
        model.cpu_decode = None
        assert generate() == with_op
    finally:
        llm.engine.shutdown()
