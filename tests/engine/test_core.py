"""``EngineCore`` helpers that need no model: the metadata of the memory-profile step."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.core import _profile_step_metadata


@pytest.mark.parametrize("tokens, max_len, lens", [(16384, 2048, [2048] * 8), (5000, 2048, [2048, 2048, 904]),
                                                   (2048, 4096, [2048])])
def test_profile_step_is_the_whole_token_budget_in_sequences_of_max_model_len(tokens, max_len, lens):
    """The profiled step holds every token a step may schedule (not one sequence's worth),
    each sequence in its own blocks past the null block, every slot once."""
    meta, num_blocks = _profile_step_metadata(tokens, max_len, 16, torch.device("cpu"))
    assert meta.seq_lens_cpu == lens and meta.seq_lens.tolist() == lens
    assert meta.query_start_loc_cpu[-1] == tokens and meta.query_start_loc.tolist() == meta.query_start_loc_cpu
    assert meta.slot_mapping.numel() == tokens and meta.slot_mapping.unique().numel() == tokens
    assert int(meta.slot_mapping.min()) >= 16 and int(meta.slot_mapping.max()) < num_blocks * 16
    for i, n in enumerate(lens):  # each sequence's slots come from its own block-table row
        s = meta.slot_mapping[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]]
        assert torch.equal(s // 16, meta.block_tables[i].long()[torch.arange(n) // 16])
    assert meta.num_decode_reqs == 0 and meta.max_query_len == max(lens)
