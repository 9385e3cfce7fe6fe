"""Qwen3-MoE (the shared MoE decoder pieces are in :mod:`tandem.models.moe_base`).

Qwen3-MoE = the Qwen3 decoder (per-head q/k RMSNorm before RoPE, NeoX RoPE, GQA) with
sparse MoE feed-forward blocks on the layers ``i`` where ``(i + 1) % decoder_sparse_step
== 0`` and ``i not in mlp_only_layers`` (a dense SwiGLU of ``intermediate_size`` elsewhere).
Routing: softmax, top-k, renormalise iff ``norm_topk_prob``.

Parallelism: attention and dense MLPs are tensor-parallel (:mod:`tandem.models.llama`);
routed experts are :class:`~tandem.layers.parallel_moe.ParallelFusedMoE` (expert-parallel
through the ``all2all`` backend's placement, or TP-sharded intermediate dim without EP).

Weights use the HF names. Routed experts load from either the stacked tensors of
transformers 5 (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H,
I]``) or the per-expert tensors of Hub checkpoints (``mlp.experts.{e}.gate_proj.weight``
..., Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``). FP8 checkpoints add
per-expert ``weight_scale`` (``weight_scale_inv`` renamed by the loader; loaded, completeness checked by
:func:`tandem.layers.quantization.apply.finish_fp8_model`) and ``input_scale`` (skipped:
the experts run W8A16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.layers.moe import SparseMoeBlock, TopKRouter
from tandem.layers.parallel_moe import ParallelFusedMoE
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.llama import MLP, Attention, DecoderSpec
from tandem.models.moe_base import (All2AllFactory, MoECausalLM, MoEDecoderLayer, check_no_sliding_window,
                                    load_moe_weights)

class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3-MoE causal LM (see the module docstring).

    Args:
        hf_config: a ``Qwen3MoeConfig``.
        backend: the attention backend.
        max_positions: RoPE table length (default ``max_position_embeddings``).
        all2all: builds the dispatch/combine backend of each MoE layer from its number of
            experts (default: the ``local`` backend, EP=1).
        moe_impl: expert compute of :func:`tandem.layers.moe.grouped_experts`.
    """

    qk_norm = True

    def __init__(self, hf_config, backend: AttentionBackend, max_positions: int | None = None,
                 all2all: All2AllFactory | None = None, moe_impl: str = "auto") -> None:
        super().__init__()
        spec = dataclasses.replace(DecoderSpec.from_hf_config(hf_config), qk_norm=self.qk_norm)
        self.spec, self.hf_config = spec, hf_config
        max_positions = max_positions or spec.max_position_embeddings
        check_no_sliding_window(hf_config, max_positions)
        rotary = RotaryEmbedding(hf_config, spec.head_dim, max_positions)
        self._init_common(spec.vocab_size, spec.hidden_size, spec.rms_norm_eps, spec.tie_word_embeddings,
                          spec.num_layers)
        self.layers = self._stage_layers(spec.num_layers, lambda i: MoEDecoderLayer(
            Attention(spec, rotary, backend), self._make_mlp(i, all2all, moe_impl), spec.hidden_size, spec.rms_norm_eps))

    # -------------------------------------------------------------- family hooks
    def is_moe_layer(self, i: int) -> bool:
        c = self.hf_config
        return (i not in (getattr(c, "mlp_only_layers", None) or []) and c.num_experts > 0
                and (i + 1) % c.decoder_sparse_step == 0)

    def _num_experts(self) -> int:
        return self.hf_config.num_experts

    def _router(self) -> TopKRouter:
        c = self.hf_config
        return TopKRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, "softmax_topk",
                          renormalize=bool(c.norm_topk_prob))

    def _moe_intermediate_size(self) -> int:
        return self.hf_config.moe_intermediate_size

    def _make_mlp(self, i: int, all2all: All2AllFactory | None, moe_impl: str) -> nn.Module:
        c = self.hf_config
        if not self.is_moe_layer(i):
            return MLP(c.hidden_size, c.intermediate_size)
        e = self._num_experts()
        experts = ParallelFusedMoE(e, c.num_experts_per_tok, c.hidden_size, self._moe_intermediate_size(),
                                   all2all(e) if all2all else None, moe_impl)
        return SparseMoeBlock(self._router(), experts)

    @property
    def kv_cache_shape_per_block(self) -> tuple[int, int]:
        """(num_kv_heads of this TP rank, head_dim) of every layer's cache."""
        return self.layers[self.start_layer].self_attn.num_kv_heads, self.spec.head_dim

    # ---------------------------------------------------------------- weights
    _STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def _shard_sizes(self, fused: str, param: torch.Tensor) -> list[int]:
        s = self.spec
        if fused == "qkv_proj":
            return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        return [param.shape[0] // 2] * 2

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (see the module docstring).

        Raises:
            ValueError: unknown tensor, shape mismatch or missing weights.
        """
        load_moe_weights(self, weights, self._STACKED, self._shard_sizes, self.spec.tie_word_embeddings)
