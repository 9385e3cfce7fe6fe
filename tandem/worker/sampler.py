"""Token sampling on the device, batched over requests with different parameters.

Order of logit processing follows vLLM V1's sampler: allowed token ids, logit bias,
min_tokens (stop ids masked), bad words, penalties (repetition: CTRL, Keskar et al. 2019; presence/frequency: OpenAI API),
then for random rows temperature, min-p (Nguyen et al. 2024), top-k, top-p (nucleus,
Holtzman et al. 2020). Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)``, which is an
exact sample of ``p`` (the exponential race / Gumbel-max trick). Seeded rows draw ``q``
from a generator seeded by ``(seed, index of the token)``, so their tokens depend on
nothing else in the batch, nor on preemption.
Logprobs are of the raw model distribution (before any processing), as vLLM V1 returns.

Ties: rows whose parameters leave no choice but "the most likely token" take
:func:`greedy_select` (lowest token id among equal maximal logits), whatever the dtype,
batch or mode; :func:`deterministic_rows` says which rows those are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

_SEED_MULT = 1_000_003
# A token this far (in nats) below the maximum has a probability under fp32's smallest
# normal number: a row whose other tokens are all that far below is deterministic.
_NEGLIGIBLE_NATS = -math.log(torch.finfo(torch.float32).smallest_normal)


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one step (rows = sequences that sample).

    temperature, top_p, min_p: ``[N]`` fp32 on the device; top_k: ``[N]`` int64 (vocab
    size where disabled). Optional parts are None when no row needs them.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [N] bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    # Penalties: rows of the penalty tables for penalised rows.
    penalty_rows: torch.Tensor | None  # [P] int64 rows of the batch
    penalty_slots: torch.Tensor | None  # [P] int64 rows of the state tables
    presence: torch.Tensor | None  # [P]
    frequency: torch.Tensor | None  # [P]
    repetition: torch.Tensor | None  # [P]
    # Sparse additive bias: (row indices, token ids, values); -inf masks for min_tokens
    # and bad words.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # Seeded rows: (row index, seed for this token).
    seeded: list[tuple[int, int]]
    max_num_logprobs: int  # -1: no row wants logprobs
    # allowed_token_ids: (rows [A] int64, mask [A, V] bool); other tokens are masked.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # Tokens the penalty tables do not hold yet, per penalised row: (indices [E] into
    # penalty_rows, token ids [E]); a verified position's drafts before it.
    pending_counts: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class SamplerOutput:
    """sampled: ``[N]`` int64. With logprobs: ``logprob_token_ids`` / ``logprobs``
    ``[N, 1 + K]`` (sampled token first, then the top K), ``sampled_ranks`` ``[N]``."""

    sampled: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, b: SamplingBatch, output_counts: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    """In place on ``logits [N, V]``; tables are ``[num_slots, V]`` (int32 counts, bool)."""
    rows, slots = b.penalty_rows, b.penalty_slots
    lg = logits[rows]
    counts = output_counts[slots]
    if b.pending_counts is not None:
        idx, toks = b.pending_counts
        counts.index_put_((idx, toks), torch.ones_like(toks, dtype=counts.dtype), accumulate=True)
    seen = counts > 0
    rep = b.repetition[:, None]
    penalised = seen | prompt_mask[slots]
    lg = torch.where(penalised, torch.where(lg > 0, lg / rep, lg * rep), lg)
    lg = lg - b.frequency[:, None] * counts - b.presence[:, None] * seen
    logits[rows] = lg


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside the top-k and the top-p nucleus with -inf (at least 1 kept)."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    v = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(v, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        before = probs.cumsum(dim=-1) - probs
        drop = before >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def greedy_select(logits: torch.Tensor) -> torch.Tensor:
    """The tie rule, in one place: per row of ``logits [N, V]`` the token of the maximal
    logit, the lowest token id among exactly equal maxima (``torch.argmax`` returns the
    first maximal index on every device). Returns ``[N]`` int64."""
    return logits.argmax(dim=-1)


def deterministic_rows(tempered: torch.Tensor, filtered: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Rows of a random-sampling batch whose choice is in fact "the most likely token".

    ``tempered [N, V]``: logits after temperature; ``filtered [N, V]``: the same after
    min-p, top-k and top-p (-inf = dropped); ``min_p [N]`` or None when no row uses it.
    A row is deterministic when the filters keep a single token (top_k = 1, a top_p at
    most the top token's probability), when min_p = 1 (only maximal tokens pass), or when
    the temperature is so small that every token below the maximum is more than
    ``_NEGLIGIBLE_NATS`` (87.3) below it, a probability under fp32's smallest normal
    number (a fixed threshold, not the softmax's underflow, which differs between devices
    that flush denormals and those that do not). Such rows must not draw among exact ties: they take :func:`greedy_select`, as
    temperature 0 does. A row whose top_k (say 2) or min_p < 1 keeps several tied tokens
    still samples among them. Returns ``[N]`` bool.
    """
    top = tempered.amax(dim=-1, keepdim=True)
    below_top_alive = (tempered < top) & (tempered > top - _NEGLIGIBLE_NATS)
    det = ~below_top_alive.any(dim=-1) | ((filtered > float("-inf")).sum(dim=-1) == 1)
    if min_p is not None:
        det |= min_p >= 1.0
    return det


