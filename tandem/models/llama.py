"""Dense decoder-only transformer: Llama (1-3.x, SmolLM2), Qwen2/Qwen2.5, Qwen3.

One implementation; the families differ only in small switches read from the HF config:
Qwen2 adds biases to the q/k/v projections, Qwen3 adds per-head RMSNorm on q and k
(before RoPE). Weights use the HF names; q/k/v and gate/up are stored fused.

Tensor parallelism (:mod:`tandem.layers.linear`, sizes from
:mod:`tandem.distributed.parallel_state`): q/k/v and gate/up are column-parallel (whole
heads per rank; KV heads replicated when fewer than the TP ranks), o_proj and down_proj
row-parallel with an all-reduce; embeddings, norms and the LM head are replicated.

FP8 (dynamic per-token activation scales): the inputs of qkv_proj, gate_up_proj and
down_proj are quantized by the RMSNorm / SiLU-and-mul kernels that produce them, when the
layer ``takes_quantized_input`` (:mod:`tandem.layers.linear`), as vLLM's fusion passes do;
at decode sizes o_proj and down_proj leave their output scales to the RMSNorm after them
(``output_feeds_norm``: ``Attention.forward`` and ``MLP.forward`` may then return an
:class:`~tandem.layers.quantization.fp8.UnscaledProduct`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.attention.metadata import AttentionMetadata
from tandem.distributed import parallel_state as ps
from tandem.distributed.pipeline import IntermediateTensors, PPMissingLayer, pp_layer_range
from tandem.layers.fused_ops import silu_and_mul, silu_and_mul_dynamic_per_token_quant
from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers import batch_invariant, fused_ops
from tandem.layers.norm import RMSNorm
from tandem.layers.quantization.fp8 import QuantizedActivation, UnscaledProduct
from tandem.layers.rotary import RotaryEmbedding


@dataclass
class DecoderSpec:
    """Shape and family switches of a dense decoder, read from a HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, c) -> "DecoderSpec":
        mt = c.model_type
        heads = c.num_attention_heads
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(getattr(c, "attention_bias", False)),
            qk_norm=mt == "qwen3",
        )


