"""N-gram (prompt lookup) proposer: draft tokens copied from the request's own history.

Prompt lookup decoding (Saxena 2023) as vLLM V1's ``NgramProposer`` defines it: the
request's last ``n`` tokens are looked up earlier in its token history (prompt and
outputs), and the up to ``K`` tokens that followed that occurrence are proposed. Among
the ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` the longest one that occurs
earlier wins, and among the occurrences of that n-gram the *earliest* one (lowest
position) is taken, as vLLM does (its KMP scan over the reversed history keeps the last
reversed position of the longest match). An occurrence may overlap the suffix itself
(only the suffix's own position is excluded), and fewer than ``K`` tokens are proposed
when the history ends first.

Runs on the host with numpy: the candidates are the positions holding the last token,
and each of at most ``prompt_lookup_max - 1`` vectorized passes extends their match one
token to the left.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` draft tokens per request by n-gram lookup.

    ``num_speculative_tokens`` (K) >= 1, ``1 <= prompt_lookup_min <= prompt_lookup_max``:
    vLLM's speculative-config fields of the same names. ``max_model_len``, when given,
    caps the proposal so that history plus drafts never exceed it. Raises ValueError
    naming the field when a bound is violated.
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int, *, max_model_len: int | None = None,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({prompt_lookup_min}), got {prompt_lookup_max}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: np.ndarray) -> np.ndarray:
        """Draft tokens for one request whose history is ``token_ids`` (1-D, any integer
        dtype): the up to K tokens after the earliest earlier occurrence of the longest
        matching suffix n-gram, ``n`` in ``[prompt_lookup_min, prompt_lookup_max]``.
        Returns a new 1-D array of the input's dtype, empty when nothing matches (or when
        ``max_model_len`` leaves no room). Raises ValueError for a non-1-D input."""
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        total = tokens.shape[0]
        k = self.num_speculative_tokens
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - total)
        if k <= 0 or total <= self.prompt_lookup_min:
            return tokens[:0].copy()

        # End positions of candidate occurrences: every earlier copy of the last token.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if ends.size == 0:
            return tokens[:0].copy()
        lengths = np.ones(ends.shape[0], dtype=np.int64)
        alive = np.arange(ends.shape[0])
        for j in range(1, min(self.prompt_lookup_max, total - 1)):
            starts = ends[alive] - j
            inside = starts >= 0
            alive = alive[inside]
            alive = alive[tokens[starts[inside]] == tokens[total - 1 - j]]
            if alive.size == 0:
                break
            lengths[alive] += 1
        longest = int(lengths.max())
        if longest < self.prompt_lookup_min:
            return tokens[:0].copy()
        # ends is ascending, so argmax's first hit is the earliest occurrence.
        follow = int(ends[np.argmax(lengths == longest)]) + 1
        return tokens[follow:follow + k].copy()

    def propose_batch(self, token_ids: list[np.ndarray]) -> list[np.ndarray]:
        """:meth:`propose` for each request's history, in order."""
        return [self.propose(t) for t in token_ids]
