"""EAGLE draft heads over a target model's hidden states, in the public Hugging Face layout.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty") drafts from the target's features: the head at position ``p`` takes the
embedding of token ``t[p+1]`` and the target's hidden state at ``p`` and predicts the
hidden state at ``p+1``, whose logits give the draft of ``t[p+2]``; later drafts feed the
head's own output back as the hidden state. EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test") takes the inputs
of three target layers instead of the last hidden state, fused by ``fc``, and has an LM
head of its own over a smaller draft vocabulary mapped into the target's (``d2t``).

Both heads share the target's token embedding (and EAGLE-1 its LM head): a head's
checkpoint may hold copies of them, which are not loaded (as in vLLM with one pipeline
stage). ``forward(input_ids [T], positions [T], hidden [T, H], kv_caches, meta) ->
(logits_hidden [T, H], next_hidden [T, H])``: the states whose logits are the drafts,
and the states fed to the next draft position.

Checkpoint layouts (vLLM's ``llama_eagle.py`` / ``llama_eagle3.py`` read the same):

* EAGLE-1 (e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``): ``fc.weight [H, 2H]`` (``fc.bias``
  optional) over ``[embedding, hidden]``, then ``layers.{i}.*`` Llama decoder layers, the
  first without its input RMSNorm; no final norm; the output goes to the target's LM head.
* EAGLE-3 (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): ``fc.weight [H, 3 * H_target]``,
  one decoder layer ``midlayer.*`` whose q/k/v projections take ``[norm(embedding),
  hidden_norm(hidden)]`` (``2H`` wide) and whose residual stream starts at the hidden state,
  the final ``norm``, ``lm_head.weight [draft_vocab, H]`` and ``d2t [draft_vocab]`` (target id
  = draft id + ``d2t[draft id]``); ``t2d`` is not needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.attention.metadata import AttentionMetadata
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.llama import MLP, Attention, DecoderLayer, DecoderSpec, load_decoder_weights


@dataclass(frozen=True)
class TargetParts:
    """What a head uses of its target model (held as a plain attribute, so that the
    target's parameters are not the head's)."""

    embed_tokens: nn.Module  # ids [T] -> [T, H]
    compute_logits: Callable[[torch.Tensor], torch.Tensor]  # [N, H] -> [N, vocab] fp32


def default_aux_hidden_state_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head takes when its config does not say
    (``eagle_aux_hidden_state_layer_ids``): an early, the middle and a late one, as the
    public heads were trained (and vLLM and SGLang pick them)."""
    return 2, num_target_layers // 2, num_target_layers - 3


class EagleLlamaForCausalLM(nn.Module):
    """EAGLE-1 head (module docstring): ``fc`` over ``[embedding, hidden]``, Llama decoder
    layers (the first without input norm), the target's LM head."""

    def __init__(self, hf_config, backend: AttentionBackend, target: TargetParts, max_positions: int | None = None
                 ) -> None:
        super().__init__()
        spec = DecoderSpec.from_hf_config(hf_config)
        self.spec = spec
        self.target = target
        self.rotary = RotaryEmbedding(hf_config, spec.head_dim, max_positions or spec.max_position_embeddings)
        # Zero unless the checkpoint has one: heads are published with and without it.
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=True)
        nn.init.zeros_(self.fc.bias)
        self.layers = nn.ModuleList(DecoderLayer(spec, self.rotary, backend) for _ in range(spec.num_layers))
        self.layers[0].input_layernorm = nn.Identity()

    @property
    def kv_cache_shape_per_block(self) -> tuple[int, int]:
        return self.layers[0].self_attn.num_kv_heads, self.spec.head_dim

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states ``[T, H]`` as this head takes them (unchanged)."""
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([self.target.embed_tokens(input_ids), hidden], dim=-1))
        self.rotary.begin_step(positions)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, cache, meta)
        out = x + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raises ValueError: a tensor without a parameter, a shape differs, or one is missing."""
        load_decoder_weights(self, _own_weights(weights, skip=("embed_tokens.", "lm_head.")), optional=("fc.bias",))


