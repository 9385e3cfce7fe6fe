"""A real-text MoE checkpoint built from the embedded dense SmolLM2-135M: a Mixtral-format
Hugging Face folder whose every expert is a copy of the dense layer's SwiGLU MLP.

With identical experts and top-k routing renormalised over the chosen k, the MoE output
``sum_k w_k * mlp(x)`` equals ``mlp(x)`` (the weights sum to 1), so the MoE model computes the
dense model's function up to floating-point rounding, through real routing (a seeded random
router, so the chosen experts vary per token and layer) and, under expert parallelism, real
all-to-all exchanges. Attention, norms and embeddings are Llama's, which Mixtral shares, and
copy over unchanged.

The dense tensors come through Tandem's GGUF loading (dequantized to fp32, llama.cpp's q/k
row permutation undone: :func:`tandem.model_loader.loader.iterate_gguf_weights_cached`).
The folder is sharded one layer a file, so no more than one layer's copies of its experts
are held in memory beside the dense model while it is written (~1.5 GB of fp32 on disk for
4 experts).
"""

from __future__ import annotations

import json
import os
import re

import torch

NUM_EXPERTS = 4
TOP_K = 2
ROUTER_SEED = 0
# Router weights ~ N(0, (ROUTER_SCALE / sqrt(hidden))^2): on SmolLM2's text the logits then
# spread by ~0.5 (first layer) to ~2.3 (last), so the two chosen weights differ (0.5 / 0.5
# would hide a wrong weighting) and no expert takes every token.
ROUTER_SCALE = 5.0

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MLP_RE = re.compile(r"^model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def mixtral_config(dense, num_experts: int, top_k: int):
    """The ``MixtralConfig`` of the dense Llama config ``dense`` with ``num_experts``
    experts of its ``intermediate_size``, ``top_k`` of them per token."""
    from transformers import MixtralConfig

    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")
    return MixtralConfig(**{k: getattr(dense, k) for k in keep}, num_local_experts=num_experts,
                         num_experts_per_tok=top_k, sliding_window=None, architectures=["MixtralForCausalLM"])


def _expert_tensors(layer: int, mlp: dict[str, torch.Tensor], num_experts: int, gen: torch.Generator,
                    hidden: int) -> dict[str, torch.Tensor]:
    """transformers 5's stacked expert tensors of one layer (``gate_up_proj [E, 2I, H]``, gate
    rows first; ``down_proj [E, H, I]``) and its router (``gate [E, H]``, N(0, (ROUTER_SCALE /
    sqrt(H))^2))."""
    p = f"model.layers.{layer}.mlp"
    gate_up = torch.cat([mlp["gate_proj"], mlp["up_proj"]])
    return {f"{p}.experts.gate_up_proj": gate_up.expand(num_experts, *gate_up.shape).contiguous(),
            f"{p}.experts.down_proj": mlp["down_proj"].expand(num_experts, *mlp["down_proj"].shape).contiguous(),
            f"{p}.gate.weight": torch.randn(num_experts, hidden, generator=gen) * ROUTER_SCALE / hidden**0.5}


def build_moe_fixture(out_dir: str, num_experts: int = NUM_EXPERTS, top_k: int = TOP_K,
                      seed: int = ROUTER_SEED, source: str | None = None) -> str:
    """Write the Mixtral folder (config.json, one safetensors shard a layer plus one for the
    embeddings and final norm, the index, the tokenizer) into ``out_dir``; returns it.

    Args:
        source: the dense Llama GGUF (default: the embedded SmolLM2-135M).
        seed: seeds the routers' random weights.

    Raises:
        ValueError: ``top_k`` not in [1, num_experts], or the source is not a Llama model.
    """
    from safetensors.torch import save_file

    from tandem.config import embedded_default_model
    from tandem.model_loader.loader import iterate_gguf_weights_cached, load_hf_config, load_tokenizer

    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    source = source or embedded_default_model()
    dense = load_hf_config(source)
    if dense.model_type != "llama":
        raise ValueError(f"the source must be a Llama model, got model_type={dense.model_type!r}")
    os.makedirs(out_dir, exist_ok=True)
    n = dense.num_hidden_layers
    by_shard: dict[int, dict[str, torch.Tensor]] = {}  # layer (n: embeddings, final norm) -> tensors
    for name, t in iterate_gguf_weights_cached(source, dense):
        by_shard.setdefault(_layer_of(name, n), {})[name] = t
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for key in range(n + 1):  # in layer order: the routers draw from one generator
        shard = by_shard.pop(key, {})
        mlp = {m.group(1): shard.pop(name) for name in list(shard) if (m := _MLP_RE.match(name))}
        if key < n:
            if sorted(mlp) != ["down_proj", "gate_proj", "up_proj"]:
                raise ValueError(f"layer {key} of {source!r} has the MLP tensors {sorted(mlp)}")
            shard.update(_expert_tensors(key, mlp, num_experts, gen, dense.hidden_size))
        file = f"model-{key + 1:05d}-of-{n + 1:05d}.safetensors"
        save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    mixtral_config(dense, num_experts, top_k).save_pretrained(out_dir)
    load_tokenizer(source).save_pretrained(out_dir)
    return out_dir


def _layer_of(name: str, num_layers: int) -> int:
    """The decoder layer of a tensor name; ``num_layers`` for the embeddings and final norm."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else num_layers
