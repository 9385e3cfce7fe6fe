"""Paged KV cache block management with automatic prefix caching.

Design after vLLM's block manager (PagedAttention, Kwon et al. SOSP 2023) and its
automatic prefix caching: a *full* block is identified by a hash chained with its parent
block's hash, ``hash((parent_hash, tokens_of_block))``, so equal hashes mean equal whole
prefixes. Blocks are reference counted; a block whose count drops to zero stays in the
cache and joins the free queue, which hands out least-recently-freed blocks first and
evicts their cache entry only then (LRU eviction).

Block 0 is the null block: never handed out; padding tokens write their K/V there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandem.request import Request


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


def hash_block_tokens(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """Chained hash of one full block (Python's tuple hash: deterministic for ints)."""
    return hash((parent_hash, tokens))


class BlockPool:
    """Physical blocks: free queue (LRU order), reference counts and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        # Insertion order = eviction order: freed blocks go to the back.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, block: KVCacheBlock) -> None:
        """Take a reference on a cached block (removing it from the free queue if idle)."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` free blocks, evicting their cached contents.

        Raises:
            RuntimeError: fewer than ``n`` blocks are free (callers check first).
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # A duplicate computed by a concurrent request keeps the first one canonical.
        self.cached.setdefault(block_hash, block)

    def evict_idle_cached_blocks(self) -> None:
        """Forget the cached contents of every idle block (e.g. after a failed step)."""
        for block in self.free_queue.values():
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero become free.

        Raises:
            AssertionError: a block's count would go negative (a double free).
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of KV block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Uncached blocks are the cheapest to reuse: hand them out first.
                    self.free_queue[block.block_id] = block
                    self.free_queue.move_to_end(block.block_id, last=False)
                else:
                    self.free_queue[block.block_id] = block


class KVCacheManager:
    """Maps sequences to blocks: prefix-cache lookup, slot allocation, freeing.

    Every sequence's blocks live in ``req_blocks[seq_id]`` until ``free`` is called once.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[int, list[KVCacheBlock]] = {}
        self.num_cached_hashed: dict[int, int] = {}  # blocks of a sequence already hashed
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences (0..1)."""
        return 1.0 - self.pool.num_free_blocks / self.num_usable_blocks

    def _update_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` over its full blocks of host-known tokens."""
        bs = self.block_size
        tokens = None
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            if tokens is None:
                tokens = req.all_token_ids
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs])))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the sequence, in full blocks.

        At least the last token is always left to compute, since its logits are needed.
        Returns (blocks, number of tokens they cover).
        """
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt token.
            return [], 0
        self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's prefix-cache lookup (for the hit rate)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``req.num_computed_tokens``,
        and ``num_lookahead_tokens`` after those (a draft model's K/V of its drafts).

        ``computed_blocks`` (first scheduling only) are prefix-cache hits to take a
        reference on. Returns False, changing nothing, when too few blocks are free.
        """
        blocks = self.req_blocks.get(req.seq_id, [])
        total = req.num_computed_tokens + num_new_tokens
        if not computed_blocks and total + num_lookahead_tokens <= len(blocks) * self.block_size:
            # Most decode steps: room in the last block, no list to rebuild, and (checked
            # here, before a call per sequence) no block filled up since the last hashing.
            if self.enable_caching and total // self.block_size > self.num_cached_hashed.get(req.seq_id, 0):
                self._cache_full_blocks(req, blocks, total)
            return True
        computed_blocks = computed_blocks or []
        num_needed = -(-(total + num_lookahead_tokens) // self.block_size) - len(blocks) - len(computed_blocks)
        # Cached hits that are idle sit in the free queue and count as free.
        idle_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - idle_hits:
            return False
        for b in computed_blocks:
            self.pool.touch(b)
        blocks = blocks + computed_blocks
        if num_needed > 0:
            blocks += self.pool.allocate(num_needed)
        self.req_blocks[req.seq_id] = blocks
        self._cache_full_blocks(req, blocks, total)
        return True

    def _cache_full_blocks(self, req: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Only tokens known on the host can be hashed (not one-step-ahead placeholders).
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self.num_cached_hashed.get(req.seq_id, 0)
        if not self.enable_caching or num_full <= start:
            return  # no block filled up since the last call: nothing to hash
        self._update_hashes(req)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], req.block_hashes[i])
        self.num_cached_hashed[req.seq_id] = max(start, num_full)

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(seq_id, [])]

    def free(self, req: Request) -> None:
        """Release the sequence's blocks (tail first, so its prefix stays cached longest).

        Idempotent: a second call for the same sequence does nothing.
        """
        blocks = self.req_blocks.pop(req.seq_id, None)
        self.num_cached_hashed.pop(req.seq_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))
