"""The pieces shared by Tandem's MoE decoders (Qwen3-MoE, Mixtral, DeepSeek-V2): the decoder
layer with a sparse or dense feed-forward, the causal-LM shell whose forward is a generator
yielding at every MoE exchange (for dual-batch overlap), and HF weight loading with routed
experts in either the stacked (transformers 5) or the per-expert (Hub checkpoints) layout,
with the per-expert ``weight_scale`` of FP8 checkpoints (their ``input_scale`` is skipped: the
experts run W8A16).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Iterable

import torch
from torch import nn

from tandem.attention.metadata import AttentionMetadata
from tandem.distributed import parallel_state as ps
from tandem.distributed.all2all import All2AllBackend
from tandem.distributed.pipeline import IntermediateTensors, PPMissingLayer, pp_layer_range
from tandem.layers.linear import RowParallelLinear
from tandem.layers.moe import FusedMoE, SparseMoeBlock, drain
from tandem.layers import batch_invariant
from tandem.layers.norm import RMSNorm
from tandem.layers.quantization.fp8 import UnscaledProduct

All2AllFactory = Callable[[int], All2AllBackend]  # num_experts -> backend of one MoE layer

_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\."
                        r"(weight|weight_scale|input_scale)$")
_PER_EXPERT = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
               "down_proj": ("w2", None), "w2": ("w2", None)}
_FUSED_EXPERT = {"gate_up_proj": "w13", "down_proj": "w2"}


def load_moe_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                     stacked: dict[str, tuple[str, int]], shard_sizes: Callable[[str, torch.Tensor], list[int]],
                     tie_word_embeddings: bool) -> None:
    """Copy HF-named tensors into a Tandem MoE model.

    Args:
        stacked: HF name part -> (fused parameter name part, shard index), e.g.
            ``"q_proj": ("qkv_proj", 0)``.
        shard_sizes: (fused part, parameter) -> row sizes of its shards.

    Raises:
        ValueError: a tensor matches no parameter, a shape differs, or a parameter (or an
            expert of this rank) received no weight.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if "rotary_emb" in name or (name == "lm_head.weight" and tie_word_embeddings) or not _on_stage(model, name):
            continue
        m = _EXPERT_RE.match(name)
        if m:
            mod = modules.get(m.group(1))
            if not isinstance(mod, FusedMoE):
                raise ValueError(f"checkpoint tensor {name!r} has no matching expert layer")
            which, shard = _PER_EXPERT[m.group(3)]
            e = int(m.group(2))
            if m.group(4) == "input_scale":
                continue  # FP8 experts run W8A16: activations are not quantized
            if m.group(4) != "weight":
                mod.load_expert_scale(which, e, tensor, shard)
                continue
            if mod.load_expert(which, e, tensor, shard):
                loaded.add(f"{m.group(1)}.{which}#{e}.{'' if shard is None else shard}")
            continue
        prefix, _, last = name.rpartition(".")
        if last in _FUSED_EXPERT and isinstance(modules.get(prefix), FusedMoE):
            mod, which = modules[prefix], _FUSED_EXPERT[last]
            mod.load_fused(which, tensor)
            loaded |= _expert_keys(prefix, mod, which)
            continue
        target, shard = name, None
        for part, (fused, idx) in stacked.items():
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), (fused, idx)
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
        p = params[target]
        loader = getattr(p, "weight_loader", None)
        if loader is not None:  # tensor-parallel layers slice this rank's part
            try:
                loader(tensor, None if shard is None else shard[1])
            except ValueError as e:
                raise ValueError(f"shape of {name!r}: {e}") from None
        else:
            dst = p
            if shard is not None:
                sizes = shard_sizes(shard[0], p)
                dst = p.narrow(0, sum(sizes[: shard[1]]), sizes[shard[1]])
            if dst.shape != tensor.shape:
                raise ValueError(f"shape of {name!r}: checkpoint {tuple(tensor.shape)} vs model {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
        loaded.add(f"{target}#{shard[1] if shard else ''}")

    expected: set[str] = set()
    fused_parts = {fused for fused, _ in stacked.values()}
    for mname, mod in modules.items():
        if isinstance(mod, FusedMoE):
            expected |= _expert_keys(mname, mod, "w13") | _expert_keys(mname, mod, "w2")
    for pname in params:
        # Expert weights are counted per expert above; their FP8 scales are checked by finish_fp8_model.
        if (pname.endswith((".w13", ".w2", ".w13_weight_scale", ".w2_weight_scale"))
                and isinstance(modules.get(pname.rpartition(".")[0]), FusedMoE)):
            continue
        fused = next((f for f in fused_parts if f".{f}." in pname), None)
        if fused is None:
            expected.add(f"{pname}#")
        else:
            expected |= {f"{pname}#{i}" for i in range(len(shard_sizes(fused, params[pname])))}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint lacks weights for {sorted(missing)[:6]} ({len(missing)} in all)")


def _expert_keys(prefix: str, mod: FusedMoE, which: str) -> set[str]:
    pl = mod.all2all.placement
    experts = range(pl.first_local_expert, pl.first_local_expert + pl.num_local_experts)
    if which == "w13":
        return {f"{prefix}.w13#{e}.{s}" for e in experts for s in (0, 1)}
    return {f"{prefix}.w2#{e}." for e in experts}


class MoEDecoderLayer(nn.Module):
    """Pre-norm layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; ``mlp`` is a
    :class:`SparseMoeBlock` or a dense :class:`MLP`, ``self_attn`` any attention module
    with ``forward(x, positions, kv_cache, meta)``.

    The residual stream is carried separately, as in :class:`tandem.models.llama.DecoderLayer`
    (vLLM's layout), so that each residual add runs inside the following RMSNorm's kernel:
    ``forward(hidden, residual, ...) -> (hidden, residual)`` with ``residual=None`` for the
    first layer; the layer's output ``x + attn(...) + mlp(...)`` is ``hidden + residual``,
    each add rounded to the model dtype in the same order as the unfused layer. With FP8 a
    dense layer's ``hidden`` may be an :class:`~tandem.layers.quantization.fp8.UnscaledProduct`,
    which only the next RMSNorm takes (else ``hidden.apply_scales()`` first).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        # The output projections whose results the norms take as they are (an FP8 one may
        # leave its scales to the norm: tandem.layers.linear).
        for producer in (getattr(self_attn, "o_proj", None), getattr(mlp, "down_proj", None)):
            if isinstance(producer, RowParallelLinear):
                producer.output_feeds_norm = True

    def forward_steps(self, hidden: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None,
                      positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                      ) -> Generator[str, None, tuple[torch.Tensor | UnscaledProduct, torch.Tensor]]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if isinstance(self.mlp, SparseMoeBlock):
            hidden = yield from self.mlp.forward_steps(hidden)
        else:
            hidden = self.mlp(hidden)
        return hidden, residual

    def forward(self, hidden: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor | UnscaledProduct, torch.Tensor]:
        return drain(self.forward_steps(hidden, residual, positions, kv_cache, meta))


def _on_stage(model: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor ``name`` (``model.`` removed) belongs to ``model``'s pipeline stage."""
    head, _, rest = name.partition(".")
    if head == "layers":
        return model.start_layer <= int(rest.split(".")[0]) < model.end_layer
    return not isinstance(getattr(model, head, None), PPMissingLayer)


class MoECausalLM(nn.Module):
    """Embedding -> decoder layers -> norm -> LM head over a paged KV cache; the base of
    Tandem's MoE models. Subclasses build ``self.layers`` (:meth:`_stage_layers`) and define
    weight loading.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches (one per layer of this
    stage), meta, intermediate=None) -> hidden [T, hidden_size]``; ``compute_logits(hidden
    [N, H]) -> [N, vocab]`` fp32. Under pipeline parallelism as
    :class:`tandem.models.llama.LlamaForCausalLM`: the stage's layers (``PPMissingLayer`` in
    the others' places), the embedding on the first stage (and the last, tied), norm and LM
    head on the last; a stage after the first takes ``intermediate``, one before the last
    returns :class:`~tandem.distributed.pipeline.IntermediateTensors`. Its MoE layers
    exchange tokens over the stage's expert-parallel group.
    """

    def _init_common(self, vocab_size: int, hidden_size: int, eps: float, tie_word_embeddings: bool,
                     num_layers: int) -> None:
        info = ps.get_parallel_info()
        self.is_first_stage, self.is_last_stage = info.is_first_stage, info.is_last_stage
        self.start_layer, self.end_layer = pp_layer_range(num_layers, info.pp_rank, info.pp_size)
        # Uninitialised, as in tandem.models.llama: loading overwrites them.
        self.embed_tokens = (nn.utils.skip_init(nn.Embedding, vocab_size, hidden_size, device=torch.get_default_device())
                             if self.is_first_stage or self.is_last_stage and tie_word_embeddings else PPMissingLayer())
        self.norm = RMSNorm(hidden_size, eps) if self.is_last_stage else PPMissingLayer()
        self.tie_word_embeddings = tie_word_embeddings
        self.deterministic = batch_invariant.build_mode()  # the LM head's GEMM (compute_logits)
        if not tie_word_embeddings:
            self.lm_head = (nn.utils.skip_init(nn.Linear, hidden_size, vocab_size, bias=False,
                                               device=torch.get_default_device())
                            if self.is_last_stage else PPMissingLayer())

    def _stage_layers(self, num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
        """``build(i)`` for this stage's layers, ``PPMissingLayer`` for the others'."""
        return nn.ModuleList(build(i) if self.start_layer <= i < self.end_layer else PPMissingLayer()
                             for i in range(num_layers))

    @property
    def num_stage_layers(self) -> int:
        """Decoder layers on this pipeline stage (each needs a KV cache)."""
        return self.end_layer - self.start_layer

    def forward_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta: AttentionMetadata, intermediate: IntermediateTensors | None = None
                      ) -> Generator[str, None, torch.Tensor | IntermediateTensors]:
        """The forward as a generator that yields at every MoE layer's dispatch and combine
        launch, for dual-batch overlap (``tandem.worker.ubatching.run_ubatches``)."""
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        for layer, cache in zip(self.layers[self.start_layer:self.end_layer], kv_caches):
            hidden, residual = yield from layer.forward_steps(hidden, residual, positions, cache, meta)
        if not self.is_last_stage:
            return IntermediateTensors(hidden.apply_scales() if isinstance(hidden, UnscaledProduct) else hidden,
                                       residual)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        return drain(self.forward_steps(input_ids, positions, kv_caches, meta, intermediate))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return batch_invariant.linear(hidden, w, deterministic=self.deterministic).float()


def check_no_sliding_window(hf_config, max_positions: int) -> None:
    """Raises NotImplementedError for a sliding window shorter than the context."""
    sw = getattr(hf_config, "sliding_window", None)
    if sw is not None and sw < max_positions:
        raise NotImplementedError(f"sliding-window attention (window {sw} < context {max_positions}) is not supported")
