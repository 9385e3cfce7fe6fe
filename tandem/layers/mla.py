"""Multi-head latent attention (MLA) of DeepSeek-V2 over a paged cache of compressed KV.

DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
Model", 2024, section 2.1. Per token the layer caches only

* ``c_kv``: the KV latent, ``kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])``, and
* ``k_pe``: the decoupled RoPE key shared by all heads (``qk_rope_head_dim``, rotated),

i.e. ``kv_lora_rank + qk_rope_head_dim`` numbers (576 for DeepSeek-V2/-Lite) instead of
``2 * num_heads * head_dim``.

Cache layout (one tensor per layer, allocated by the engine from the model's
``kv_cache_shape_per_block = (1, kv_lora_rank + qk_rope_head_dim)`` and
``kv_cache_num_planes = 1``): ``[1, num_blocks, block_size, 1, kv_lora_rank +
qk_rope_head_dim]``; slot ``s`` holds ``concat(c_kv, k_pe)`` of one token. There is no
separate value plane: the values are decompressed from the same latent.

Attention, as vLLM and FlashMLA split it:

* prefill / chunks (compute-bound, batched over requests): the latents of every context
  token of the step's prefill requests (``K = sum(seq_len)`` tokens, ``[K, kv_lora_rank +
  qk_rope_head_dim]``) are gathered in one indexing op through flat slot indices built on
  the device from the block tables and *decompressed* by one ``kv_b_proj`` GEMM into
  per-head ``k_nope [K, heads, qk_nope_head_dim]`` and values ``[K, heads, v_head_dim]``.
  On CUDA (``MLAAttention.prefill_backend``, chosen like the decode's) the
  variable-length causal flash-attention kernel
  :func:`tandem.attention.triton_prefill_varlen.flash_attn_varlen_func` then runs each
  request's queries over its own keys only (the shared ``k_pe`` read in place), as vLLM
  and FlashMLA do for prefill; the CPU reference instead runs one
  ``scaled_dot_product_attention`` over the group's packed queries and keys with a
  ``[Q, K]`` boolean mask (same request, causal over the cached prefix), quadratic in the
  group's tokens. Either way the kernel launches per layer do not grow with the number of
  requests and nothing syncs with the host; requests are split into consecutive groups
  (:func:`prefill_groups`) only to keep ``K`` under :data:`MLA_PREFILL_MAX_KEYS` (and, for
  the reference, ``Q * K`` under :data:`MLA_PREFILL_MASK_ELEMENTS`);
* decode (memory-bound): *absorbed* weights — ``kv_b_proj``'s key half is folded into the
  query (a bmm) and its value half applied after attention (a bmm), so attention runs
  directly over the cached latents (multi-query, keys ``[c_kv, k_pe]``, values ``c_kv``);
  nothing per head is materialised and the step is CUDA-graph safe (the ``W_uv`` bmm
  writes the layer's output rows in place). The attention itself
  is the paged split-KV Triton kernel :func:`tandem.attention.triton_mla.mla_decode_attention`
  (it reads the latents through the block tables) wherever the dense models get the Triton
  attention backend from :func:`tandem.attention.selector.get_attention_backend` (CUDA);
  elsewhere (CPU) a plain-torch reference gathers the latents and runs one padded, masked
  ``scaled_dot_product_attention`` (``MLAAttention.decode_backend`` overrides the choice).

Deterministic mode (``MLAAttention.deterministic``, the model's mode kept at build time,
:mod:`tandem.layers.batch_invariant`): both forms above depend on the batch. The prefill's
decompressed form is other arithmetic than the decode's absorbed one (a token's bits
changed between its prompt and a decode step), its masked SDPA reduces over the whole
group's packed keys and blocks the queries by the chunk's size (a token changed when
batched with other prompts, after a prefix-cache hit or chunked), and the decode's
``W_uk`` / ``W_uv`` bmms round a row by the batch's row count (MKL fp32). There every
token, prefill or decode, therefore takes the absorbed form. On the torch path
(:meth:`MLAAttention._attend_invariant`, the CPU): ``W_uk`` and ``W_uv`` applied per head
on fixed blocks of :data:`~tandem.layers.batch_invariant.ROW_BLOCK` tokens, and the latent
attention by :func:`tandem.attention.torch_backend.split_attention` (keys in fixed splits
in order, GEMMs of at least ``MIN_GEMM_ROWS`` rows), as the dense models' torch backend
does it. On the Triton path (:meth:`MLAAttention._attend_invariant_triton`, CUDA):
``W_uk`` / ``W_uv`` through the batch-invariant Triton GEMM per head, and each token as a
one-query request of the paged decode kernel (one launch configuration, no KV split),
whose context ends at its position. A token's output is then the same bits whatever the
step holds: alone or batched, prefilled whole, chunked, on a cached prefix or decoded. The
price is prefill attention in the latent space (``kv_lora_rank + rope`` per head and key
instead of ``qk_head_dim``).

New tokens: ``kv_a_layernorm``, RoPE of ``q_pe`` and ``k_pe``, the concat and the cache
write are one kernel on CUDA (:func:`tandem.layers.mla_latent.write_latents`, in the
model's fused-ops mode, kept as ``MLAAttention.fused_ops_mode``).

RoPE: transformers' DeepSeek-V2 rotates *interleaved* pairs ``(x[2i], x[2i+1])`` (complex
multiplication), not the NeoX halves; the softmax scale is ``qk_head_dim**-0.5`` times
``yarn_get_mscale(factor, mscale_all_dim)**2`` under YaRN scaling.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem import envs
from tandem.attention.selector import get_attention_backend
from tandem.attention.metadata import AttentionMetadata
from tandem.attention.torch_backend import KV_SPLIT, MIN_GEMM_ROWS, split_attention
from tandem.layers import batch_invariant, fused_ops
from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.layers.mla_latent import write_latents
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, rope_parameters

#: Bound on ``sum(q_len) * sum(seq_len)`` of one masked-SDPA (reference) prefill pass: its
#: mask has that many elements and its attention scores that many per head (when SDPA
#: materialises them: 16 heads x 2^24 x bf16 = 512 MiB), so larger steps are split into
#: several passes. The flash-attention path has no such term.
MLA_PREFILL_MASK_ELEMENTS = 1 << 24
#: Bound on ``sum(seq_len)`` of one pass: its decompressed keys and values take ``heads x
#: K x (qk_nope_head_dim + v_head_dim)`` elements on the flash path (16 x 2^15 x 256 x bf16
#: = 256 MiB at the DeepSeek-V2-Lite shape; the reference also expands ``k_pe`` per head),
#: so a few chunk tails with long cached contexts do not all expand at once; one request
#: longer than this runs alone.
MLA_PREFILL_MAX_KEYS = 1 << 15


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(hf_config) -> float:
    """``qk_head_dim**-0.5``, times ``mscale**2`` for YaRN with ``mscale_all_dim``."""
    qk_head_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    scale = qk_head_dim**-0.5
    params = rope_parameters(hf_config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """DeepSeek-V2 attention with HF parameter names (``q_proj`` or ``q_a_proj`` /
    ``q_a_layernorm`` / ``q_b_proj``; ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``).

    ``forward(x [T, H], positions [T], kv_cache [1, num_blocks, block_size, 1,
    kv_lora_rank + qk_rope_head_dim], meta) -> [T, H]``.
    """

    #: Decode attention: ``"triton"`` (paged kernel), ``"torch"`` (gather + SDPA reference)
    #: or ``None``: the kind of backend ``get_attention_backend`` gives the dense models on
    #: the input's device (Triton on CUDA, torch on the CPU). Deterministic mode on the CPU
    #: overrides it and ``prefill_backend`` (:meth:`_attend_invariant`).
    decode_backend: str | None = None

    def __init__(self, hf_config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        c = hf_config
        self.num_heads = c.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = c.q_lora_rank, c.kv_lora_rank
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.qk_dim = self.nope + self.rope
        bias = bool(getattr(c, "attention_bias", False))
        h = c.hidden_size
        # Unsharded (TP 1) linear layers of tandem.layers.linear, so that FP8 quantization
        # applies to them as to every other projection (ParallelMLAAttention shards some).
        linear = lambda i, o, b: ColumnParallelLinear(i, o, bias=b, tp_size=1, tp_rank=0)  # noqa: E731
        if self.q_lora_rank is None:
            self.q_proj = linear(h, self.num_heads * self.qk_dim, False)
        else:
            self.q_a_proj = linear(h, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # HF uses the default eps here
            self.q_b_proj = linear(self.q_lora_rank, self.num_heads * self.qk_dim, False)
        self.kv_a_proj_with_mqa = linear(h, self.kv_lora_rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), False)
        # Row-parallel (one rank) as under TP, so that an FP8 o_proj may leave its output
        # scales to the norm after the attention (tandem.layers.linear).
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, h, bias=bias, tp_size=1, tp_rank=0)
        self.rotary = rotary
        self.scale = mla_softmax_scale(c)
        #: Prefill attention, the same choice: ``"triton"`` (decompress, then the
        #: variable-length flash-attention kernel), ``"torch"`` (decompress, then one masked
        #: SDPA per group: the reference) or ``None``; ``TANDEM_MLA_PREFILL`` sets it.
        mode = envs.TANDEM_MLA_PREFILL
        self.prefill_backend: str | None = None if mode == "auto" else mode
        #: Deterministic mode (module docstring), the model's, fixed at build time.
        self.deterministic = batch_invariant.build_mode()
        #: The fused-ops mode of the latent write, the model's, fixed at build time.
        self.fused_ops_mode = fused_ops.build_mode()

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, self.qk_dim).split([self.nope, self.rope], dim=-1)
        # kv_a_layernorm, RoPE of q_pe and k_pe, concat and cache write: one launch on CUDA.
        q_pe = write_latents(q_pe, self.kv_a_proj_with_mqa(x), self.kv_a_layernorm, self.rotary.cos, self.rotary.sin,
                             positions, kv_cache, meta.slot_mapping, mode=self.fused_ops_mode)
        o = self._attend(q_nope, q_pe, kv_cache, meta)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decompress ``latent [..., L, kv_lora_rank + rope]`` into keys ``[..., heads, L,
        qk_dim]`` and values ``[..., heads, L, v_head_dim]``."""
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).unflatten(-1, (self.num_heads, self.nope + self.v_dim))  # [..., L, h, nope+v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope)), dim=-1)
        return k.transpose(-3, -2), v.transpose(-3, -2)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj`` split per head: ``W_uk [heads, nope, kv_lora_rank]`` and ``W_uv
        [heads, v_head_dim, kv_lora_rank]`` (views, no copy)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.deterministic:
            if self._decode_uses_triton(q_nope.device):
                return self._attend_invariant_triton(q_nope, q_pe, kv_cache, meta)
            return self._attend_invariant(q_nope, q_pe, kv_cache, meta)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        nd = meta.num_decode_reqs
        if nd > 0:
            self._decode_absorbed(q_nope[:nd], q_pe[:nd], kv_cache, meta, out[:nd])
        qsl = meta.query_start_loc_cpu
        if self._prefill_uses_triton(q_nope.device):
            for r0, r1 in prefill_groups(qsl, meta.seq_lens_cpu, nd, meta.num_reqs, None, MLA_PREFILL_MAX_KEYS):
                self._prefill_flash(q_nope, q_pe, kv_cache, meta, r0, r1, out)
            return out
        for r0, r1 in prefill_groups(qsl, meta.seq_lens_cpu, nd, meta.num_reqs, MLA_PREFILL_MASK_ELEMENTS,
                                     MLA_PREFILL_MAX_KEYS):
            start, end = qsl[r0], qsl[r1]
            out[start:end] = self._prefill_batched(q_nope[start:end], q_pe[start:end], kv_cache, meta, r0, r1)
        return out

    def _attend_invariant(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor:
        """Deterministic mode's attention (module docstring): every token in the absorbed
        form, so that its bits do not depend on the step. ``q_lat = q_nope W_uk`` and the
        ``W_uv`` map run on fixed token blocks (:func:`absorb_per_head`); the latent
        attention (MQA: one key head of ``kv_lora_rank + rope``, the heads packed as its
        query rows) by :func:`split_attention`: the decodes as one batch, each request's
        query padded to ``MIN_GEMM_ROWS`` rows, and each prefill request alone, as the
        dense torch backend runs them. Returns ``[T, heads, v_head_dim]``."""
        w_uk, w_uv = self._absorbed_weights()
        q = torch.cat((absorb_per_head(q_nope, w_uk), q_pe), dim=-1)  # [T, h, r + rope]
        t, h, d = q.shape
        rank, dev = self.kv_lora_rank, q.device
        min_rows = -(-MIN_GEMM_ROWS // h)  # tokens whose packed heads give a GEMM MIN_GEMM_ROWS rows
        o = q.new_empty(t, h, rank)
        nd = meta.num_decode_reqs
        if nd > 0:
            lat = split_latents(kv_cache, meta.block_tables[:nd], max(meta.seq_lens_cpu[:nd]))
            pos = torch.full((nd, min_rows * h), -1, dtype=torch.long, device=dev)
            pos[:, :h] = (meta.seq_lens[:nd].long() - 1)[:, None]
            qd = F.pad(q[:nd, None], (0, 0, 0, 0, 0, min_rows - 1)).view(nd, 1, min_rows * h, d)
            o[:nd] = split_attention(qd, lat, lat[..., :rank], pos, self.scale)[:, 0, :h]
        qsl = meta.query_start_loc_cpu
        for r in range(nd, meta.num_reqs):
            start, end, seq_len = qsl[r], qsl[r + 1], meta.seq_lens_cpu[r]
            q_len = end - start
            if q_len == 0:
                continue
            rows = max(q_len, min_rows)
            lat = split_latents(kv_cache, meta.block_tables[r: r + 1], seq_len)
            pos = torch.arange(seq_len - q_len, seq_len - q_len + rows, device=dev)
            pos[q_len:] = -1
            qr = F.pad(q[start:end], (0, 0, 0, 0, 0, rows - q_len)).view(1, 1, rows * h, d)
            o_r = split_attention(qr, lat, lat[..., :rank], pos.repeat_interleave(h)[None], self.scale,
                                  first_pos=seq_len - q_len)
            o[start:end] = o_r.view(rows, h, rank)[:q_len]
        return absorb_per_head(o, w_uv.transpose(1, 2))

    def _attend_invariant_triton(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                                 meta: AttentionMetadata) -> torch.Tensor:
        """Deterministic mode with the Triton kernels (CUDA): every token, prompt or decode,
        in the absorbed form through the paged MLA decode kernel, as a one-query request whose
        context ends at its own position (:func:`per_token_contexts`; a prompt's latents are
        in the cache before attention), with one launch configuration and no KV split
        (:func:`~tandem.attention.triton_mla.mla_decode_attention` in deterministic mode);
        ``W_uk`` / ``W_uv`` through the batch-invariant GEMM, all heads in one launch
        (:func:`absorb_per_head_triton`). Returns ``[T, heads, v_head_dim]``."""
        from tandem.attention.triton_mla import mla_decode_attention

        w_uk, w_uv = self._absorbed_weights()
        q_lat = absorb_per_head_triton(q_nope, w_uk)
        tables, seq_lens = per_token_contexts(meta, q_nope.shape[0])
        o = mla_decode_attention(q_lat, q_pe, kv_cache, tables, seq_lens, self.scale, deterministic=True)
        return absorb_per_head_triton(o, w_uv.transpose(1, 2))

    def _gather_context(self, kv_cache: torch.Tensor, meta: AttentionMetadata, r0: int, r1: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cached latents of every context token of requests ``r0 .. r1-1``, packed
        request after request: ``latent [K = sum(seq_len), latent_dim]`` in ``dtype``, with
        each key's request index ``k_req [K]`` (0-based within the range) and position
        ``k_pos [K]`` in its sequence. One indexing op through flat slots computed on the
        device from the block tables; no host sync (K comes from the host lists)."""
        dev = meta.seq_lens.device
        num_k = sum(meta.seq_lens_cpu[r0:r1])
        seq_lens = meta.seq_lens[r0:r1]
        # output_size: repeat_interleave would otherwise read the total back from the device.
        k_req = torch.repeat_interleave(torch.arange(r1 - r0, device=dev), seq_lens, output_size=num_k)
        k_pos = torch.arange(num_k, device=dev) - (torch.cumsum(seq_lens, 0) - seq_lens)[k_req]
        block_size = kv_cache.shape[2]
        blocks = meta.block_tables[r0:r1][k_req, k_pos // block_size]
        slots = blocks.long() * block_size + k_pos % block_size
        return kv_cache[0].view(-1, kv_cache.shape[-1])[slots].to(dtype), k_req, k_pos

    def _prefill_flash(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, r0: int, r1: int, out: torch.Tensor) -> None:
        """Requests ``r0 .. r1-1`` on the Triton path: their context latents are decompressed
        by one ``kv_b_proj`` GEMM into ``k_nope`` / ``v`` ``[K, heads, *]`` (views of its
        output) and the variable-length flash-attention kernel runs each request's queries
        over its own keys only, with the shared RoPE key ``k_pe [K, 1, rope]`` read in place
        (no per-head copy). Reads ``q_nope`` / ``q_pe [T, heads, *]`` and writes ``out [T,
        heads, v_head_dim]`` at the requests' rows."""
        from tandem.attention.triton_prefill_varlen import flash_attn_varlen_func

        latent, _, _ = self._gather_context(kv_cache, meta, r0, r1, q_nope.dtype)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).view(latent.shape[0], self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens[r0:r1], 0, dtype=torch.int32), (1, 0))
        flash_attn_varlen_func(q_nope, k_nope, v, meta.query_start_loc[r0: r1 + 1], cu_seqlens_k, meta.max_query_len,
                               self.scale, q_rope=q_pe, k_rope=k_pe[:, None], out=out)

    def _prefill_batched(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata, r0: int, r1: int) -> torch.Tensor:
        """The torch (reference) path: decompressed attention of requests ``r0 .. r1-1``
        (their packed queries ``q_nope`` / ``q_pe``) in one masked SDPA over all their
        context latents. Returns ``[Q, heads, v_head_dim]``."""
        dev = q_nope.device
        qsl = meta.query_start_loc_cpu
        num_q = qsl[r1] - qsl[r0]
        latent, k_req, k_pos = self._gather_context(kv_cache, meta, r0, r1, q_nope.dtype)
        k, v = self.expand_latent(latent)  # [h, K, *]
        q_ends = meta.query_start_loc[r0 + 1: r1 + 1]
        q_req = torch.repeat_interleave(torch.arange(r1 - r0, device=dev), q_ends - meta.query_start_loc[r0:r1],
                                        output_size=num_q)
        # The queries are the last q_len tokens of their sequence: token t of request r sits
        # at position seq_len_r - (q_end_r - t).
        q_pos = torch.arange(qsl[r0], qsl[r1], device=dev) + (meta.seq_lens[r0:r1] - q_ends)[q_req]
        mask = (q_req[:, None] == k_req[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [h, Q, qk]
        # 4-D so that CUDA may pick a fused (memory-efficient) kernel, which takes only 4-D
        # inputs, instead of materialising [h, Q, K] scores.
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)

    def _decode_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Decode requests (one query each) attend in the latent space: ``W_uk`` is folded
        into the query (``q_lat = q_nope W_uk``, so ``q_lat . c_kv = q_nope . k_nope``), the
        keys are the cached latents ``[c_kv, k_pe]`` shared by all heads (MQA with head
        dim ``kv_lora_rank + rope``), the values ``c_kv``, and ``W_uv`` maps the result to
        ``v_head_dim`` — no per-head K/V is materialised.

        Triton (:meth:`_decode_uses_triton`): the paged split-KV kernel reads the latents
        through the block tables, no host sync. Torch: the latents are gathered and one
        masked SDPA runs over the padded batch; under CUDA-graph capture the whole block
        table is read (lengths come from the device ``seq_lens``).
        Writes ``out [nd, heads, v_head_dim]`` (the ``W_uv`` bmm's output, no copy)."""
        w_uk, w_uv = self._absorbed_weights()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [h, nd, r]
        if self._decode_uses_triton(q_nope.device):
            from tandem.attention.triton_mla import mla_decode_attention

            o = torch.empty_like(q_lat)  # [h, nd, r]: the kernel writes it as [nd, h, r]
            mla_decode_attention(q_lat.transpose(0, 1), q_pe, kv_cache, meta.block_tables, meta.seq_lens,
                                 self.scale, out=o.transpose(0, 1), max_seq_len=meta.max_seq_len)
        else:
            o = self._decode_attention_torch(q_lat.transpose(0, 1), q_pe, kv_cache, meta).transpose(0, 1)
        if torch.is_grad_enabled():  # out= has no autograd; the engine runs without grad
            out.copy_(torch.bmm(o, w_uv.transpose(1, 2)).transpose(0, 1))
        else:
            torch.bmm(o, w_uv.transpose(1, 2), out=out.transpose(0, 1))

    def _decode_uses_triton(self, device: torch.device) -> bool:
        return _uses_triton("decode_backend", self.decode_backend, device)

    def _prefill_uses_triton(self, device: torch.device) -> bool:
        return _uses_triton("prefill_backend", self.prefill_backend, device)

    def _decode_attention_torch(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                                meta: AttentionMetadata) -> torch.Tensor:
        """Reference latent attention: ``[nd, h, r]`` from ``q_lat [nd, h, r]``, ``q_pe``."""
        nd = q_lat.shape[0]
        block_size = kv_cache.shape[2]
        if q_lat.is_cuda and torch.cuda.is_current_stream_capturing():
            nb = meta.block_tables.shape[1]
        else:
            nb = -(-max(meta.seq_lens_cpu[:nd]) // block_size)
        q = torch.cat((q_lat, q_pe), dim=-1).unsqueeze(2)  # [nd, h, 1, r + rope]
        lat = gather_latent(kv_cache, meta.block_tables[:nd], nb).to(q.dtype).unsqueeze(1)  # [nd, 1, L, r + rope]
        mask = torch.arange(nb * block_size, device=q.device)[None, :] < meta.seq_lens[:nd, None]
        o = F.scaled_dot_product_attention(q, lat, lat[..., : self.kv_lora_rank], attn_mask=mask[:, None, None, :],
                                           scale=self.scale, enable_gqa=True)  # [nd, h, 1, r]
        return o.squeeze(2)


def _uses_triton(field: str, choice: str | None, device: torch.device) -> bool:
    """The one decision between the Triton kernels and the torch reference: ``choice``
    (``"triton"``, ``"torch"``, or None: the kind of backend the dense models get on
    ``device``). Raises ValueError naming ``field`` for any other value, and for Triton on a
    CPU without Triton's interpreter (``TRITON_INTERPRET=1``: tests only)."""
    if choice is None:
        return _default_backend_name(device.type) == "triton"
    if choice not in ("triton", "torch"):
        raise ValueError(f"{field} must be 'triton', 'torch' or None, got {choice!r}")
    if choice == "triton" and device.type == "cpu" and not _triton_interpreting():
        raise ValueError(f"{field}='triton' needs a CUDA device (or TRITON_INTERPRET=1 on the CPU); "
                         f"use 'torch' or leave it unset")
    return choice == "triton"


def _triton_interpreting() -> bool:
    from tandem.triton_utils import INTERPRET

    return INTERPRET


@functools.cache
def _default_backend_name(device_type: str) -> str:
    """Name of the attention backend the dense models get on this kind of device."""
    return get_attention_backend(torch.device(device_type)).name


def prefill_groups(query_start_loc: list[int], seq_lens: list[int], first: int, last: int,
                   max_elements: int | None, max_keys: int | None = None) -> list[tuple[int, int]]:
    """Split requests ``first .. last-1`` into consecutive ranges ``(r0, r1)``, each one
    batched prefill pass, whose ``sum(q_len) * sum(seq_len)`` stays within
    ``max_elements`` and ``sum(seq_len)`` (the keys decompressed at once) within
    ``max_keys`` (None: no such bound); a request over a bound on its own forms a group.
    Requests without queries belong to no group: their keys would be gathered and
    expanded for nothing."""
    groups: list[tuple[int, int]] = []
    r0, num_q, num_k = first, 0, 0
    for r in range(first, last):
        q_len, seq_len = query_start_loc[r + 1] - query_start_loc[r], seq_lens[r]
        over = ((max_elements is not None and (num_q + q_len) * (num_k + seq_len) > max_elements)
                or (max_keys is not None and num_k + seq_len > max_keys))
        if r > r0 and (q_len == 0 or over):
            groups.append((r0, r))
            r0, num_q, num_k = r, 0, 0
        if q_len == 0:
            r0 = r + 1
            continue
        num_q, num_k = num_q + q_len, num_k + seq_len
    if last > r0:
        groups.append((r0, last))
    return groups


def absorb_per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, a]`` times each head's ``w [heads, a, b]`` -> ``[T, heads, b]``, as one
    bmm per :data:`~tandem.layers.batch_invariant.ROW_BLOCK` tokens
    (:func:`~tandem.layers.batch_invariant.row_blocked`): every token goes through a bmm of
    the one shape, so its bits do not depend on ``T`` (one bmm over all tokens rounds a row
    by the row count, as the GEMMs do)."""
    t, h, a = x.shape
    b = w.shape[-1]
    if t == 0:
        return x.new_empty(0, h, b)

    def bmm(rows: torch.Tensor) -> torch.Tensor:
        return torch.bmm(rows.view(-1, h, a).transpose(0, 1), w).transpose(0, 1).reshape(-1, h * b)

    return batch_invariant.row_blocked(bmm, x.reshape(t, h * a), h * b).view(t, h, b)


def absorb_per_head_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`absorb_per_head` by the batch-invariant Triton GEMM, every head in one launch
    (:func:`~tandem.layers.matmul_triton.bmm_batch_invariant`: a token's bits do not depend
    on ``T``); CUDA, or the CPU in Triton's interpreter."""
    from tandem.layers.matmul_triton import bmm_batch_invariant

    return bmm_batch_invariant(x, w)


def per_token_contexts(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of the step as a one-query request of the MLA decode kernel: ``(block
    tables [T, W] int32, seq_lens [T] int32)``, token ``t`` of request ``r`` reading ``r``'s
    blocks up to its own position (``seq_lens[r] - (query end of r - 1 - t)``); tokens past
    the step's (padding) get length 0, a zero output. A decode-only step is its metadata as
    is. Device ops only, no host sync (the token count is a host int)."""
    if meta.num_decode_reqs == meta.num_reqs == num_tokens:
        return meta.block_tables, meta.seq_lens
    n = meta.query_start_loc_cpu[-1]
    dev = meta.seq_lens.device
    ends = meta.query_start_loc[1:].long()
    req = torch.repeat_interleave(torch.arange(meta.num_reqs, device=dev), ends - meta.query_start_loc[:-1].long(),
                                  output_size=n)
    seq_lens = meta.seq_lens[req].long() - (ends[req] - 1 - torch.arange(n, device=dev))
    tables = meta.block_tables[req]
    if num_tokens > n:
        seq_lens = F.pad(seq_lens, (0, num_tokens - n))
        tables = F.pad(tables, (0, 0, 0, num_tokens - n))
    return tables, seq_lens.to(torch.int32)


def split_latents(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The requests' latents as :func:`split_attention`'s keys: ``[R, S, 1, D]`` fp32, ``S``
    = ``seq_len`` rounded up to :data:`KV_SPLIT`; blocks past a request's table are the null
    block's (masked)."""
    want = -(-seq_len // KV_SPLIT) * KV_SPLIT
    nb = -(-want // kv_cache.shape[2])
    table = block_tables[:, :nb]
    if table.shape[1] < nb:
        table = F.pad(table, (0, nb - table.shape[1]))
    return gather_latent(kv_cache, table, nb)[:, :want].float().unsqueeze(2)


def gather_latent(kv_cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Latents of the first ``num_blocks`` blocks of each request: ``[R, num_blocks *
    block_size, D]``."""
    lat = kv_cache[0][block_tables[:, :num_blocks].long()]  # [R, nb, bs, 1, D]
    r, nb, bs = lat.shape[:3]
    return lat.reshape(r, nb * bs, lat.shape[-1])
