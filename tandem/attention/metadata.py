"""Per-step attention metadata shared by every attention layer of the model.

The layout follows the paged-attention design of vLLM (Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention", SOSP 2023): a request's
KV cache lives in fixed-size blocks; its block table maps logical block ``i`` (tokens
``i*block_size .. (i+1)*block_size-1``) to a physical block of the cache.

KV cache of one layer: a tensor of shape ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (index 0 = keys, 1 = values), dtype = model dtype. Physical slot
``s = block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Attention inputs of one forward pass (one step or one ubatch).

    Requests are laid out back to back in the flattened token dimension: request ``r``
    owns tokens ``query_start_loc[r] : query_start_loc[r+1]``. Its new tokens sit at
    positions ``num_computed_tokens[r] .. seq_lens[r]-1`` of its sequence; each query
    attends causally to every earlier position of its own sequence (cached prefix
    included).

    Attributes:
        query_start_loc: ``[num_reqs + 1]`` int32, cumulative query lengths (starts at 0).
        seq_lens: ``[num_reqs]`` int32, context length after this step (computed + new).
        num_computed_tokens: ``[num_reqs]`` int32, tokens already in the KV cache before
            this step (cached prefix, earlier chunks, earlier decode steps).
        block_tables: ``[num_reqs, max_blocks_per_req]`` int32 physical block ids; entries
            past a request's last block are unspecified (0).
        slot_mapping: ``[num_tokens]`` int64 cache slot of each new token; -1 for padding
            tokens, whose K/V are not written.
        max_query_len: longest query of the step (host int).
        max_seq_len: longest ``seq_lens`` entry (host int).
        query_start_loc_cpu: host copy of ``query_start_loc`` (list of ints).
        seq_lens_cpu: host copy of ``seq_lens`` (list of ints).
        num_decode_reqs: leading requests whose query length is 1. The model runner orders
            decode requests first so that backends can treat ``[:num_decode_reqs]`` as one
            uniform decode batch.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decode_reqs: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)
