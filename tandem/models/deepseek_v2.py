"""DeepSeek-V2 / DeepSeek-V2-Lite (DeepSeek-AI, 2024).

* Attention: multi-head latent attention (:mod:`tandem.layers.mla`); the paged cache holds
  the compressed KV (``kv_lora_rank + qk_rope_head_dim`` per token, one plane), so
  ``kv_cache_shape_per_block = (1, kv_lora_rank + qk_rope_head_dim)`` and
  ``kv_cache_num_planes = 1``. Interleaved RoPE on the ``qk_rope_head_dim`` part, with
  DeepSeek's YaRN scaling when the config declares it (inverse frequencies from
  transformers' ``ROPE_INIT_FUNCTIONS``, softmax scale times ``mscale**2``).
* Feed-forward: dense SwiGLU (``intermediate_size``) on the first ``first_k_dense_replace``
  layers (and, with ``moe_layer_freq > 1``, on layers ``i % moe_layer_freq != 0``, as the
  original remote code; transformers ignores ``moe_layer_freq``); DeepSeekMoE elsewhere:
  ``n_routed_experts`` routed experts of ``moe_intermediate_size`` (router weight and
  logits in fp32 as in transformers, softmax in fp32, greedy or group-limited top-k,
  ``routed_scaling_factor``) plus ``n_shared_experts`` always-on experts fused into one
  SwiGLU of ``n_shared_experts * moe_intermediate_size`` (without an exchange, their output
  is added in the routed experts' reduction kernel).

HF names throughout (``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` /
``mlp.experts.{e}.gate_proj.weight``, ``mlp.shared_experts.{gate,up,down}_proj``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.distributed import parallel_state as ps
from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.layers.mla import MLAAttention
from tandem.layers.moe import SparseMoeBlock, TopKRouter
from tandem.layers.parallel_moe import ParallelFusedMoE
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.llama import MLP
from tandem.models.moe_base import All2AllFactory, MoECausalLM, MoEDecoderLayer, load_moe_weights


class ParallelMLAAttention(MLAAttention):
    """MLA with the heads sharded over the TP ranks: ``q_proj``/``q_b_proj`` and
    ``kv_b_proj`` column-parallel by heads, ``o_proj`` row-parallel (all-reduce); the
    latent path (``q_a_proj``, ``kv_a_proj_with_mqa``, their norms) and the latent cache are
    replicated. ``num_heads`` is this rank's.

    Raises:
        ValueError: the head count is not a multiple of the TP size.
    """

    def __init__(self, hf_config, rotary: RotaryEmbedding) -> None:
        super().__init__(hf_config, rotary)
        tp = ps.get_tp_size()
        if tp == 1:
            return
        c, n = hf_config, hf_config.num_attention_heads
        if n % tp:
            raise ValueError(f"num_attention_heads ({n}) must be a multiple of the TP size ({tp})")
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, n * self.qk_dim)
        else:
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, n * self.qk_dim)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, n * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(n * self.v_dim, c.hidden_size, bias=bool(getattr(c, "attention_bias", False)))
        self.num_heads = n // tp


class DeepseekV2ForCausalLM(MoECausalLM):
    """DeepSeek-V2 causal LM (see the module docstring).

    Args:
        hf_config: a ``DeepseekV2Config``.
        backend: unused (MLA runs its own paged attention); kept for the common signature.
        max_positions: RoPE table length (default ``max_position_embeddings``).
        all2all: builds each MoE layer's dispatch/combine backend (default ``local``).
        moe_impl: expert compute of :func:`tandem.layers.moe.grouped_experts`.
    """

    kv_cache_num_planes = 1

    def __init__(self, hf_config, backend: AttentionBackend | None = None, max_positions: int | None = None,
                 all2all: All2AllFactory | None = None, moe_impl: str = "auto") -> None:
        super().__init__()
        c = self.hf_config = hf_config
        max_positions = max_positions or c.max_position_embeddings
        rotary = RotaryEmbedding(c, c.qk_rope_head_dim, max_positions)
        self._init_common(c.vocab_size, c.hidden_size, c.rms_norm_eps, bool(getattr(c, "tie_word_embeddings", False)),
                          c.num_hidden_layers)
        self.layers = self._stage_layers(c.num_hidden_layers, lambda i: MoEDecoderLayer(
            ParallelMLAAttention(c, rotary), self._make_mlp(i, all2all, moe_impl), c.hidden_size, c.rms_norm_eps))

    def is_moe_layer(self, i: int) -> bool:
        c = self.hf_config
        freq = getattr(c, "moe_layer_freq", 1) or 1
        return bool(c.n_routed_experts) and i >= c.first_k_dense_replace and i % freq == 0

    def _make_mlp(self, i: int, all2all: All2AllFactory | None, moe_impl: str) -> nn.Module:
        c = self.hf_config
        if not self.is_moe_layer(i):
            return MLP(c.hidden_size, c.intermediate_size)
        if getattr(c, "mlp_bias", False):
            raise NotImplementedError("DeepSeek-V2 with mlp_bias is not supported")
        e = c.n_routed_experts
        gate = TopKRouter(c.hidden_size, e, c.num_experts_per_tok, "deepseek_v2", fp32_logits=True,
                          renormalize=bool(getattr(c, "norm_topk_prob", False)), topk_method=c.topk_method or "greedy",
                          n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor)
        experts = ParallelFusedMoE(e, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
                                   all2all(e) if all2all else None, moe_impl)
        shared = MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else None
        return SparseMoeBlock(gate, experts, shared)

    @property
    def kv_cache_shape_per_block(self) -> tuple[int, int]:
        """(1, kv_lora_rank + qk_rope_head_dim): one latent "head" per token, one plane."""
        return 1, self.hf_config.kv_lora_rank + self.hf_config.qk_rope_head_dim

    _STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors.

        Raises:
            ValueError: unknown tensor, shape mismatch or missing weights.
        """
        load_moe_weights(self, weights, self._STACKED, lambda fused, p: [p.shape[0] // 2] * 2,
                         self.tie_word_embeddings)
