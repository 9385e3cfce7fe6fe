"""Paged attention in plain torch: the CPU backend and the reference for GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.backend import write_kv_cache
from tandem.attention.metadata import AttentionMetadata


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the first ``num_blocks`` blocks of each request (converted to ``dtype``,
    e.g. from an FP8 cache; unscaled).

    Returns keys and values of shape ``[num_reqs, num_blocks * block_size, num_kv_heads,
    head_dim]``.
    """
    blocks = block_tables[:, :num_blocks].long()
    dtype = dtype or kv_cache.dtype
    k = kv_cache[0][blocks].to(dtype)  # [R, nb, bs, H, D]
    v = kv_cache[1][blocks].to(dtype)
    r, nb, bs = k.shape[:3]
    return k.reshape(r, nb * bs, *k.shape[3:]), v.reshape(r, nb * bs, *v.shape[3:])


class TorchAttentionBackend:
    """Decode requests run as one padded batch; each prefill (or chunk) runs on its own.

    Both use ``scaled_dot_product_attention`` over K/V gathered from the paged cache with
    an explicit causal mask offset by the request's cached prefix.
    """

    name = "torch"

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
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        # FP8 cache: gathered blocks are read in q's dtype; the scales fold into the
        # softmax scale and the output (exact: attention is linear in V).
        out_scale = 1.0
        if kv_cache.dtype != q.dtype:
            scale, out_scale = scale * k_scale, v_scale
        out = torch.empty_like(q)
        block_size = kv_cache.shape[2]
        gqa = q.shape[1] != kv_cache.shape[3]
        nd = meta.num_decode_reqs
        if nd > 0:
            max_len = max(meta.seq_lens_cpu[:nd])
            nb = -(-max_len // block_size)
            kc, vc = gather_kv(kv_cache, meta.block_tables[:nd], nb, q.dtype)
            pos = torch.arange(nb * block_size, device=q.device)
            mask = pos[None, :] < meta.seq_lens[:nd, None]  # [nd, L]
            qd = q[:nd].unsqueeze(2)  # [nd, Hq, 1, D]
            o = F.scaled_dot_product_attention(
                qd, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask[:, None, None, :],
                scale=scale, enable_gqa=gqa,
            )
            out[:nd] = o.squeeze(2)
        qsl = meta.query_start_loc_cpu
        for r in range(nd, meta.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            if end == start:
                continue
            seq_len = meta.seq_lens_cpu[r]
            q_len = end - start
            nb = -(-seq_len // block_size)
            kc, vc = gather_kv(kv_cache, meta.block_tables[r : r + 1], nb, q.dtype)
            kc, vc = kc[0, :seq_len], vc[0, :seq_len]
            ctx = seq_len - q_len
            qpos = torch.arange(ctx, seq_len, device=q.device)
            kpos = torch.arange(seq_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), kc.transpose(0, 1), vc.transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=gqa,
            )
            out[start:end] = o.transpose(0, 1)
        return out if out_scale == 1.0 else out * out_scale
