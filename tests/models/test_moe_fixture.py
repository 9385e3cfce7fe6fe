"""The real-text MoE fixture (tests/models/moe_fixture.py): a Mixtral whose experts copy the
embedded SmolLM2's MLP computes the dense model's function, so offline greedy decoding gives
the dense model's tokens, while its seeded random routers spread the tokens over every expert."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import PROMPTS, make_llm
from tests.models.moe_fixture import NUM_EXPERTS, TOP_K

MAX_TOKENS = 32
# Logprob of each greedy token, MoE vs dense: the MoE sums the same MLP output weighted by
# w_1 + w_2 = 1 (rounded), so they differ by fp32 rounding only (measured <= 1.3e-5 on the
# eight tests/conftest.py prompts).
LOGPROB_ATOL = 1e-4


def _tensors(folder: str, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]
    out = {}
    for name in names:
        with safe_open(os.path.join(folder, where[name]), framework="pt") as sf:
            out[name] = sf.get_tensor(name)
    return out


def test_fixture_experts_copy_the_dense_mlp(moe_fixture_path, embedded_model_path):
    from tandem.model_loader.loader import iterate_gguf_weights_cached, load_hf_config

    cfg = load_hf_config(moe_fixture_path)
    assert (cfg.model_type, cfg.num_local_experts, cfg.num_experts_per_tok) == ("mixtral", NUM_EXPERTS, TOP_K)
    layers = (0, cfg.num_hidden_layers - 1)
    dense = {n: t for n, t in iterate_gguf_weights_cached(embedded_model_path, load_hf_config(embedded_model_path))
             if n.startswith(tuple(f"model.layers.{i}." for i in layers))}
    for i in layers:
        p = f"model.layers.{i}.mlp"
        moe = _tensors(moe_fixture_path, [f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj", f"{p}.gate.weight",
                                          f"model.layers.{i}.self_attn.q_proj.weight"])
        gate_up = torch.cat([dense[f"{p}.gate_proj.weight"], dense[f"{p}.up_proj.weight"]])
        for e in range(NUM_EXPERTS):
            assert torch.equal(moe[f"{p}.experts.gate_up_proj"][e], gate_up)
            assert torch.equal(moe[f"{p}.experts.down_proj"][e], dense[f"{p}.down_proj.weight"])
        assert torch.equal(moe[f"model.layers.{i}.self_attn.q_proj.weight"],
                           dense[f"model.layers.{i}.self_attn.q_proj.weight"])
        router = moe[f"{p}.gate.weight"]
        assert router.shape == (NUM_EXPERTS, cfg.hidden_size) and torch.linalg.matrix_rank(router) == NUM_EXPERTS


def _record_routing(llm) -> dict[int, list[torch.Tensor]]:
    """Hook every router of the in-process engine core's model: layer -> its top-k ids per step."""
    from tandem.layers.moe import TopKRouter

    seen: dict[int, list[torch.Tensor]] = {}
    routers = [m for m in llm.engine.client.core.model.modules() if isinstance(m, TopKRouter)]
    for layer, router in enumerate(routers):
        router.register_forward_hook(lambda mod, args, out, layer=layer: seen.setdefault(layer, []).append(out[0]))
    assert routers, "the model has no router"
    return seen


def _greedy(model: str, record: bool = False):
    from tandem.sampling_params import SamplingParams

    llm = make_llm(model=model, max_model_len=256)
    try:
        routing = _record_routing(llm) if record else None
        outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                        logprobs=0), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [o.outputs[0] for o in outs], routing


@pytest.mark.slow
def test_moe_fixture_gives_the_dense_greedy_tokens(moe_fixture_path, embedded_model_path):
    """fp32: every continuation identical, and each token's logprob within LOGPROB_ATOL; the
    routers chose every expert, in several pairs, in every layer."""
    moe, routing = _greedy(moe_fixture_path, record=True)
    dense, _ = _greedy(embedded_model_path)
    for m, d in zip(moe, dense):
        assert m.token_ids == d.token_ids
        got = torch.tensor([lp[t].logprob for lp, t in zip(m.logprobs, m.token_ids)])
        want = torch.tensor([lp[t].logprob for lp, t in zip(d.logprobs, d.token_ids)])
        torch.testing.assert_close(got, want, rtol=0, atol=LOGPROB_ATOL)
    from tandem.model_loader.loader import load_hf_config

    assert len(routing) == load_hf_config(moe_fixture_path).num_hidden_layers
    for layer, ids in routing.items():
        ids = torch.cat(ids)
        assert set(ids.flatten().tolist()) == set(range(NUM_EXPERTS)), layer
        assert len({tuple(sorted(p)) for p in ids.tolist()}) >= 3, layer