def _processed(logits: torch.Tensor, b: SamplingBatch, output_counts: torch.Tensor | None,
               prompt_mask: torch.Tensor | None) -> torch.Tensor:
    """``logits`` after allowed token ids, bias and penalties (a new tensor when any applies)."""
    if b.allowed is not None:
        rows, mask = b.allowed
        logits = logits.index_put((rows,), logits[rows].masked_fill(~mask, float("-inf")))
    if b.bias is not None:
        rows, toks, vals = b.bias
        logits = logits.index_put((rows, toks), vals, accumulate=True)
    if b.penalty_rows is not None:
        logits = logits.clone() if b.bias is None and b.allowed is None else logits
        apply_penalties(logits, b, output_counts, prompt_mask)
    return logits


def _filtered(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits after temperature, the same after min-p, top-k and top-p: -inf = dropped)."""
    temp = torch.where(b.temperature < 1e-5, 1.0, b.temperature)
    tempered = x = logits / temp[:, None]
    if b.need_min_p:
        probs = x.softmax(dim=-1)
        thresh = probs.amax(dim=-1, keepdim=True) * b.min_p[:, None]
        x = x.masked_fill(probs < thresh, float("-inf"))
    if b.need_top_k or b.need_top_p:
        x = top_k_top_p(x, b.top_k if b.need_top_k else None, b.top_p if b.need_top_p else None)
    return tempered, x


def sample(logits: torch.Tensor, b: SamplingBatch, output_counts: torch.Tensor | None, prompt_mask: torch.Tensor | None) -> SamplerOutput:
    """Sample one token per row of ``logits [N, V]`` (fp32)."""
    raw_logprobs = logits.log_softmax(dim=-1) if b.max_num_logprobs >= 0 else None
    logits = _processed(logits, b, output_counts, prompt_mask)
    greedy = greedy_select(logits)
    if b.all_greedy:
        sampled = greedy
    else:
        tempered, x = _filtered(logits, b)
        probs = x.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        if b.seeded:
            gen = torch.Generator(device=probs.device)
            for row, seed in b.seeded:
                gen.manual_seed(seed)
                q[row].exponential_(generator=gen)
        # q = 0 would turn a dropped token's 0 / q into NaN, which argmax picks.
        random = (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        pick_greedy = deterministic_rows(tempered, x, b.min_p if b.need_min_p else None)
        if not b.all_random:
            pick_greedy |= b.greedy_mask
        sampled = torch.where(pick_greedy, greedy, random)

    out = SamplerOutput(sampled=sampled)
    if raw_logprobs is not None:
        k = b.max_num_logprobs
        sampled_lp = raw_logprobs.gather(1, sampled[:, None])
        out.sampled_ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
        if k > 0:
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
            out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
            out.logprob_token_ids = torch.cat([sampled[:, None], top_ids], dim=1)
        else:
            out.logprobs, out.logprob_token_ids = sampled_lp, sampled[:, None]
    return out


def repeat_rows(b: SamplingBatch, counts: list[int], drafts: list[list[int]] | None = None) -> SamplingBatch:
    """``b`` with its row ``i`` repeated ``counts[i]`` times (``N`` host ints >= 1): the
    per-position batch of sequences that verify several positions. Temperature, top-k,
    top-p, min-p, logit bias, allowed token ids, penalty settings and the logprobs count
    hold at every position alike; at position ``j`` of row ``i`` the penalties also count
    ``drafts[i][:j]`` (row ``i``'s draft tokens, ``len == counts[i] - 1``; needed with
    penalties), the tokens it follows that the tables do not hold yet.

    Raises:
        ValueError: ``b`` has seeds (speculative decoding draws seeded rows from generators
            of their own), or penalties without ``drafts``.
    """
    if b.seeded or (b.penalty_rows is not None and drafts is None):
        raise ValueError("repeat_rows: seeds are not repeated, and penalties need the drafts")
    device = b.temperature.device
    repeats = torch.tensor(counts, dtype=torch.long).to(device, non_blocking=True)
    rep = lambda t: t.repeat_interleave(repeats, output_size=sum(counts))  # noqa: E731
    starts = torch.tensor([0] + counts[:-1], dtype=torch.long).cumsum(0).to(device, non_blocking=True)
    return replace(b, temperature=rep(b.temperature), top_k=rep(b.top_k), top_p=rep(b.top_p), min_p=rep(b.min_p),
                   greedy_mask=None if b.greedy_mask is None else rep(b.greedy_mask),
                   bias=None if b.bias is None else _repeat_entries(b.bias[0], b.bias[1:], repeats, starts),
                   allowed=None if b.allowed is None else _repeat_entries(b.allowed[0], b.allowed[1:], repeats, starts),
                   **({} if b.penalty_rows is None else _repeat_penalties(b, repeats, starts, drafts)))


def _repeat_penalties(b: SamplingBatch, repeats: torch.Tensor, starts: torch.Tensor,
                      drafts: list[list[int]]) -> dict:
    """The penalty fields of :func:`repeat_rows`, with each position's pending draft tokens."""
    rows, slots, presence, frequency, repetition = _repeat_entries(
        b.penalty_rows, (b.penalty_slots, b.presence, b.frequency, b.repetition), repeats, starts)
    # Entry e's positions are consecutive from `base`; position j is pending drafts[row][:j].
    # Penalised rows and drafts are few: listed on the host.
    idx, toks, base = [], [], 0
    for row in b.penalty_rows.tolist():
        d = drafts[row]
        for j in range(1, len(d) + 1):
            idx += [base + j] * j
            toks += d[:j]
        base += len(d) + 1
    device = rows.device
    pending = None if not idx else (torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True),
                                    torch.tensor(toks, dtype=torch.long).to(device, non_blocking=True))
    return dict(penalty_rows=rows, penalty_slots=slots, presence=presence, frequency=frequency,
                repetition=repetition, pending_counts=pending)


