"""A Llama-family model's decode steps on the CPU as one C++ op per decoder layer.

At one sequence a CPU decode step of a small GGUF model is bound by dispatch, not arithmetic:
each decoder layer is ~25 dispatched ops and ~12 Python module calls around its four GEMMs.
:func:`build_cpu_decode` decides once, after the weights are loaded, whether a model's layers
can run as ``torch.ops.tandem_cpu.decoder_layer_decode`` (``tandem/csrc/cpu/
decoder_layer.cpp``): its linear layers
:class:`~tandem.layers.quantization.gguf.GGUFInt4Linear`,
:class:`~tandem.layers.quantization.gguf_blocks.GGUFBlockLinear` (or plain dense ones: a GGUF
type neither covers), the model built in fused-ops mode ``cpu`` (the C++ norms, RoPE,
SiLU-and-mul and decode attention), no per-head q/k norm, not deterministic.
:class:`CpuDecode` then runs a step's layers when every row of the step is a generated token (no
prompt rows, which the quantized layers run dense): a plain decode step, one token per request, for
which the op calls the same kernels in the same order as the Python forward, so that a step's
hidden states and cache are the same bits either way; and a step of several generated tokens
per request (speculative decoding's verification of ``1 + K`` tokens, a draft model's catch-up),
whose tokens the op's decode attention reads one by one, each over its own context (the
request's block table, its position + 1 keys, the step's K/V written first), so that a token
gets the attention a plain decode step would give it (tests/models/test_cpu_decode.py). Other
steps, and models it does not cover, run the Python forward.
"""

from __future__ import annotations

import logging

import torch

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.distributed.forward_context import get_forward_context
from tandem.layers import cpu_ops
from tandem.layers.linear import ColumnShardedLinear, RowParallelLinear
from tandem.layers.quantization.gguf import GROUP_SIZE, GGUFInt4Linear
from tandem.layers.quantization.gguf_blocks import GGUFBlockLinear
from tandem.models.llama import DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

_QUANTIZED = (GGUFInt4Linear, GGUFBlockLinear)


class CpuDecode:
    """The decoder layers of ``model`` (this pipeline stage's) as C++ ops: built by
    :func:`build_cpu_decode`, which checks that the model qualifies."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        layers = list(model.layers[model.start_layer:model.end_layer])
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.eps, self.scale = layers[0].input_layernorm.eps, attn.scale
        self.rotary = model.rotary
        self.dtype = layers[0].input_layernorm.weight.dtype
        # Per layer, in the op's order: the two norms' weights, then three tensors for each
        # of qkv_proj, o_proj, gate_up_proj, down_proj (tandem/csrc/cpu/decoder_layer.cpp).
        self.weights = [[layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
                        + [t for lin in _linears(layer) for t in _linear_tensors(lin, self.dtype)]
                        for layer in layers]

    def applies(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> bool:
        """Whether the op covers this step: hidden states and caches of the model's dtype, and
        either one token per request that is not a prompt's (the forward context's row phases,
        when known) or several per request, every one known to be generated."""
        t = hidden.shape[0]
        if hidden.dtype != self.dtype or kv_caches[0].dtype != self.dtype or meta.num_reqs == 0:
            return False
        ctx = get_forward_context()
        phases = None if ctx is None else ctx.row_phases
        if meta.num_decode_reqs == meta.num_reqs == t:
            return phases is None or phases.num_generated == phases.num_rows
        return phases is not None and phases.num_generated == phases.num_rows == t

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers' ``(hidden, residual)`` as ``DecoderLayer.forward`` chained gives them
        (``hidden [T, H]``, ``residual`` None before the first layer)."""
        op = torch.ops.tandem_cpu.decoder_layer_decode
        cos, sin = self.rotary.cos, self.rotary.sin
        tables, seq_lens = _per_token_contexts(positions, meta)
        for weights, cache in zip(self.weights, kv_caches):
            hidden, residual = op(hidden, residual, positions, meta.slot_mapping, cache, tables, seq_lens, cos, sin,
                                  weights, self.num_heads, self.num_kv_heads, GROUP_SIZE, self.eps, self.scale)
        return hidden, residual


