"""Paged attention in plain torch: the CPU backend and the reference for GPU kernels.

:class:`TorchAttentionBackend` is the CPU hot path. Its choices follow what torch's CPU
kernels do fast (``scaled_dot_product_attention`` dispatches to a flash-attention kernel
only for 4-D inputs and no grouped-query broadcast under a mask; ``aten::index`` copies
element by element while ``index_select`` copies rows):

* Prefill tokens (a fresh prompt, a chunk of one, a chunk on top of a cached prefix) go
  through :func:`split_attention`, whose arithmetic per query does not depend on how many
  queries are computed with it nor on how many keys were cached before: a prompt's logits
  are the same bits whether its prefix came from the prefix cache, how it was chunked and
  what else is in the step. (SDPA's flash kernel blocks the queries and keys by the
  chunk's own sizes: a prefix-cache hit changed the first sampled token's logprobs.)
* Decode requests run as one batch. Their blocks are gathered with one ``index_select``
  per plane into ``[num_decode, num_blocks * block_size, num_kv_heads, head_dim]`` (a
  buffer reused by every layer and step, grown when too small), and
  the query heads sharing a KV head are packed as that head's queries (``[num_decode,
  num_kv_heads, group, head_dim]``, as transformers' ``pack_gqa``), so no K/V head is
  repeated. In deterministic mode (``deterministic=True``) they go through
  :func:`split_attention` too: a token's attention is then the same in decode and in
  prefill, alone or batched.
* A single decode request (latency: one sequence) attends to exactly its ``seq_len`` keys
  with no mask (the flash kernel's unmasked path, as transformers' contiguous cache
  gives), read in place when its blocks are consecutive in the cache (the block pool
  hands out consecutive ids to a lone sequence) and gathered otherwise: the same values
  with the same strides, so the same bits.
* With ``cpu_kernels`` (fused-ops mode ``cpu``: the C++ kernels built), decode requests
  over a cache of the query's dtype are one op instead,
  :func:`tandem.layers.cpu_ops.paged_attention_decode`: it reads the blocks in place (no
  gather) and computes each (request, KV head) alone, so a request's output does not depend
  on its batch either.
* An FP8 cache (``--kv-cache-dtype fp8``) is always read back (gathered and converted to
  the query dtype, a fresh prefill included); the scales fold into the softmax scale and
  the output (exact: attention is linear in V).

:func:`reference_attention` is the plain per-request computation (the definition the
backends are tested against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.backend import write_kv_cache_at
from tandem.attention.metadata import AttentionMetadata
from tandem.layers import cpu_ops

KV_SPLIT = 128
"""Keys per split of :func:`split_attention`: fixed, whatever the batch or the phase."""
MIN_GEMM_ROWS = 16
"""Fewest rows of each GEMM of :func:`split_attention`: a query is padded to
``ceil(MIN_GEMM_ROWS / group)`` rows when it has fewer (a decode), since MKL's fp32 GEMM
rounds 1 to 11 rows differently from more (RESULTS: deterministic inference)."""


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, dtype: torch.dtype | None = None,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the first ``num_blocks`` blocks of each request (converted to ``dtype``,
    e.g. from an FP8 cache; unscaled).

    Returns keys and values of shape ``[num_reqs, num_blocks * block_size, num_kv_heads,
    head_dim]``: new tensors, or views of ``out`` (at least ``2 * num_reqs * num_blocks``
    blocks' worth of elements, cache dtype; used only when no conversion is needed).
    """
    idx = block_tables[:, :num_blocks].reshape(-1).long()
    r, bs = block_tables.shape[0], kv_cache.shape[2]
    block_shape = kv_cache.shape[2:]
    dtype = dtype or kv_cache.dtype
    if dtype != kv_cache.dtype:
        # index_select has no float8 CPU kernel: gather the bytes, then convert.
        raw = kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache
        k = raw[0].index_select(0, idx).view(kv_cache.dtype).to(dtype)
        v = raw[1].index_select(0, idx).view(kv_cache.dtype).to(dtype)
    elif out is None:
        k = kv_cache[0].index_select(0, idx)  # [R * nb, bs, H, D]
        v = kv_cache[1].index_select(0, idx)
    else:
        n = idx.numel() * block_shape.numel()
        k = torch.index_select(kv_cache[0], 0, idx, out=out[:n].view(idx.numel(), *block_shape))
        v = torch.index_select(kv_cache[1], 0, idx, out=out[n : 2 * n].view(idx.numel(), *block_shape))
    return k.view(r, num_blocks * bs, *block_shape[1:]), v.view(r, num_blocks * bs, *block_shape[1:])


