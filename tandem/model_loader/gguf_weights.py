"""Tensors of a GGUF file under their Hugging Face names: dequantized with ``gguf``
(:func:`iterate_gguf_weights`), or as their raw quantized blocks (:func:`raw_gguf_weights`,
for the layers that run them quantized, :mod:`tandem.layers.quantization.gguf`).

llama.cpp's converter (``convert_hf_to_gguf.py``) interleaves the two RoPE halves of the
Llama q/k projection rows; both undo that (the raw blocks through ``RawWeight.unpermute``),
so the tensors equal the HF checkpoint's (up to the quantization).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass

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
    """A ``gguf.GGUFReader`` of the file (parses all its metadata: seconds for a tokenizer).

    Raises:
        ValueError: the file is not a whole GGUF file (no GGUF header, its metadata or a
            tensor's data cut off, as a truncated download leaves it), naming it and its size.
    """
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, struct.error, EOFError, IndexError) as e:  # what the reader raises on short data
        size = os.path.getsize(path)
        raise ValueError(f"{path} ({size:,} bytes) is not a whole GGUF file: truncated or damaged "
                         f"({type(e).__name__}: {e})") from e


def _hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor; None for one Tandem recomputes (``rope_freqs``).

    Raises:
        ValueError: the name has no HF equivalent.
    """
    for pat, repl in _GGUF_NAMES:
        if re.match(pat, gguf_name):
            return re.sub(pat, repl, gguf_name)
    if gguf_name == "rope_freqs.weight":
        return None  # llama3 RoPE factors; recomputed from the config
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")


def gguf_weight_count(reader) -> int:
    """How many tensors :func:`iterate_gguf_weights` yields for the reader's file.

    Raises:
        ValueError: a tensor name has no HF equivalent.
    """
    return sum(_hf_name(t.name) is not None for t in reader.tensors)


def _permuted_heads(name: str, hf_config) -> int | None:
    """The head count whose RoPE halves llama.cpp interleaved in this tensor's rows, or None."""
    if hf_config.model_type != "llama":
        return None
    if name.endswith("q_proj.weight"):
        return hf_config.num_attention_heads
    if name.endswith("k_proj.weight"):
        return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return None


@dataclass
class RawWeight:
    """A 2-D GGUF tensor as stored: ``data`` its blocks (``uint8``), ``qtype`` the GGML type
    name (``"Q4_1"``...), ``[rows, cols]`` the HF (output x input) shape, ``permute_heads``
    the head count of llama.cpp's q/k row interleaving (None: rows as in HF)."""

    data: np.ndarray
    qtype: str
    rows: int
    cols: int
    permute_heads: int | None

    def unpermute(self, per_row: np.ndarray) -> np.ndarray:
        """``per_row`` (``[rows, ...]``, values derived from this tensor's rows) in HF row order."""
        return per_row if self.permute_heads is None else _unpermute_rows(per_row, self.permute_heads)


def raw_gguf_weights(source, hf_config) -> dict[str, RawWeight]:
    """The 2-D tensors of a GGUF file by HF name, undequantized (memory-mapped by the reader).

    Raises:
        ValueError: a tensor name has no HF equivalent.
    """
    reader = open_gguf(source) if isinstance(source, str) else source
    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None or len(t.shape) != 2:
            continue
        # GGUF shapes list the fastest dimension first: [cols, rows].
        out[name] = RawWeight(t.data, t.tensor_type.name, int(t.shape[1]), int(t.shape[0]),
                              _permuted_heads(name, hf_config))
    return out


def iterate_gguf_weights(source, hf_config, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor of a GGUF file.

    Args:
        source: the file's path, or a reader from :func:`open_gguf`.
        hf_config: the model's HF config (``model_type``, head counts).
        skip: HF names left out (not dequantized).

    Raises:
        ValueError: a tensor name has no HF equivalent.
    """
    from gguf import dequantize

    reader = open_gguf(source) if isinstance(source, str) else source
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None or name in skip:
            continue
        w = dequantize(t.data, t.tensor_type)
        heads = _permuted_heads(name, hf_config)
        if heads is not None:
            w = _unpermute_rows(w, heads)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))
