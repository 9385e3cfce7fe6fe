"""Mixtral (Jiang et al., "Mixtral of Experts", 2024).

The Mistral decoder (GQA, NeoX RoPE, no q/k norm, no biases) with a sparse MoE block in
every layer: ``num_local_experts`` SwiGLU experts of ``intermediate_size``, top-k routing
with softmax over all logits and renormalisation over the chosen k (= a softmax over the
top-k logits). Checkpoint names: transformers 5's ``mlp.gate`` / ``mlp.experts.gate_up_proj``
/ ``mlp.experts.down_proj``, or the Hub's ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.{e}.w1/w3/w2`` (w1 = gate, w3 = up, w2 = down).
Sliding-window attention is not supported (Mixtral checkpoints set ``sliding_window: null``).
"""

from __future__ import annotations

from tandem.layers.moe import TopKRouter
from tandem.models.qwen3_moe import Qwen3MoeForCausalLM


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    """Mixtral causal LM; constructor arguments as :class:`Qwen3MoeForCausalLM`."""

    qk_norm = False

    def is_moe_layer(self, i: int) -> bool:
        return True

    def _num_experts(self) -> int:
        return self.hf_config.num_local_experts

    def _router(self) -> TopKRouter:
        c = self.hf_config
        return TopKRouter(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, "softmax_topk", renormalize=True)

    def _moe_intermediate_size(self) -> int:
        return self.hf_config.intermediate_size