def _per_token_contexts(positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's block table ``[T, width]`` int32 and context length ``[T]`` int32 (its
    position + 1), as the op's decode attention reads them; a plain decode step's are the
    step's own."""
    t = positions.shape[0]
    if meta.num_reqs == t:
        return meta.block_tables, meta.seq_lens
    rows = torch.repeat_interleave(torch.arange(meta.num_reqs), meta.query_start_loc.diff())
    return meta.block_tables.index_select(0, rows), (positions + 1).to(torch.int32)


def _linears(layer: DecoderLayer) -> list[torch.nn.Module]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _linear_tensors(lin: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 layer's (packed, scales and zeros, bias), a block layer's (repacked tiles,
    segments, bias), a dense one's (weight, empty, bias); empty for no bias."""
    empty = torch.empty(0, dtype=dtype)
    bias = empty if lin.bias is None else lin.bias
    if isinstance(lin, GGUFInt4Linear):
        return lin.packed, lin.scales_and_zeros, bias
    if isinstance(lin, GGUFBlockLinear):
        return lin.repacked, lin.segments, bias
    return lin.weight, empty, bias


def _plain_dense(lin: torch.nn.Module, dtype: torch.dtype) -> bool:
    """A dense linear layer whose forward is ``F.linear`` in the model's dtype: not FP8, not
    deterministic (its GEMM would be row-blocked), a row layer on one rank (no all-reduce)."""
    return isinstance(lin, ColumnShardedLinear | RowParallelLinear) and lin.weight.dtype == dtype \
        and not lin.deterministic and not lin.takes_quantized_input \
        and getattr(lin, "tp_size", 1) == 1 and not getattr(lin, "deferred_scales_max_rows", 0)


def build_cpu_decode(model: torch.nn.Module) -> CpuDecode | None:
    """A :class:`CpuDecode` for ``model`` where it qualifies (logged once either way where it is a
    CPU GGUF quantized model), else None: a :class:`~tandem.models.llama.LlamaForCausalLM` of
    plain decoder layers (no q/k norm) on the CPU, every layer's linears GGUF quantized or plain
    dense, the norms, RoPE and
    attention backend on the C++ kernels, decode attention not deterministic."""
    if type(model) is not LlamaForCausalLM or model.start_layer == model.end_layer:
        return None
    layers = list(model.layers[model.start_layer:model.end_layer])
    linears = [lin for layer in layers for lin in _linears(layer)]
    if not any(isinstance(lin, _QUANTIZED) for lin in linears):
        return None  # not a CPU GGUF model: nothing to say
    reason = _why_not(model, layers)
    if reason:
        logger.info("CPU decode steps: the Python forward (%s)", reason)
        return None
    logger.info("CPU decode steps: one C++ op per decoder layer")
    return CpuDecode(model)


def _why_not(model: LlamaForCausalLM, layers: list[torch.nn.Module]) -> str | None:
    attn = layers[0].self_attn
    backend = attn.backend
    mode = layers[0].input_layernorm.fused_ops_mode
    if mode != "cpu":
        return f"fused-ops mode {mode!r}, not the C++ kernels' 'cpu' (TANDEM_FUSED_OPS)"
    if not all(type(layer) is DecoderLayer for layer in layers) or attn.qk_norm:
        return "q/k norms or another layer kind"
    if backend.deterministic:
        return "--deterministic: decode attention stays batch-invariant in torch"
    if not (isinstance(backend, TorchAttentionBackend) and backend.cpu_kernels):
        return "decode attention not on the C++ kernel"
    if not cpu_ops.available() or not model.rotary._cpu_kernel():
        return "RoPE not on the C++ kernel"
    dtype = layers[0].input_layernorm.weight.dtype
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(n.fused_ops_mode != "cpu" or n.weight.dtype != dtype for n in norms):
        return "norms off the C++ kernels"
    if any(layer.self_attn.k_scale != 1.0 or layer.self_attn.v_scale != 1.0 for layer in layers):
        return "KV cache scales"
    if not all(isinstance(lin, _QUANTIZED) or _plain_dense(lin, dtype) for layer in layers
               for lin in _linears(layer)):
        return "a linear layer neither GGUF quantized nor plain dense"
    return None


__all__ = ["CpuDecode", "build_cpu_decode"]
