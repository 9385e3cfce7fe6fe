"""Tensors of a GGUF file under their Hugging Face names, dequantized with ``gguf``.

llama.cpp's converter (``convert_hf_to_gguf.py``) interleaves the two RoPE halves of the
Llama q/k projection rows; :func:`iterate_gguf_weights` undoes that, so the tensors equal
the HF checkpoint's (up to the quantization).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

_GGUF_NAMES = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.attn_q_norm\.weight$", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"^blk\.(\d+)\.attn_k_norm\.weight$", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the two RoPE halves in q/k projection rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` of the file (parses all its metadata: seconds for a tokenizer)."""
    from gguf import GGUFReader

    return GGUFReader(path)


def dequantized_bytes(reader) -> int:
    """Bytes of all the reader's tensors once dequantized to fp32."""
    return sum(int(t.n_elements) for t in reader.tensors) * 4


def iterate_gguf_weights(source, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor of a GGUF file.

    Args:
        source: the file's path, or a reader from :func:`open_gguf`.
        hf_config: the model's HF config (``model_type``, head counts).

    Raises:
        ValueError: a tensor name has no HF equivalent.
    """
    from gguf import dequantize

    reader = open_gguf(source) if isinstance(source, str) else source
    permute = hf_config.model_type == "llama"
    n_head = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_head
    for t in reader.tensors:
        for pat, repl in _GGUF_NAMES:
            if re.match(pat, t.name):
                name = re.sub(pat, repl, t.name)
                break
        else:
            if t.name == "rope_freqs.weight":
                continue  # llama3 RoPE factors; recomputed from the config
            raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face equivalent")
        w = dequantize(t.data, t.tensor_type)
        if permute and name.endswith("q_proj.weight"):
            w = _unpermute_rows(w, n_head)
        elif permute and name.endswith("k_proj.weight"):
            w = _unpermute_rows(w, n_kv)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))