class TorchAttentionBackend:
    """Decode requests as one packed batch, each prefill (or chunk) on its own; see the
    module docstring. ``deterministic``: decode requests through :func:`split_attention`
    too (batch-invariant mode, :mod:`tandem.layers.batch_invariant`). ``cpu_kernels``:
    decode requests through the C++ kernel (:mod:`tandem.layers.cpu_ops`, which must be
    :func:`~tandem.layers.cpu_ops.available`) where the cache has the query's dtype."""

    name = "torch"

    def __init__(self, deterministic: bool = False, cpu_kernels: bool = False) -> None:
        self.deterministic = deterministic
        self.cpu_kernels = cpu_kernels
        # Per-step inputs shared by every layer, built by the first layer of a step.
        self._step_meta: AttentionMetadata | None = None
        self._decode_mask: torch.Tensor | None = None
        # Decode K/V gathers of every layer land here: a fresh multi-MB tensor per layer
        # costs page faults and cold cache lines on every step.
        self._gather_buf: torch.Tensor | None = None
        # A lone decode request's first block when its blocks are consecutive (else None).
        self._first_block: int | None = None
        # The step's slot mapping with padding at slot 0 (write_kv_cache_at), and its step.
        self._slots_meta: AttentionMetadata | None = None
        self._slots: torch.Tensor | None = None
        # Each layer's cache as (keys, values) [slots, Hk, D] views, by the cache's storage
        # (a backend is made per engine: these views live as long as its caches do).
        self._cache_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        if self._slots_meta is not meta:  # one clamp per step, not per layer
            self._slots_meta, self._slots = meta, meta.slot_mapping.clamp(min=0)
        if kv_cache.dtype == k.dtype:
            k_slots, v_slots = self._slot_views(kv_cache)
            k_slots.index_copy_(0, self._slots, k)
            v_slots.index_copy_(0, self._slots, v)
        else:
            write_kv_cache_at(k, v, kv_cache, self._slots, k_scale, v_scale)
        out_scale = 1.0
        if kv_cache.dtype != q.dtype:
            scale, out_scale = scale * k_scale, v_scale
        nd = meta.num_decode_reqs
        if nd == meta.num_reqs and q.shape[0] == nd:
            out = self._decode(q, kv_cache, meta, scale)
        else:
            out = torch.empty_like(q)
            if nd > 0:
                out[:nd] = self._decode(q[:nd], kv_cache, meta, scale)
            qsl = meta.query_start_loc_cpu
            for r in range(nd, meta.num_reqs):
                start, end = qsl[r], qsl[r + 1]
                if end > start:
                    out[start:end] = self._prefill(q[start:end], kv_cache, meta, r, scale)
        return out if out_scale == 1.0 else out * out_scale

    def _slot_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_cache``'s keys and values as ``[num_blocks * block_size, Hk, D]`` views,
        made once per cache (three dispatched ops per layer and step otherwise)."""
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.dtype)
        views = self._cache_views.get(key)
        if views is None:
            flat = kv_cache.view(2, kv_cache.shape[1] * kv_cache.shape[2], *kv_cache.shape[3:])
            views = self._cache_views[key] = (flat[0], flat[1])
        return views

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """``q [nd, Hq, D]`` of the leading ``nd`` decode requests -> ``[nd, Hq, D]``."""
        nd, hq, d = q.shape
        if self.deterministic:
            return self._decode_split(q, kv_cache, meta, scale)
        if self.cpu_kernels and kv_cache.dtype == q.dtype:
            return cpu_ops.paged_attention_decode(q, kv_cache, meta.block_tables, meta.seq_lens, scale)
        if nd == 1:
            return self._decode_one(q, kv_cache, meta, scale)
        hk, bs = kv_cache.shape[3], kv_cache.shape[2]
        nb = -(-max(meta.seq_lens_cpu[:nd]) // bs)
        if self._step_meta is not meta:
            pos = torch.arange(nb * bs, device=q.device)
            self._decode_mask = (pos[None, :] < meta.seq_lens[:nd, None])[:, None, None, :]  # [nd, 1, 1, L]
            self._step_meta = meta
        buf = None
        if kv_cache.dtype == q.dtype:
            need = 2 * nd * nb * kv_cache[0, 0].numel()
            buf = self._gather_buf
            if buf is None or buf.numel() < need or buf.dtype != kv_cache.dtype or buf.device != kv_cache.device:
                buf = self._gather_buf = torch.empty(need, dtype=kv_cache.dtype, device=kv_cache.device)
        kc, vc = gather_kv(kv_cache, meta.block_tables[:nd], nb, q.dtype, out=buf)
        o = F.scaled_dot_product_attention(q.reshape(nd, hk, hq // hk, d), kc.transpose(1, 2), vc.transpose(1, 2),
                                           attn_mask=self._decode_mask, scale=scale)
        return o.reshape(nd, hq, d)  # SDPA on CUDA may return a transposed layout

    def _decode_one(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
        """``q [1, Hq, D]`` of a lone decode request -> ``[1, Hq, D]``."""
        _, hq, d = q.shape
        hk, bs = kv_cache.shape[3], kv_cache.shape[2]
        seq_len = meta.seq_lens_cpu[0]
        nb = -(-seq_len // bs)
        if self._step_meta is not meta:
            self._step_meta = meta
            self._first_block = _first_of_consecutive(meta.block_tables[0, :nb])
        if self._first_block is not None and kv_cache.dtype == q.dtype:
            # Keys and values of consecutive blocks as views, [2, 1, Hk, seq_len, D], in 4 ops.
            first = self._first_block
            kv = kv_cache[:, first:first + nb].view(2, 1, nb * bs, hk, d)[:, :, :seq_len].transpose(2, 3)
            kc, vc = kv.unbind(0)
        else:
            kc, vc = gather_kv(kv_cache, meta.block_tables[:1], nb, q.dtype)
            kc, vc = kc[:, :seq_len].transpose(1, 2), vc[:, :seq_len].transpose(1, 2)
        # Heads of one KV head as its query rows: [1, Hk, group, D] against [1, Hk, seq_len, D].
        o = F.scaled_dot_product_attention(q.reshape(1, hk, hq // hk, d), kc, vc, scale=scale)
        return o.reshape(1, hq, d)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, r: int,
                 scale: float) -> torch.Tensor:
        """Request ``r``'s ``q_len`` new tokens (``q [q_len, Hq, D]``; its new K/V are in
        the cache) by :func:`split_attention`: the same bits for a token however its prompt
        was chunked or cached."""
        q_len, seq_len, hq = q.shape[0], meta.seq_lens_cpu[r], q.shape[1]
        hk = kv_cache.shape[3]
        kc, vc = _split_keys(kv_cache, meta.block_tables[r : r + 1], seq_len)
        rows = max(q_len, _min_rows(hq // hk))
        pos = torch.arange(seq_len - q_len, seq_len - q_len + rows, device=q.device)
        pos[q_len:] = -1
        o = split_attention(_packed_queries(q[None], hk, rows), kc, vc, pos.repeat_interleave(hq // hk)[None], scale,
                            first_pos=seq_len - q_len)
        return _unpacked(o, q_len, hq)[0].to(q.dtype)

    def _decode_split(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
        """Deterministic mode's decode: ``q [nd, Hq, D]`` -> ``[nd, Hq, D]`` by
        :func:`split_attention`, each request's query padded as a prefill's would be."""
        nd, hq, _ = q.shape
        hk, g = kv_cache.shape[3], hq // kv_cache.shape[3]
        kc, vc = _split_keys(kv_cache, meta.block_tables[:nd], max(meta.seq_lens_cpu[:nd]))
        rows = _min_rows(g)
        pos = torch.full((nd, rows * g), -1, dtype=torch.long, device=q.device)
        pos[:, :g] = (meta.seq_lens[:nd].long() - 1)[:, None]
        o = split_attention(_packed_queries(q[:, None], hk, rows), kc, vc, pos, scale)
        return _unpacked(o, 1, hq)[:, 0].to(q.dtype)

def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    scale: float, first_pos: int | None = None) -> torch.Tensor:
    """Causal attention computed in a fixed order per query, in fp32.

    Args:
        q: ``[B, Hk, M, D]``: ``M`` query rows per KV head (query heads of a KV head
            packed), at least :data:`MIN_GEMM_ROWS` (pad rows of zeros).
        k, v: ``[B or 1, S, Hk, D]`` fp32, keys/values by position, ``S`` a multiple of
            :data:`KV_SPLIT` (positions past a query are masked, whatever they hold).
        q_pos: ``[B, M]`` int64 position of each query row; it sees keys ``<=`` it
            (-1: a pad row, whose output is NaN).
        scale: softmax scale.
        first_pos: for ``B = 1`` with rows in position order (a prefill: consecutive
            positions from ``first_pos``, ``group`` rows each, pad rows last), the first
            row's position: rows wholly before a split skip it (bit for bit what computing
            it gives, see below) down to :data:`MIN_GEMM_ROWS` rows. None: no skipping.

    Returns ``[B, Hk, M, D]`` fp32. The keys are taken :data:`KV_SPLIT` at a time in order;
    each split's scores and weighted values are GEMMs with a reduction of fixed length
    (``D``, then ``KV_SPLIT``) and at least :data:`MIN_GEMM_ROWS` rows, where a row's bits
    do not depend on the row count or the batch (measured, and tested); the splits merge
    as in flash-decoding (Dao et al. 2023), in order. A split
    wholly past a query adds exact zeros and multiplies by exactly 1, so how many splits a
    batch needs does not change a query's bits.
    """
    floor = torch.finfo(torch.float32).min
    q = q.float() * scale
    rows = q.shape[2]
    group = int((q_pos[0] == first_pos).sum()) if first_pos is not None else 0
    key_pos = torch.arange(KV_SPLIT, device=q.device)
    acc = m_run = l_run = None
    for j in range(k.shape[1] // KV_SPLIT):
        m0 = 0
        if first_pos is not None and j:
            m0 = min(max(0, j * KV_SPLIT - first_pos) * group, max(0, rows - MIN_GEMM_ROWS))
        k_j = k[:, j * KV_SPLIT:(j + 1) * KV_SPLIT].permute(0, 2, 3, 1)  # [B, Hk, D, KV]
        v_j = v[:, j * KV_SPLIT:(j + 1) * KV_SPLIT].transpose(1, 2)  # [B, Hk, KV, D]
        s = torch.matmul(q[:, :, m0:], k_j)  # [B, Hk, M - m0, KV]
        masked = (key_pos + j * KV_SPLIT)[None, None, :] > q_pos[:, m0:, None]  # [B, M - m0, KV]
        s.masked_fill_(masked[:, None], float("-inf"))
        m = s.amax(dim=-1, keepdim=True).clamp_min_(floor)
        p = (s - m).exp_()
        l_j, o = p.sum(dim=-1, keepdim=True), torch.matmul(p, v_j)
        if acc is None:
            acc, m_run, l_run = o, m, l_j
            continue
        m_new = torch.maximum(m_run[:, :, m0:], m)
        a, b = (m_run[:, :, m0:] - m_new).exp_(), (m - m_new).exp_()
        acc[:, :, m0:] = acc[:, :, m0:] * a + o * b
        l_run[:, :, m0:] = l_run[:, :, m0:] * a + l_j * b
        m_run[:, :, m0:] = m_new
    return acc / l_run


def _min_rows(group: int) -> int:
    """Query rows that give a :func:`split_attention` GEMM :data:`MIN_GEMM_ROWS` rows."""
    return -(-MIN_GEMM_ROWS // group)


def _split_keys(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' keys and values ``[R, S, Hk, D]`` in fp32, ``S`` = ``seq_len`` rounded
    up to :data:`KV_SPLIT`; blocks past a request's table are the null block's (masked)."""
    want = -(-seq_len // KV_SPLIT) * KV_SPLIT
    nb = -(-want // kv_cache.shape[2])
    table = block_tables[:, :nb]
    if table.shape[1] < nb:
        table = F.pad(table, (0, nb - table.shape[1]))
    k, v = gather_kv(kv_cache, table, nb, torch.float32)
    return k[:, :want], v[:, :want]


def _packed_queries(q: torch.Tensor, hk: int, rows: int) -> torch.Tensor:
    """``q [B, n, Hq, D]`` -> ``[B, Hk, rows * group, D]`` (``rows >= n``; pad rows zero),
    the query heads of each KV head packed row by row."""
    b, n, hq, d = q.shape
    g = hq // hk
    if rows > n:
        q = F.pad(q, (0, 0, 0, 0, 0, rows - n))
    return q.reshape(b, rows, hk, g, d).permute(0, 2, 1, 3, 4).reshape(b, hk, rows * g, d)


def _unpacked(o: torch.Tensor, n: int, hq: int) -> torch.Tensor:
    """Inverse of :func:`_packed_queries`: ``[B, Hk, rows * group, D]`` -> ``[B, n, Hq, D]``."""
    b, hk, m, d = o.shape
    g = hq // hk
    return o.reshape(b, hk, m // g, g, d).permute(0, 2, 1, 3, 4)[:, :n].reshape(b, n, hq, d)


def _first_of_consecutive(blocks: torch.Tensor) -> int | None:
    """The first id of ``blocks`` (a block-table row) when the ids are consecutive, else
    None; always None for a table on an accelerator (reading it would synchronise)."""
    if blocks.device.type != "cpu":
        return None
    ids = blocks.tolist()
    return ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None


def _bottom_right_causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """``[q_len, seq_len]`` bool: query ``i`` (position ``seq_len - q_len + i``) sees keys ``<=`` it."""
    qpos = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= qpos[:, None]


def reference_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Paged attention computed request by request in fp32 with an explicit softmax, after
    the step's K/V were written to ``kv_cache``. Shapes as :class:`AttentionBackend`."""
    out = torch.empty_like(q)
    bs, hk = kv_cache.shape[2], kv_cache.shape[3]
    qsl = meta.query_start_loc_cpu
    for r in range(meta.num_reqs):
        start, end, seq_len = qsl[r], qsl[r + 1], meta.seq_lens_cpu[r]
        if end == start:
            continue
        blocks = meta.block_tables[r, : -(-seq_len // bs)].long()
        kc = kv_cache[0][blocks].flatten(0, 1)[:seq_len].float()  # [S, Hk, D]
        vc = kv_cache[1][blocks].flatten(0, 1)[:seq_len].float()
        group = q.shape[1] // hk
        kc, vc = kc.repeat_interleave(group, 1), vc.repeat_interleave(group, 1)  # [S, Hq, D]
        s = torch.einsum("qhd,khd->hqk", q[start:end].float(), kc) * scale
        s = s.masked_fill(~_bottom_right_causal_mask(end - start, seq_len, q.device), float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vc).to(q.dtype)
    return out