def _repeat_entries(rows: torch.Tensor, values: tuple[torch.Tensor, ...], repeats: torch.Tensor,
                    starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-row entries (``rows [E]`` with ``values``, each ``[E, ...]``) for the rows of
    :func:`repeat_rows`: entry ``e`` once per position of its row, the position's new row
    first. ``starts [N]``: the first new row of each old row."""
    per_entry = repeats[rows]
    num = int(per_entry.sum())
    # Offset of each repeated entry within its run of per_entry[e] copies.
    run_start = (per_entry.cumsum(0) - per_entry).repeat_interleave(per_entry, output_size=num)
    offset = torch.arange(num, device=rows.device) - run_start
    new_rows = starts[rows].repeat_interleave(per_entry, output_size=num) + offset
    return (new_rows, *(v.repeat_interleave(per_entry, dim=0, output_size=num) for v in values))


def target_distribution(logits: torch.Tensor, b: SamplingBatch, output_counts: torch.Tensor | None = None,
                        prompt_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What speculative verification compares drafts with, per row of ``logits [N, V]``
    (fp32; ``b`` one row per row, :func:`repeat_rows`; ``output_counts`` / ``prompt_mask``
    the penalty tables when ``b`` has penalties): the probabilities :func:`sample` draws
    from after allowed token ids, logit bias, penalties, temperature, min-p, top-k and top-p, ``[N, V]`` float32, where rows :func:`sample` treats as greedy
    (temperature 0, :func:`deterministic_rows`) are a one-hot on their greedy token (the
    logits themselves when every row is greedy: only the greedy ids are used then); and
    the greedy ids, ``[N]`` int64 (:func:`greedy_select`)."""
    logits = _processed(logits, b, output_counts, prompt_mask)
    greedy = greedy_select(logits)
    if b.all_greedy:
        return logits, greedy
    tempered, x = _filtered(logits, b)
    probs = x.softmax(dim=-1)
    pick_greedy = deterministic_rows(tempered, x, b.min_p if b.need_min_p else None)
    if not b.all_random:
        pick_greedy |= b.greedy_mask
    one_hot = torch.zeros_like(probs).scatter_(1, greedy[:, None], 1.0)
    return torch.where(pick_greedy[:, None], one_hot, probs), greedy


def token_seed(seed: int, token_index: int) -> int:
    """Seed of the random draw for a seeded request's ``token_index``-th output token."""
    return (seed * _SEED_MULT + token_index) & 0x7FFF_FFFF_FFFF_FFFF