class Attention(nn.Module):
    """GQA self-attention over the paged cache; heads sharded over the TP ranks
    (``num_heads`` / ``num_kv_heads`` are this rank's). ``input_size``: width of the
    q/k/v projections' input (default ``spec.hidden_size``; an EAGLE-3 head's layer takes
    ``2 * hidden_size``)."""

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 input_size: int | None = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(input_size or spec.hidden_size, spec.head_dim, spec.num_heads,
                                          spec.num_kv_heads, bias=spec.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * spec.head_dim
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rotary = rotary
        self.backend = backend
        self.scale = spec.head_dim**-0.5
        # FP8 KV cache scales (vLLM's k_scale / v_scale): 1.0 unless the checkpoint has them
        # (tandem.layers.quantization.apply.load_kv_cache_scales).
        self.k_scale = self.v_scale = 1.0

    def forward(self, x: torch.Tensor | QuantizedActivation, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | UnscaledProduct:
        qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        if self.qk_norm:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(positions, q, k)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary.forward_qk(positions, qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim),
                                          self.num_heads)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.k_scale, self.v_scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``; the
    intermediate dim is sharded over the TP ranks (``reduce_results=False``: the output is
    this rank's partial sum, reduced by the caller)."""

    def __init__(self, hidden_size: int, intermediate_size: int, reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, reduce_results=reduce_results)
        self.fused_ops_mode = fused_ops.build_mode()  # the model's, for the SiLU-and-mul (tandem.layers.fused_ops)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor | UnscaledProduct:
        gate_up = self.gate_up_proj(x)
        if self.down_proj.takes_quantized_input:
            q, scale = silu_and_mul_dynamic_per_token_quant(gate_up, mode=self.fused_ops_mode)
            return self.down_proj(QuantizedActivation(q, scale, gate_up.dtype))
        return self.down_proj(silu_and_mul(gate_up, mode=self.fused_ops_mode))


def _norm_for(norm: RMSNorm, consumer: nn.Module, x: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None
              ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
    """``norm(x + residual)`` as the input of the linear layer ``consumer`` (FP8 from the
    norm's kernel when it ``takes_quantized_input``) and the new residual stream (``x``
    itself when ``residual`` is None: the first layer)."""
    if consumer.takes_quantized_input:
        out, new_residual = norm.forward_fp8(x, residual)
        return out, x if residual is None else new_residual
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def split_aux_hidden_states(model: nn.Module, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A forward's output as (hidden states ``[T, H]``, the ``aux_hidden_state_layers``'
    inputs ``[T, A * H]`` or None when the model returns none; views of ``out``)."""
    num = len(getattr(model, "aux_hidden_state_layers", ()))
    if not num:
        return out, None
    width = out.shape[-1] // (1 + num)
    return out[:, :width], out[:, width:]


def _scaled(hidden: torch.Tensor | UnscaledProduct) -> torch.Tensor:
    """A layer's output as a plain tensor (FP8's deferred scales applied)."""
    return hidden.apply_scales() if isinstance(hidden, UnscaledProduct) else hidden


def _residual_stream(hidden: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None) -> torch.Tensor:
    """A layer's input ``hidden + residual`` as one tensor."""
    hidden = _scaled(hidden)
    return hidden if residual is None else hidden + residual


class DecoderLayer(nn.Module):
    """Pre-norm layer, residual stream carried separately (as in vLLM) so that each residual
    add is fused into the next RMSNorm: ``forward(hidden, residual, ...) -> (hidden,
    residual)`` with ``residual=None`` for the first layer. The sum ``hidden + residual``
    of the returned pair is the layer's output ``x + attn(norm(x)) + mlp(norm(...))``;
    ``hidden`` may be an :class:`UnscaledProduct` (FP8, module docstring), which only the
    next RMSNorm takes (else ``hidden.apply_scales()`` first)."""

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(spec, rotary, backend)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # o_proj's output goes to post_attention_layernorm, down_proj's to the next layer's
        # input_layernorm (or the final norm) as they are.
        self.self_attn.o_proj.output_feeds_norm = self.mlp.down_proj.output_feeds_norm = True

    def forward(self, hidden: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor | UnscaledProduct, torch.Tensor]:
        attn_in, residual = _norm_for(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(attn_in, positions, kv_cache, meta)
        mlp_in, residual = _norm_for(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual)
        return self.mlp(mlp_in), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM over a paged KV cache.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches (one per layer of this
    stage, see tandem.attention.metadata), meta, intermediate=None) -> hidden states [T,
    hidden_size]``; ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]`` fp32.

    Under pipeline parallelism (:mod:`tandem.distributed.pipeline`) the model holds the
    decoder layers ``[start_layer, end_layer)`` of its stage (the others are
    ``PPMissingLayer``), the embedding on the first stage (and the last, tied), the final norm
    and the LM head on the last; a stage after the first takes the previous stage's
    ``intermediate`` tensors instead of ``input_ids``, and a stage before the last returns
    :class:`~tandem.distributed.pipeline.IntermediateTensors`.

    With ``aux_hidden_state_layers`` set (an EAGLE-3 head's target), ``forward`` returns
    ``[T, (1 + A) * hidden_size]``: the hidden states, then the input of each of those ``A``
    layers (the residual stream ``hidden + residual``), concatenated along the last dim, so
    that the step's one output tensor (a CUDA graph's included) carries them.
    """

    def __init__(self, hf_config, backend: AttentionBackend, max_positions: int | None = None) -> None:
        super().__init__()
        spec = DecoderSpec.from_hf_config(hf_config)
        self.spec = spec
        rotary = RotaryEmbedding(hf_config, spec.head_dim, max_positions or spec.max_position_embeddings)
        info = ps.get_parallel_info()
        self.is_first_stage, self.is_last_stage = info.is_first_stage, info.is_last_stage
        self.start_layer, self.end_layer = pp_layer_range(spec.num_layers, info.pp_rank, info.pp_size)
        # Uninitialised (as every other parameter): loading overwrites them, and drawing
        # random vocab x hidden values first costs a CLI start a noticeable share.
        self.embed_tokens = (nn.utils.skip_init(nn.Embedding, spec.vocab_size, spec.hidden_size,
                                                device=torch.get_default_device())
                             if self.is_first_stage or self.is_last_stage and spec.tie_word_embeddings
                             else PPMissingLayer())
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary, backend) if self.start_layer <= i < self.end_layer
                                    else PPMissingLayer() for i in range(spec.num_layers))
        self.rotary = rotary
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        if not spec.tie_word_embeddings:
            self.lm_head = (nn.utils.skip_init(nn.Linear, spec.hidden_size, spec.vocab_size, bias=False,
                                               device=torch.get_default_device())
                            if self.is_last_stage else PPMissingLayer())
        # A quantized LM head computing the logits instead (GGUF on the CPU:
        # tandem.layers.quantization.gguf.quantize_gguf_linears); None: the dense weight.
        self.lm_head_quant: nn.Module | None = None
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.deterministic = batch_invariant.build_mode()  # the LM head's GEMM (compute_logits)
        # Plain decode steps' layers as C++ ops where the loaded model qualifies
        # (tandem.models.cpu_decode.build_cpu_decode, called by the loader); None: Python.
        self.cpu_decode = None

    @property
    def kv_cache_shape_per_block(self) -> tuple[int, int]:
        """(num_kv_heads of this TP rank, head_dim) of every layer's cache."""
        return self.layers[self.start_layer].self_attn.num_kv_heads, self.spec.head_dim

    @property
    def num_stage_layers(self) -> int:
        """Decoder layers on this pipeline stage (each needs a KV cache)."""
        return self.end_layer - self.start_layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        self.rotary.begin_step(positions)
        aux = []
        layers = self.layers[self.start_layer:self.end_layer]
        if self.cpu_decode is not None and not self.aux_hidden_state_layers \
                and self.cpu_decode.applies(hidden, kv_caches, meta):
            hidden, residual = self.cpu_decode.forward(hidden, residual, positions, kv_caches, meta)
            layers = []
        for i, (layer, cache) in enumerate(zip(layers, kv_caches), start=self.start_layer):
            if i in self.aux_hidden_state_layers:
                aux.append(_residual_stream(hidden, residual))
            hidden, residual = layer(hidden, residual, positions, cache, meta)
        if not self.is_last_stage:
            return IntermediateTensors(_scaled(hidden), residual)
        out = self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
        return torch.cat([out, *aux], dim=-1) if aux else out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_quant is not None:
            return self.lm_head_quant(hidden).float()
        w = self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return batch_invariant.linear(hidden, w, deterministic=self.deterministic).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters.

        Raises:
            ValueError: a parameter of the model received no weight, or a shape differs.
        """
        tied = self.spec.tie_word_embeddings

        params = {n.split(".")[0] for n, _ in self.named_parameters()}  # this stage's top-level parts

        def own(named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                name = name.removeprefix("model.")
                if "rotary_emb" in name or name == "lm_head.weight" and tied or not self._on_stage(name, params):
                    continue
                yield name, tensor

        load_decoder_weights(self, own(weights))

    def _on_stage(self, name: str, parts: set[str]) -> bool:
        """Whether checkpoint tensor ``name`` (``model.`` removed) belongs to this stage."""
        head, _, rest = name.partition(".")
        if head == "layers":
            return self.start_layer <= int(rest.split(".")[0]) < self.end_layer
        return head in parts


_STACKED = {  # HF name part -> (fused param name part, shard index)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def load_decoder_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         optional: tuple[str, ...] = ()) -> None:
    """Copy tensors named as ``module``'s parameters and buffers, with HF's separate
    q/k/v and gate/up names, into ``module`` (fused q/k/v and gate/up; a tensor-parallel
    layer's ``weight_loader`` takes this rank's slice).

    Args:
        optional: parameter names that may be missing (they keep their values). Parameters
            on the meta device are not loaded either (layers to be built from a GGUF file's
            blocks: :func:`tandem.layers.quantization.gguf.defer_block_weights`).

    Raises:
        ValueError: a tensor without a matching parameter or buffer, a shape differs, or a
            parameter (or buffer given before) received no tensor.
    """
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = name, None
        for part, (fused, idx) in _STACKED.items():
            if f".{part}." in name:
                target, shard = name.replace(part, fused), idx
                break
        p = params.get(target, buffers.get(target))
        if p is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
        loader = getattr(p, "weight_loader", None)
        try:
            if loader is not None:  # tensor-parallel layers slice this rank's part
                loader(tensor, shard)
            elif p.shape != tensor.shape:
                raise ValueError(f"checkpoint {tuple(tensor.shape)} vs model {tuple(p.shape)}")
            else:
                with torch.no_grad():
                    p.copy_(tensor)
        except ValueError as e:
            raise ValueError(f"shape of {name!r}: {e}") from None
        loaded.add(f"{target}#{'' if shard is None else shard}")
    expected = set()
    for pname, p in params.items():
        if pname in optional or p.is_meta:
            continue
        if ".qkv_proj." in pname:  # weight, bias, FP8 scales: one per shard
            expected |= {f"{pname}#{i}" for i in range(3)}
        elif ".gate_up_proj." in pname:
            expected |= {f"{pname}#{i}" for i in range(2)}
        else:
            expected.add(f"{pname}#")
    missing = sorted(_checkpoint_name(m) for m in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks weights for {missing[:6]} ({len(missing)} in all)")


_UNSTACKED = {(fused, idx): part for part, (fused, idx) in _STACKED.items()}


def _checkpoint_name(entry: str) -> str:
    """A loaded-parameter entry ``name#shard`` as the checkpoint names it (q_proj, not qkv_proj#0)."""
    name, shard = entry.split("#")
    if shard:
        for (fused, idx), part in _UNSTACKED.items():
            if f".{fused}." in name and idx == int(shard):
                return name.replace(fused, part)
    return name
