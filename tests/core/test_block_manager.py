from __future__ import annotations

import pytest

from tandem.core.block_manager import KVCacheManager
from tandem.request import Request
from tandem.sampling_params import SamplingParams


def _req(tokens, **kw):
    return Request("r", list(tokens), SamplingParams(**kw), 0.0, max_tokens=16)


def test_prefix_hit_refcounts_and_free():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req(range(10))
    blocks, hit = kv.get_computed_blocks(a)
    assert (blocks, hit) == ([], 0)
    assert kv.allocate_slots(a, 10)
    assert len(kv.block_ids(a.seq_id)) == 3
    b = _req(list(range(8)) + [99, 98])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8 and [x.block_id for x in blocks] == kv.block_ids(a.seq_id)[:2]
    b.num_computed_tokens = hit
    assert kv.allocate_slots(b, 2, blocks)
    assert all(x.ref_cnt == 2 for x in blocks)
    kv.free(a)
    kv.free(a)  # idempotent
    assert all(x.ref_cnt == 1 for x in blocks)
    kv.free(b)
    assert kv.pool.num_free_blocks == 9


def test_full_prompt_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req(range(8))
    kv.allocate_slots(a, 8)
    kv.free(a)
    b = _req(range(8))
    _, hit = kv.get_computed_blocks(b)
    assert hit == 4  # the second block holds the last token, which must be recomputed


def test_lru_eviction_prefers_uncached_then_oldest():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    a = _req([1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    kv.free(a)  # two cached blocks now idle
    b = _req([9, 9, 8])
    kv.allocate_slots(b, 3)  # takes the two never-used blocks first
    assert kv.get_computed_blocks(_req([1, 2, 3, 4, 5]))[1] == 4
    c = _req([7, 7])
    kv.allocate_slots(c, 2)  # must evict one cached block: the tail one (freed first)
    assert kv.get_computed_blocks(_req([1, 2, 3, 4, 5]))[1] == 2


def test_prompt_logprobs_skip_prefix_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req(range(9))
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(_req(range(9), prompt_logprobs=1))[1] == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req(range(12))
    assert not kv.allocate_slots(a, 12)
    assert kv.pool.num_free_blocks == 2 and a.seq_id not in kv.req_blocks


def test_double_free_of_block_asserts():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    blocks = kv.pool.allocate(1)
    kv.pool.free(blocks)
    with pytest.raises(AssertionError):
        kv.pool.free(blocks)