class Eagle3DecoderLayer(nn.Module):
    """The EAGLE-3 head's one layer: attention over ``[input_layernorm(embedding),
    hidden_norm(hidden)]`` with the hidden state as the residual stream, then the MLP.
    ``norm_before_residual`` (a config switch of some heads): the residual stream starts at
    the normalized hidden state instead."""

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 norm_before_residual: bool) -> None:
        super().__init__()
        self.self_attn = Attention(spec, rotary, backend, input_size=2 * spec.hidden_size)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(nn.Module):
    """EAGLE-3 head (module docstring). ``combine_hidden_states`` fuses the target's three
    layer inputs; ``forward`` returns (final-normed, pre-norm) states; ``compute_logits``
    gives target-vocabulary logits, -inf outside the draft vocabulary.

    Raises:
        ValueError: a config of more than one layer (the public heads have one).
    """

    def __init__(self, hf_config, backend: AttentionBackend, target: TargetParts, max_positions: int | None = None
                 ) -> None:
        super().__init__()
        spec = DecoderSpec.from_hf_config(hf_config)
        if spec.num_layers != 1:
            raise ValueError(f"an EAGLE-3 head has one decoder layer (midlayer); this config has {spec.num_layers}")
        self.spec = spec
        self.target = target
        self.rotary = RotaryEmbedding(hf_config, spec.head_dim, max_positions or spec.max_position_embeddings)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(spec, self.rotary, backend,
                                                        bool(getattr(hf_config, "norm_before_residual", False)))])
        target_hidden = getattr(hf_config, "target_hidden_size", None) or spec.hidden_size
        self.fc = nn.Linear(3 * target_hidden, spec.hidden_size, bias=False)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.draft_vocab_size = getattr(hf_config, "draft_vocab_size", None) or spec.vocab_size
        self.lm_head = nn.Linear(spec.hidden_size, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))

    @property
    def kv_cache_shape_per_block(self) -> tuple[int, int]:
        return self.layers[0].self_attn.num_kv_heads, self.spec.head_dim

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """``[T, 3 * H_target]`` (the target's three layer inputs) -> ``[T, H]``."""
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        self.rotary.begin_step(positions)
        x, residual = self.layers[0](self.target.embed_tokens(input_ids), hidden, positions, kv_caches[0], meta)
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(hidden, self.lm_head.weight).float()
        if self.draft_vocab_size == self.spec.vocab_size and not self.d2t.any():
            return logits
        full = logits.new_full((logits.shape[0], self.spec.vocab_size), float("-inf"))
        full[:, torch.arange(self.draft_vocab_size, device=logits.device) + self.d2t] = logits
        return full

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raises ValueError: a tensor without a parameter, a shape differs, one is missing,
        or a draft vocabulary smaller than the target's comes without ``d2t``."""
        names: set[str] = set()

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in _own_weights(weights, skip=("embed_tokens.", "t2d")):
                names.add(name)
                yield name.replace("midlayer.", "layers.0.", 1), tensor

        load_decoder_weights(self, renamed())
        if self.draft_vocab_size != self.spec.vocab_size and "d2t" not in names:
            raise ValueError(f"an EAGLE-3 head of {self.draft_vocab_size} draft tokens (target: {self.spec.vocab_size}) "
                             f"needs its d2t mapping; the checkpoint has none")


def _own_weights(weights: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...]
                 ) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without a ``model.`` prefix, less those starting with
    ``skip`` (the target's, shared)."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if not name.startswith(skip):
            yield name, tensor


HEADS = {"eagle": EagleLlamaForCausalLM, "eagle3": Eagle3LlamaForCausalLM}

__all__ = ["HEADS", "Eagle3LlamaForCausalLM", "EagleLlamaForCausalLM", "TargetParts",
           "default_aux_hidden_state_layers"]
